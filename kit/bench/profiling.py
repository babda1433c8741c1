"""One benchmark step under torch.profiler (kit.bench.worker's `profile` rows): GPU time per
kernel family, the costliest kernels, the share of the step the GPU sat idle, and where the
host's time went. GPUs only (the worker asks for it where the matrix's case has `profile`)."""

from __future__ import annotations

import time

import torch

# Kernel families by name (first match wins): where a step's GPU time goes.
KERNEL_FAMILIES = [
    ("nccl", ("nccl",)), ("attention", ("flash", "fmha", "cudnn", "attention", "sdpa")),
    ("optimizer", ("adam", "multi_tensor")),
    ("4-bit dequantize", ("dequant",)),
    ("matmul", ("gemm", "nvjet", "cutlass", "xmma", "sm90_", "splitk", "cublas")),
    ("compiled (triton)", ("triton",)), ("copy", ("memcpy", "memset", "copy")),
]


def _is_annotation(name: str) -> bool:
    """Ranges that modules and optimizers mark on the GPU timeline: spans, not kernels."""
    marks = ("FSDP::", "Optimizer.", "FullyShardedDataParallel", "DistributedDataParallel",
             "ProfilerStep", "## ")
    return name.startswith(marks) or "#" in name


# The kit's Triton kernels of lora.fused_down (kit/recipe/lora_down_kernels.py), by their exact
# names: the adapters' down-projection with its dropout, its input's and its factor's gradients,
# and the up-projection added onto the base's result (`up_add`).
LORA_KERNELS = ("down", "dx", "da", "up_add")
# kit/recipe/experts_kernels.py: a mixture of experts' sorted rows back to the tokens, weighted
# and summed (`gather_sum`), and that sum's gradients in one pass (`combine_grad`).
EXPERTS_KERNELS = ("gather_sum", "combine_grad")


def kernel_family(name: str) -> str:
    if name in LORA_KERNELS:
        return "LoRA (kit, Triton)"
    if name in EXPERTS_KERNELS:
        return "experts' rows (kit, Triton)"
    low = name.lower()
    return next((fam for fam, keys in KERNEL_FAMILIES if any(k in low for k in keys)),
                "other eager kernels")


def idle(spans: list[tuple[float, float]], host: list[tuple[float, float, str, int]],
         start: float, end: float, least_us: float = 20.0) -> dict:
    """Where the GPU sat idle in a profiled step, and what the host was doing then. `spans`:
    kernel (start, end) in us, any streams; `host`: CPU ops (start, end, name, thread); `start`,
    `end`: the step's bounds. lead: before the first kernel; tail: after the last; gaps: the
    idle stretches of at least `least_us` between kernels, each named by the host op that held
    the CPU at its middle on the thread of the longest such op (outer > inner; "python" where no
    op held it: the interpreter between ops), summed by name, the costliest first, and the
    eight longest with their offsets from the step's start (ms). What idles the GPU mid-step is
    a read-back (a synchronize in an op) or a host that queues kernels slower than they run."""
    spans = sorted(spans)
    if not spans:
        return {"lead_ms": round((end - start) / 1e3, 1), "tail_ms": 0.0, "gaps_ms": 0.0,
                "by_host_ms": [], "longest": []}
    gaps, reach = [], spans[0][1]
    for a, b in spans[1:]:
        if a - reach >= least_us:
            gaps.append((reach, a))
        reach = max(reach, b)
    mids = sorted(((a + b) / 2, a, b) for a, b in gaps)
    stacks: dict[int, list] = {}  # per thread, at each middle in turn: the ops holding the CPU
    for thread in {h[3] for h in host}:
        ops = sorted((h for h in host if h[3] == thread), key=lambda h: (h[0], -h[1]))
        stack, i, at = [], 0, []
        for t, _, _ in mids:  # ops nest on a thread: a stack, swept once
            while i < len(ops) and ops[i][0] <= t:
                while stack and stack[-1][1] <= ops[i][0]:
                    stack.pop()
                stack.append(ops[i])
                i += 1
            while stack and stack[-1][1] <= t:
                stack.pop()
            at.append(list(stack))
        stacks[thread] = at
    named = []
    for j, (_, a, b) in enumerate(mids):
        held = [st[j] for st in stacks.values() if st[j]]
        if not held:
            named.append(("python", a, b))
            continue
        chain = max(held, key=lambda st: st[0][1] - st[0][0])  # the longest outer op's thread
        outer, inner = chain[0][2][:60], chain[-1][2][:60]
        named.append((outer if outer == inner else f"{outer} > {inner}", a, b))
    by_name: dict[str, list] = {}
    for name, a, b in named:
        row = by_name.setdefault(name, [name, 0.0, 0])
        row[1] += b - a
        row[2] += 1
    longest = sorted(named, key=lambda g: g[1] - g[2])[:8]
    return {"lead_ms": round((spans[0][0] - start) / 1e3, 1),
            "tail_ms": round(max(0.0, end - reach) / 1e3, 1),
            "gaps_ms": round(sum(b - a for a, b in gaps) / 1e3, 1),
            "by_host_ms": [[n, round(us / 1e3, 2), c] for n, us, c in
                           sorted(by_name.values(), key=lambda r: -r[1])[:10]],
            "longest": [[n, round((a - start) / 1e3, 1), round((b - a) / 1e3, 2)]
                        for n, a, b in longest]}


