"""The microbenchmark of one attention call: time, memory and numerics per implementation.

    rows = child.call("kit.lab.attention_bench:sweep", seq_lens=[512, 1024],
                      implementations=["eager", "sdpa", "sdpa_math"], device="cuda")
    plot(rows)

For each implementation (kit.recipe.attention's names) and sequence length, the function transformers
runs inside the model, with the causal mask that implementation takes, forward and backward, on
random q, k, v: milliseconds, peak memory above the inputs, and the largest difference from SDPA's
math kernel in float32. A kernel that cannot run, or runs out of memory, is a row with its error.

sweep() imports torch and may initialise CUDA: notebook 06 runs it in a child process through
kit.run.child; plot() needs only matplotlib.
"""

from __future__ import annotations

import importlib.util
import statistics

from kit.config import ConfigError
from kit.recipe.attention import (
    NAMES,
    CallingModule,
    dtype_name,
    first_line,
    resolve,
    torch_device,
    torch_dtype,
)

# Largest |output - fp32 math reference| that counts as agreeing, by dtype.
TOLERANCE = {"float32": 1e-4, "float16": 5e-3, "bfloat16": 3e-2}


def _call(name: str, seq_len: int, heads: int, kv_heads: int, device, dtype):
    """fn(q, k, v) -> attention output (batch, seq, heads, head_dim): the function transformers
    runs for implementation `name`, with the causal mask that implementation takes."""
    import torch
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    groups = heads // kv_heads
    if name == "eager":
        from transformers.models.llama.modeling_llama import eager_attention_forward

        # The additive causal mask the model builds for eager (once per forward, all layers).
        mask = torch.full((seq_len, seq_len), torch.finfo(dtype).min, device=device, dtype=dtype)
        mask = mask.triu(1)[None, None]
        module = CallingModule(groups, "eager")
        return lambda q, k, v: eager_attention_forward(
            module, q, k, v, mask, scaling=q.shape[-1] ** -0.5)[0]
    if name == "flash_attention_2":
        if importlib.util.find_spec("flash_attn") is None:
            raise RuntimeError("the flash-attn package is not installed (the recipe uses sdpa then)")
        if device.type != "cuda" or dtype == torch.float32:
            raise RuntimeError("flash_attention_2 runs on CUDA GPUs in float16 or bfloat16 only")
    if name == "flex_attention":
        from torch.nn.attention.flex_attention import create_block_mask

        mask = create_block_mask(lambda b, h, q, kv: q >= kv, None, None, seq_len, seq_len,
                                 device=str(device))  # fmt: skip
    else:
        mask = None  # sdpa and flash: is_causal, as the model runs a batch without padding
    impl, _ = resolve(name)
    fn, module = ALL_ATTENTION_FUNCTIONS[impl], CallingModule(groups, impl)
    return lambda q, k, v: fn(module, q, k, v, mask, scaling=q.shape[-1] ** -0.5, dropout=0.0)[0]


def _inputs(batch, seq_len, heads, kv_heads, head_dim, device, dtype, seed):
    """q, k, v as an attention layer hands them over: (batch, heads, seq, head_dim) views of
    (batch, seq, heads, head_dim) projections; the leaves (which get .grad) and an output grad."""
    import torch

    g = torch.Generator(device="cpu").manual_seed(seed)
    shapes = [(batch, seq_len, h, head_dim) for h in (heads, kv_heads, kv_heads)]
    leaves = [torch.randn(s, generator=g).to(device, dtype).requires_grad_() for s in shapes]
    grad = torch.randn(batch, seq_len, heads, head_dim, generator=g).to(device, dtype)
    return leaves, grad


def _reference(leaves, grad):
    """Output and q, k, v gradients from SDPA's math kernel in float32, one key-value head (and
    its query heads) of one sequence at a time: exact, and the seq x seq scores stay small."""
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    q, k, v = leaves
    batch, _, heads, head_dim = q.shape
    groups = heads // k.shape[2]
    out = torch.empty(q.shape, device=q.device, dtype=torch.float32)
    grads = [torch.empty(t.shape, device=t.device, dtype=torch.float32) for t in leaves]
    for b in range(batch):
        for j in range(k.shape[2]):
            heads_j = (b, slice(None), slice(j * groups, (j + 1) * groups))
            where = [heads_j, (b, slice(None), slice(j, j + 1)), (b, slice(None), slice(j, j + 1))]
            part = [t[w].detach().float()[None].requires_grad_()
                    for t, w in zip(leaves, where, strict=True)]  # fmt: skip
            with sdpa_kernel(SDPBackend.MATH):
                o = sdpa_attention_forward(CallingModule(groups), *(t.transpose(1, 2) for t in part),
                                           None, scaling=head_dim**-0.5)[0]  # fmt: skip
            o.backward(grad[heads_j].float()[None])
            out[heads_j] = o.detach()[0]
            for g, t, w in zip(grads, part, where, strict=True):
                g[w] = t.grad[0]
    return out, grads


