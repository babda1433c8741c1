"""bitsandbytes' NF4 dequantize against kit.recipe.nf4's kernel (one GPU): the values (equal bit
for bit?), the time and bytes a second, per weight shape; then a 4-bit linear layer's forward and
backward through each. One JSON line per row.

    python3 benchmarks/tools/nf4_dequant_bench.py [--out FILE]
"""

import argparse
import json
import sys

import bitsandbytes as bnb
import bitsandbytes.functional as F
import torch

from kit.recipe import nf4

SHAPES = {  # (out, in): Llama-3-8B's projections; Qwen3-30B-A3B's expert stacks as stored
    "8b q/o": (4096, 4096), "8b k/v": (1024, 4096), "8b gate/up": (14336, 4096),
    "8b down": (4096, 14336), "30b-a3b gate_up stack": (128 * 1536, 2048),
    "30b-a3b down stack": (128 * 2048, 768),
}


def timed(fn, iters=50, warmup=10) -> float:
    for _ in range(warmup):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def quantized(shape, dtype=torch.bfloat16, nested=True, storage=torch.bfloat16):
    w = torch.randn(shape, device="cuda", dtype=dtype) * 0.02
    return F.quantize_4bit(w, blocksize=64, compress_statistics=nested, quant_type="nf4",
                           quant_storage=storage)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    out = open(args.out, "w") if args.out else sys.stdout
    torch.manual_seed(0)

    def emit(row):
        print(json.dumps(row), file=out, flush=True)

    for name, shape in SHAPES.items():
        packed, state = quantized(shape)
        ref = F.dequantize_4bit(packed, state)
        mine = nf4.dequantize(packed, state)
        n = ref.numel()
        t_bnb = timed(lambda: F.dequantize_4bit(packed, state))
        t_kit = timed(lambda p=packed, s=state: nf4.dequantize(p, s))
        moved = n * 2 + n / 2 + n / 64  # bytes written (bf16), packed read, absmax read
        emit({"kind": "dequant", "shape": name, "values": n, "equal": bool(torch.equal(ref, mine)),
              "bnb_ms": round(t_bnb, 4), "kit_ms": round(t_kit, 4),
              "bnb_tb_s": round(moved / t_bnb / 1e9, 3), "kit_tb_s": round(moved / t_kit / 1e9, 3),
              "speedup": round(t_bnb / t_kit, 3)})
        del ref, mine
    # layouts: absmax not quantized, fp16 and fp32, uint8 storage, a last block cut short
    for label, shape, kw in [
        ("plain absmax", (4096, 4096), {"nested": False}),
        ("fp16", (4096, 4096), {"dtype": torch.float16, "storage": torch.float16}),
        ("fp32", (1024, 4096), {"dtype": torch.float32, "storage": torch.float32}),
        ("uint8 storage", (1024, 4096), {"storage": torch.uint8}),
        ("short last block", (1000, 1), {}),
    ]:
        packed, state = quantized(shape, **kw)
        emit({"kind": "layout", "layout": label,
              "equal": bool(torch.equal(F.dequantize_4bit(packed, state),
                                        nf4.dequantize(packed, state)))})
    # the layer: forward, and backward to the input (4,096 tokens, bf16)
    for name in ("8b q/o", "8b gate/up", "8b down"):
        shape = SHAPES[name]
        packed, state = quantized(shape)
        x = torch.randn(4096, shape[1], device="cuda", dtype=torch.bfloat16, requires_grad=True)
        g = torch.randn(4096, shape[0], device="cuda", dtype=torch.bfloat16)

        def run(fn):
            x.grad = None
            y = fn()
            y.backward(g)
            return y.detach(), x.grad.detach()

        y0, dx0 = run(lambda: bnb.matmul_4bit(x, packed.t(), quant_state=state))
        y1, dx1 = run(lambda: nf4.linear(x, packed, None, state))
        t_bnb = timed(lambda: run(lambda: bnb.matmul_4bit(x, packed.t(), quant_state=state)))
        t_kit = timed(lambda: run(lambda: nf4.linear(x, packed, None, state)))
        emit({"kind": "linear", "shape": name, "tokens": 4096,
              "equal": bool(torch.equal(y0, y1) and torch.equal(dx0, dx1)),
              "bnb_ms": round(t_bnb, 4), "kit_ms": round(t_kit, 4),
              "speedup": round(t_bnb / t_kit, 3)})


if __name__ == "__main__":
    main()
