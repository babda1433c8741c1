"""One adapter down-projection with dropout, forward and backward, three ways (one GPU):

    python3 benchmarks/tools/lora_down_bench.py [OUT.json]

- `peft`: torch's dropout (a bernoulli mask, a dropped copy) then the matmul, compiled;
- `hash`: the hash mask (kit.recipe.drop_mask) as masked_fill, then the matmul,
  compiled (what the grouped experts ran before lora.fused_down);
- `fused`: kit.recipe.lora_down's kernels (the mask inside the tiles);
- `fused_p0`: the same kernels without dropout (what the mask itself costs them);
- each of the kernels alone (`kernel_down_ms`, `kernel_dx_ms`, `kernel_da_ms`, with dropout):
  triton.testing.do_bench (many launches, the L2 flushed between), no autograd around them.

Shapes: the Llama-3-8B layer's inputs at batch 10 x 2,048 tokens (q/k/v grouped, R = 48; the MLP's
down-projection input, 14,336 wide) and Qwen3-30B-A3B's sorted expert rows at batch 12 (128
experts, top 8; gate_up's and down's inputs). Prints and writes ms per call (median of 20)."""

from __future__ import annotations

import json
import sys

import torch

from kit.recipe import lora_down
from kit.recipe.drop_mask import drop_mask

P = 0.05


def _timed(fn, reps: int = 20) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def case(name, m, k, r, segments):
    g = torch.Generator("cuda").manual_seed(0)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
    a = (torch.randn(segments, r, k, device="cuda", generator=g) * 0.02).bfloat16().requires_grad_()
    counts = torch.full((segments,), m // segments, device="cuda")
    counts[-1] += m - counts.sum()
    bounds = torch.nn.functional.pad(torch.cumsum(counts, 0), (1, 0)).int()
    rows = torch.randperm(m, device="cuda") if segments > 1 else None
    cot = torch.randn(m, r, device="cuda", dtype=torch.bfloat16, generator=g)
    threshold = lora_down.threshold_of(P)
    ends = bounds.tolist()

    def per_segment(h):
        if segments == 1:
            return h @ a[0].t()
        return torch._grouped_mm(h, a.transpose(1, 2), offs=bounds[1:])

    @torch.compile
    def peft(x):
        return per_segment(torch.nn.functional.dropout(x, P, True))

    @torch.compile
    def hashed(x, seed):
        ids = rows if rows is not None else torch.arange(m, device="cuda")
        return per_segment(x.masked_fill(drop_mask(seed, ids, k, threshold), 0))

    def fused(x, seed):
        return lora_down.lora_down(x, a, bounds if segments > 1 else None, rows, seed, threshold)

    seed = torch.tensor([7], dtype=torch.int32, device="cuda")
    ways = {"peft": lambda: peft(x), "hash": lambda: hashed(x, seed),
            "fused": lambda: fused(x, seed), "fused_p0": lambda: fused(x, None)}
    out = {"case": name, "rows": m, "width": k, "rank": r, "segments": segments,
           "ends_checked": ends[-1] == m}
    for way, fn in ways.items():
        out[f"{way}_fwd_ms"] = round(_timed(fn), 3)
        out[f"{way}_fwd_bwd_ms"] = round(_timed(lambda fn=fn: fn().backward(cot)), 3)
        x.grad = a.grad = None
    from triton.testing import do_bench

    ops, b = lora_down.kernels(), bounds if segments > 1 else None
    with torch.no_grad():
        kernels = {"down": lambda: ops.down_op(x, a, b, rows, seed, threshold),
                   "dx": lambda: ops.dx_op(cot, a, b, rows, seed, threshold, x),
                   "da": lambda: ops.da_op(cot, x, b, rows, seed, threshold, a)}
        for kernel, fn in kernels.items():
            out[f"kernel_{kernel}_ms"] = round(do_bench(fn, warmup=25, rep=200), 3)
    return out


def main(argv):
    rows = [case("8B q/k/v input, b10", 20480, 4096, 48, 1),
            case("8B down_proj input, b10", 20480, 14336, 16, 1),
            case("30B-A3B gate_up input, b12", 12 * 2048 * 8, 2048, 16, 128),
            case("30B-A3B down input, b12", 12 * 2048 * 8, 768, 16, 128)]
    for row in rows:
        print(json.dumps(row))
    if argv:
        with open(argv[0], "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                       "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1:])