def _cpu_peak_bytes(step) -> int:
    """Peak bytes the CPU allocator held above the start while step() ran (torch.profiler)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    events = [e for e in prof.profiler.kineto_results.events()
              if e.name() == "[memory]" and e.device_type().name == "CPU"]  # fmt: skip
    live = peak = 0
    for e in sorted(events, key=lambda e: e.start_ns()):
        live += e.nbytes()
        peak = max(peak, live)
    return peak


def _measure(fn, leaves, grad, repeats: int) -> dict:
    import time

    import torch

    q, k, v = (t.transpose(1, 2) for t in leaves)
    device = grad.device

    def step():
        fn(q, k, v).backward(grad)
        for t in leaves:
            t.grad = None

    out = fn(q, k, v)  # also the warm-up (flex_attention compiles here)
    out.backward(grad)
    result = {"out": out.detach().float(), "grads": [t.grad.float() for t in leaves]}
    for t in leaves:
        t.grad = None
    del out
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
        step()
        result["peak_mib"] = (torch.cuda.max_memory_allocated(device) - base) / 2**20
        times = []
        for _ in range(repeats):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            step()
            end.record()
            torch.cuda.synchronize(device)
            times.append(start.elapsed_time(end))
    else:
        result["peak_mib"] = _cpu_peak_bytes(step) / 2**20
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            step()
            times.append((time.perf_counter() - t0) * 1e3)
    result["ms"] = statistics.median(times)
    return result


def sweep(seq_lens, implementations=NAMES, batch: int = 1, heads: int = 8,
          kv_heads: int | None = None, head_dim: int = 64, device="auto", dtype="bfloat16",
          repeats: int = 3, seed: int = 0) -> list[dict]:  # fmt: skip
    """One causal attention call, forward + backward, per implementation and sequence length.

    Each row: `ms` (median of `repeats` after a warm-up: CUDA events on a GPU, perf_counter on
    CPU); `peak_mib`, the memory the call added above its inputs (GPU: torch.cuda
    .max_memory_allocated; CPU: the allocator's peak as torch.profiler records it), named in
    `memory`; `out_diff` / `grad_diff`, the largest absolute difference of the output / of the
    q, k, v gradients from SDPA's math kernel in float32, and `agrees` (out_diff within
    TOLERANCE[dtype]); `error`: why it did not run (out of memory, no kernel), never raised."""
    import gc

    import torch

    for name in implementations:
        if name not in NAMES:
            raise ConfigError(f"implementations: {name!r} is not allowed; expected some of "
                              f"{', '.join(NAMES)}")  # fmt: skip
    dev, dt = torch_device(device), torch_dtype(dtype)
    kv_heads = kv_heads or heads
    memory = ("cuda max_memory_allocated above inputs" if dev.type == "cuda"
              else "CPU allocator peak above inputs (torch.profiler)")  # fmt: skip
    rows = []
    for n in seq_lens:
        leaves, grad = _inputs(batch, n, heads, kv_heads, head_dim, dev, dt, seed)
        ref_out, ref_grads = _reference(leaves, grad)
        for name in implementations:
            row = {"implementation": name, "seq_len": n, "ms": None, "peak_mib": None,
                   "out_diff": None, "grad_diff": None, "agrees": None, "error": None,
                   "device": dev.type, "dtype": dtype_name(dt), "memory": memory}  # fmt: skip
            for t in leaves:  # an earlier row may have failed halfway through its backward
                t.grad = None
            try:
                got = _measure(_call(name, n, heads, kv_heads, dev, dt), leaves, grad, repeats)
                out_diff = (got["out"] - ref_out).abs().max().item()
                grad_diff = max((g - r).abs().max().item()
                                for g, r in zip(got["grads"], ref_grads, strict=True))  # fmt: skip
                row.update(ms=round(got["ms"], 3), peak_mib=round(got["peak_mib"], 2),
                           out_diff=out_diff, grad_diff=grad_diff,
                           agrees=out_diff <= TOLERANCE[row["dtype"]])  # fmt: skip
                del got
            except Exception as e:  # noqa: BLE001 - a row, not a crash (OOM, no kernel, ...)
                row["error"] = ("out of memory: " if isinstance(e, torch.OutOfMemoryError)
                                else "") + first_line(e)  # fmt: skip
            rows.append(row)
            gc.collect()
            if dev.type == "cuda":
                torch.cuda.empty_cache()
        del leaves, grad, ref_out, ref_grads
    return rows


def plot(rows: list[dict], axes=None):
    """Time and memory against sequence length, one line per implementation (log-log)."""
    import matplotlib.pyplot as plt

    axes = axes if axes is not None else plt.subplots(1, 2, figsize=(11, 3.8))[1]
    for name in dict.fromkeys(r["implementation"] for r in rows):
        ok = [r for r in rows if r["implementation"] == name and r["error"] is None]
        if ok:
            x = [r["seq_len"] for r in ok]
            axes[0].plot(x, [r["ms"] for r in ok], marker="o", label=name)
            axes[1].plot(x, [max(r["peak_mib"], 1e-3) for r in ok], marker="o", label=name)
    where = f"{rows[0]['device']}, {rows[0]['dtype']}" if rows else ""
    for ax, label in zip(axes, ("ms per forward + backward", "peak MiB above inputs"),
                         strict=True):  # fmt: skip
        ax.set(xscale="log", yscale="log", xlabel="sequence length", ylabel=label, title=where)
        ax.set_xticks(sorted({r["seq_len"] for r in rows}), minor=False)
        ax.set_xticklabels(sorted({r["seq_len"] for r in rows}))
    axes[0].legend(fontsize=8)
    return axes
