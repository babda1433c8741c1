"""Attention tiles' kernels on a GPU (kit.recipe.levers.tile_kernels against round 5's SDPA path).

    python benchmarks/tools/tile_attention_bench.py [--lengths 131072 262144] [--paths sdpa:flash ...]
        [--skip-check] [--out FILE.jsonl]

1. Correctness: a tile of 64 queries at 192 over 256 keys (grouped heads 8/2, bf16), forward and
   backward, through tile_kernels on each GPU kernel (flash, cuDNN) against the math path with an
   explicit mask in fp32: the largest difference.
2. One decoder layer's attention at the 8B shape's heads (32 query heads, 8 key heads, 128 wide),
   8,192-query tiles, as a step with whole-layer recompute runs it:
   - round 5 (SDPA, lower-right mask): every tile's forward twice without a graph (forward, the
     layer's recompute), then forward and backward with one (the tile's backward);
   - tile_kernels: every tile's forward twice (keeping the second's output and log-sum-exp),
     then its backward kernels only.
   Time (CUDA events), peak memory above the inputs, and attention TFLOP/s counting a causal
   forward as 2 x 2 x S^2 / 2 x d x heads and backward as 2.5 of it (3.5 forwards' worth per
   pass in the new path, 4.5 in round 5's).
"""

from __future__ import annotations

import argparse
import json
import os
import time
import types

import torch

from kit.recipe.levers import tile_kernels
from kit.recipe.levers.attention_tiles import _attend

DEV, BF = torch.device("cuda"), torch.bfloat16
HEADS, KV, D, TILE = 32, 8, 128, 8192


def check(kernel: str) -> dict:
    os.environ["KIT_TILE_KERNEL"] = kernel
    g = torch.Generator(device=DEV).manual_seed(0)
    q = torch.randn(1, 8, 64, D, device=DEV, dtype=BF, generator=g)
    k = torch.randn(1, 2, 256, D, device=DEV, dtype=BF, generator=g)
    v = torch.randn(1, 2, 256, D, device=DEV, dtype=BF, generator=g)
    dout = torch.randn(1, 8, 64, D, device=DEV, dtype=BF, generator=g)
    out, lse, aux = tile_kernels.forward(q, k, v, 192, D**-0.5)
    dk, dv = torch.zeros_like(k), torch.zeros_like(v)
    dq = tile_kernels.backward(dout, q, k, v, out, lse, aux, 192, D**-0.5, dk, dv)
    qf, kf, vf = (t.float().requires_grad_(True) for t in (q, k, v))
    mask = torch.ones(64, 256, dtype=torch.bool, device=DEV).tril(192)
    ref = torch.nn.functional.scaled_dot_product_attention(
        qf, kf.repeat_interleave(4, 1), vf.repeat_interleave(4, 1), attn_mask=mask, scale=D**-0.5)
    ref.backward(dout.float())
    diff = [round((a.float() - b.float()).abs().max().item(), 4)
            for a, b in zip((out, dq, dk, dv), (ref, qf.grad, kf.grad, vf.grad), strict=True)]
    return {"what": "check", "kernel": kernel, "max_abs_diff_out_dq_dk_dv": diff}


def _timed(fn) -> tuple[float, float]:
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1e3, (torch.cuda.max_memory_allocated() - base) / 2**30


def layer(length: int, path: str, kernel: str = "flash") -> dict:
    os.environ["KIT_TILE_KERNEL"] = kernel
    attn = types.SimpleNamespace(scaling=D**-0.5)
    k = torch.randn(1, KV, length, D, device=DEV, dtype=BF)
    v = torch.randn(1, KV, length, D, device=DEV, dtype=BF)
    q = torch.randn(1, HEADS, TILE, D, device=DEV, dtype=BF)
    dout = torch.randn(1, HEADS, TILE, D, device=DEV, dtype=BF)
    spans = [(s, s + TILE) for s in range(0, length, TILE)]

    def old():
        with torch.no_grad():
            for _ in range(2):
                for s, e in spans:
                    _attend(attn, q, k[:, :, :e], v[:, :, :e], s)
        for s, e in spans:
            qt = q.detach().requires_grad_(True)
            kt = k[:, :, :e].detach().requires_grad_(True)
            vt = v[:, :, :e].detach().requires_grad_(True)
            _attend(attn, qt, kt, vt, s).backward(dout)

    def new():
        dk, dv = torch.zeros_like(k), torch.zeros_like(v)
        with torch.no_grad():
            for s, e in spans:
                tile_kernels.forward(q, k[:, :, :e], v[:, :, :e], s, attn.scaling)
            kept = [tile_kernels.forward(q, k[:, :, :e], v[:, :, :e], s, attn.scaling)
                    for s, e in spans]
            for (s, e), (a, lse, aux) in zip(spans, kept, strict=True):
                tile_kernels.backward(dout, q, k[:, :, :e], v[:, :, :e], a, lse, aux, s,
                                      attn.scaling, dk[:, :, :e], dv[:, :, :e])

    fn = old if path == "sdpa" else new
    fn()  # warm-up: kernels chosen, plans built
    seconds, peak = _timed(fn)
    fwd_flops = sum(4 * TILE * (e - TILE / 2) * D * HEADS for _, e in spans)
    passes = 4.5 if path == "sdpa" else 3.5
    return {"what": "layer", "length": length, "path": path, "kernel": kernel,
            "seconds": round(seconds, 3), "peak_gib": round(peak, 2),
            "tflops": round(passes * fwd_flops / seconds / 1e12, 1)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--lengths", type=int, nargs="+", default=[131072, 262144])
    ap.add_argument("--paths", nargs="+", default=["sdpa:flash", "tiles:flash", "tiles:cudnn"],
                    help="PATH:KERNEL pairs for part 2")
    ap.add_argument("--skip-check", action="store_true")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    rows = []
    for kernel in () if args.skip_check else ("flash", "cudnn"):
        try:
            rows.append(check(kernel))
        except Exception as e:  # noqa: BLE001 - a kernel this GPU or torch lacks: say so
            rows.append({"what": "check", "kernel": kernel, "error": f"{type(e).__name__}: {e}"[:300]})
        print(json.dumps(rows[-1]), flush=True)
    for length in args.lengths:
        for path, kernel in (p.split(":") for p in args.paths):
            t = time.perf_counter()
            try:
                rows.append(layer(length, path, kernel))
            except Exception as e:  # noqa: BLE001
                rows.append({"what": "layer", "length": length, "path": path, "kernel": kernel,
                             "error": f"{type(e).__name__}: {e}"[:300]})
            rows[-1]["wall_s"] = round(time.perf_counter() - t, 1)
            print(json.dumps(rows[-1]), flush=True)
            torch.cuda.empty_cache()
    if args.out:
        with open(args.out, "a") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)


if __name__ == "__main__":
    main()