def profile_step(run, batch: dict, trace: str | None = None) -> dict:
    """One more step under torch.profiler: GPU time per kernel family, the 20 costliest
    kernels and the 15 costliest of "other eager kernels" (with their launches: what that
    family is made of), plus the share of the step the GPU sat idle (launch overhead, host syncs),
    where the host's time went (host_side) and what it was doing while the GPU waited (idle).
    `trace`: a path to write the whole timeline to (Chrome's trace format, gzipped)."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize(run.env.device)
    t = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        run.step(batch)
        torch.cuda.synchronize(run.env.device)
    wall_ms = (time.perf_counter() - t) * 1e3
    events = prof.events()
    kernels = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA
               and not _is_annotation(e.name)]
    by_family: dict[str, float] = {}
    by_name: dict[str, float] = {}
    launched: dict[str, int] = {}
    if trace:  # the whole timeline, for chrome://tracing or Perfetto
        import gzip
        import os
        import tempfile

        with tempfile.TemporaryDirectory() as tmp:
            prof.export_chrome_trace(os.path.join(tmp, "trace.json"))
            with open(os.path.join(tmp, "trace.json"), "rb") as f, gzip.open(trace, "wb") as out:
                out.write(f.read())
    spans = sorted((e.time_range.start, e.time_range.end) for e in kernels)
    busy, end = 0.0, float("-inf")
    for a, b in spans:  # union of kernel intervals over all streams
        busy += max(0.0, b - max(a, end))
        end = max(end, b)
    for e in kernels:
        us = e.time_range.elapsed_us()
        by_family[kernel_family(e.name)] = by_family.get(kernel_family(e.name), 0.0) + us
        by_name[e.name] = by_name.get(e.name, 0.0) + us
        launched[e.name] = launched.get(e.name, 0) + 1
    top = sorted(by_name.items(), key=lambda kv: -kv[1])[:20]
    eager = sorted(((n, v) for n, v in by_name.items()
                    if kernel_family(n) == "other eager kernels"), key=lambda kv: -kv[1])[:15]
    return {"wall_ms": round(wall_ms, 1), "gpu_busy_ms": round(busy / 1e3, 1),
            "families_ms": {k: round(v / 1e3, 1) for k, v in
                            sorted(by_family.items(), key=lambda kv: -kv[1])},
            "top_kernels_ms": [[n[:90], round(v / 1e3, 2)] for n, v in top],
            "top_eager_ms": [[n[:200], round(v / 1e3, 2), launched[n]] for n, v in eager],
            "host": host_side(prof.key_averages()),
            "idle": idle(spans, [(e.time_range.start, e.time_range.end, e.name, e.thread)
                                 for e in events if e.device_type != torch.autograd.DeviceType.CUDA],
                         min(e.time_range.start for e in events),
                         max(e.time_range.end for e in events))}


def host_side(averages) -> dict:
    """Where the host's time of a profiled step goes (torch.profiler's key_averages: key, count,
    self_cpu_time_total in us): the CUDA runtime calls (launches; waits on the GPU, which
    synchronize or copy to pageable memory), the ops' own CPU time, and the 15 costliest ops.
    The step's wall time less `ops_self_ms` is Python between the ops."""
    runtime, ops = {}, []
    for a in averages:
        if a.key.startswith(("cuda", "cu")) and not a.key.startswith("cutlass"):
            runtime[a.key] = (a.count, a.self_cpu_time_total)
        else:
            ops.append(a)
    launches = sum(c for k, (c, _) in runtime.items() if "Launch" in k)
    waits = sum(t for k, (_, t) in runtime.items()
                if "Synchronize" in k or k in ("cudaMemcpy", "cuMemcpy"))  # fmt: skip
    top = sorted(ops, key=lambda a: -a.self_cpu_time_total)[:15]
    return {"launches": launches, "waits_ms": round(waits / 1e3, 1),
            "runtime_ms": {k: [c, round(t / 1e3, 1)] for k, (c, t) in
                           sorted(runtime.items(), key=lambda kv: -kv[1][1])[:8]},
            "ops_self_ms": round(sum(a.self_cpu_time_total for a in ops) / 1e3, 1),
            "top_ops_ms": [[a.key[:60], a.count, round(a.self_cpu_time_total / 1e3, 1)]
                           for a in top]}  # fmt: skip
