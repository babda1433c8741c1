"""Kernels alone on one GPU (one JSON line a row): lora.fused_down's `down` with its columns split
against one share (dense rows at batches 2 and 10); the experts' gather_sum against the compiled
torch expression (Qwen3-30B-A3B's shape at batch 13); the NF4 dequantize's tile per program.
Ran at tree 48ca421 (kit.recipe.experts_kernels lives on branch moe-gather-sum since):

    python3 kernels_alone.py rows-kernels.jsonl
"""
import json, sys
import torch, triton
from triton.testing import do_bench
from kit.recipe import lora_down, lora_down_kernels as K, nf4_kernels as N, grouped_experts as G
from kit.recipe.experts_kernels import gather_sum_op
from kit.recipe.drop_mask import threshold_of

out = open(sys.argv[1], "w")
def emit(r):
    print(json.dumps(r)); out.write(json.dumps(r) + "\n"); out.flush()

dev = torch.device("cuda")
lora_down.kernels()
thr = threshold_of(0.05)
seed = torch.tensor([123], dtype=torch.int32, device=dev)
auto = K.down_split
for m in (4096, 20480):
    for k, r, name in ((4096, 48, "q/k/v"), (4096, 16, "o"), (4096, 32, "gate/up"), (14336, 16, "down")):
        x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
        a = torch.randn(1, r, k, device=dev, dtype=torch.bfloat16) * 0.02
        res = {}
        for label, fn in (("split", auto), ("one", lambda *_: 1)):
            K.down_split = fn
            y = K.down_op(x, a, None, None, seed, thr)
            ms = do_bench(lambda: K.down_op(x, a, None, None, seed, thr), rep=200)
            res[label] = (ms, y.float())
        K.down_split = auto
        moved = m * k * 2
        emit({"kind": "down", "rows": m, "k": k, "r": r, "adapter": name, "split": auto(m, k, dev),
              "split_ms": round(res["split"][0], 4), "one_ms": round(res["one"][0], 4),
              "split_tb_s": round(moved / res["split"][0] / 1e9, 3),
              "one_tb_s": round(moved / res["one"][0] / 1e9, 3),
              "max_diff": float((res["split"][1] - res["one"][1]).abs().max()),
              "top": float(res["one"][1].abs().max())})

# gather_sum at Qwen3-30B-A3B's shape, batch 13
T, k, H, E = 26624, 8, 2048, 128
index = torch.rand(T, E, device=dev).topk(k).indices
groups = G.Groups(index, E, True)
a = torch.randn(T * k, H, device=dev, dtype=torch.bfloat16)
b = torch.randn(T * k, H, device=dev, dtype=torch.bfloat16)
w = torch.rand(T, k, device=dev).to(torch.bfloat16)
inv = groups.inverse
comb = torch.compile(lambda a, b, inv, w: (((a + b)[inv].view(T, k, H) * w[..., None]).sum(1)))
disp = torch.compile(lambda g, inv: g[inv].view(T, k, H).sum(1))
for label, mine, ref, moved in (
        ("combine (a + b, weighted)", lambda: gather_sum_op(a, b, inv, w, k, torch.bfloat16),
         lambda: comb(a, b, inv, w), 2 * a.numel() * 2 + T * H * 2),
        ("dispatch gradient (a)", lambda: gather_sum_op(a, None, inv, None, k, torch.bfloat16),
         lambda: disp(a, inv), a.numel() * 2 + T * H * 2)):
    y0, y1 = mine().float(), ref().float()
    t0, t1 = do_bench(mine, rep=300), do_bench(ref, rep=300)
    emit({"kind": "gather_sum", "case": label, "kernel_ms": round(t0, 4), "compiled_ms": round(t1, 4),
          "kernel_tb_s": round(moved / t0 / 1e9, 3), "compiled_tb_s": round(moved / t1 / 1e9, 3),
          "max_diff": float((y0 - y1).abs().max()), "top": float(y1.abs().max())})
del a, b

# NF4 dequantize: values a program, warps
import bitsandbytes.functional as F
for shape, name in (((14336, 4096), "8b gate/up"), ((4096, 4096), "8b q/o"), ((128 * 1536, 2048), "30b gate_up stack")):
    wt = torch.randn(shape, device=dev, dtype=torch.bfloat16) * 0.02
    packed, st = F.quantize_4bit(wt, blocksize=64, compress_statistics=True, quant_type="nf4",
                                 quant_storage=torch.bfloat16)
    ref = F.dequantize_4bit(packed, st)
    n = ref.numel(); moved = n * 2 + n / 2 + n / 64
    o = torch.empty_like(ref)
    from kit.recipe import nf4
    pk = nf4._bytes(packed)
    code, absmax, absmax2, code2, offset = nf4._tensors(st)
    for rows in (16, 32, 64, 128, 256):
        for warps in (2, 4, 8):
            def go():
                N.dequant[(triton.cdiv(triton.cdiv(n, 64), rows),)](
                    pk, code, absmax, absmax2, code2, offset, o, pk, n, NESTED=True,
                    BS=64, BS2=256, ROWS=rows, num_warps=warps)
            go()
            ok = bool(torch.equal(o, ref))
            ms = do_bench(go, rep=200)
            emit({"kind": "dequant", "shape": name, "rows": rows, "warps": warps, "equal": ok,
                  "ms": round(ms, 4), "tb_s": round(moved / ms / 1e9, 3)})
