"""Where a kit.bench case's GPU sits idle between kernels, in one profiled training step (issue 35).

    torchrun --nproc_per_node=1 benchmarks/tools/gaps.py MATRIX CASE [OUT.json]

Builds the case as benchmarks/tools/host_lead.py does, runs 3 steps, then one more under torch.profiler
with CUDA activity only (the least host cost the profiler has). From the trace: every kernel and
copy on every stream, the union of their intervals, and each gap in that union (no stream busy).
A gap is "host" when the next kernel was launched after the GPU had gone idle (the host was
late), else "device" (it was queued in time: a dependency between streams, or the launch
latency between two kernels). Gaps are summed by the pair of operations around them.
Gap filled: the profiler's tables give time per operator, not the idle time between kernels.
"""

from __future__ import annotations

import collections
import json
import re
import sys
import tempfile
from pathlib import Path

import torch


def short(name: str) -> str:
    name = re.sub(r"^void |<.*|\(.*", "", name)
    return name[:48]


def analyse(trace: dict) -> dict:
    events = trace["traceEvents"]
    launches = {e["args"]["correlation"]: e["ts"] for e in events
                if e.get("cat") == "cuda_runtime" and "correlation" in e.get("args", {})}
    work = sorted((e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")),
                  key=lambda e: e["ts"])
    gaps = collections.Counter()
    counts = collections.Counter()
    kinds = {"host": 0.0, "device": 0.0}
    sizes = collections.Counter()
    end, prev, busy = None, None, 0.0
    for e in work:
        start, stop = e["ts"], e["ts"] + e.get("dur", 0)
        if end is not None and start > end:
            gap = start - end
            late = launches.get(e["args"].get("correlation"), 0) > end
            kinds["host" if late else "device"] += gap
            gaps[f"{short(prev['name'])} -> {short(e['name'])}"] += gap
            counts[f"{short(prev['name'])} -> {short(e['name'])}"] += 1
            sizes["<2us" if gap < 2 else "2-5us" if gap < 5 else "5-20us" if gap < 20
                  else "20-100us" if gap < 100 else ">100us"] += gap
        if end is None or stop > end:
            busy += stop - max(start, end if end is not None else start)
            end, prev = stop, e
    span = work[-1]["ts"] + work[-1].get("dur", 0) - work[0]["ts"]
    return {"kernels": len(work), "span_ms": round(span / 1e3, 1), "busy_ms": round(busy / 1e3, 1),
            "gap_ms": {k: round(v / 1e3, 1) for k, v in kinds.items()},
            "gap_by_size_ms": {k: round(v / 1e3, 1) for k, v in sizes.items()},
            "top_gaps": [[k, round(v / 1e3, 2), counts[k]] for k, v in gaps.most_common(25)]}


def main() -> None:
    from torch.profiler import ProfilerActivity, profile

    from kit.bench.matrix import load_matrix
    from kit.bench.runner import case_config
    from kit.bench.worker import synthetic_batch
    from kit.budget.shapes import shape_of
    from kit.inputs import builtin
    from kit.train import Recipe

    matrix_path, name = sys.argv[1], sys.argv[2]
    matrix = load_matrix(matrix_path)
    case = next(c for c in matrix["cases"] if c["name"] == name)
    cfg = case_config(matrix, case, Path(tempfile.mkdtemp()))
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    if case.get("cap_gib"):
        total = torch.cuda.get_device_properties(device).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, case["cap_gib"] * 2**30 / total), device)
    recipe = Recipe(cfg)
    recipe.setup()
    size, vocab = recipe.cfg.training.batch_size, shape_of(builtin.resolve(cfg.model.name)).vocab
    for step in range(4):
        recipe.train_batches = iter([synthetic_batch(step, 0, size, cfg.data.max_seq_len, vocab, device)])
        torch.cuda.synchronize()
        if step < 3:
            print(json.dumps({"step": step, "step_ms": round(1e3 * recipe.train_step()["step_s"], 1)}))
            continue
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            recipe.train_step()
            torch.cuda.synchronize()
        path = Path(tempfile.mkdtemp()) / "trace.json"
        prof.export_chrome_trace(str(path))
        result = {"case": name, "batch": size, **analyse(json.loads(path.read_text()))}
    print(json.dumps(result, indent=1))
    Path(sys.argv[3] if len(sys.argv) > 3 else "gaps.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
