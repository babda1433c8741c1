"""Where the GPU waits for the host in one training step of a kit.bench case (issue 35).

    torchrun --nproc_per_node=1 benchmarks/tools/host_lead.py MATRIX CASE [STEPS]

Builds the case's recipe (kit.bench.runner.case_config, its memory cap as kit.bench sets it),
then runs steps with a CUDA event and a host clock reading at each point of the step: after
each decoder layer's forward, after the loss, after backward, clipping, the optimizer step and
the step's end; where backward reaches each layer, and each layer's recompute. No profiler (its own host cost hides what it measures). At each point:

    lead = GPU time when the GPU got there - host time when the host queued it

A lead near 0 means the GPU had caught up with the host and waited for it there; the step's
total wait is the step time minus the GPU's busy time, which this does not measure. Gap filled:
torch.profiler adds host time to every operator, so its idle gaps overstate the host's share.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
import traceback
import warnings
from pathlib import Path

import torch


def _show_sync(message, category, filename, lineno, file=None, line=None) -> None:
    """A synchronizing operation (torch.cuda.set_sync_debug_mode): where it was called from."""
    if "synchroniz" not in str(message):
        return
    frames = [f for f in traceback.extract_stack()[:-2] if "/torch/" not in f.filename]
    where = " <- ".join(f"{Path(f.filename).name}:{f.lineno} {f.name}" for f in frames[-4:][::-1])
    print(f"SYNC {str(message)[:60]}: {where}", flush=True)


def main() -> None:
    from kit.bench.matrix import load_matrix
    from kit.bench.runner import case_config
    from kit.bench.worker import synthetic_batch
    from kit.recipe.layers import decoder_layers
    from kit.train import Recipe

    matrix_path, name = sys.argv[1], sys.argv[2]
    steps = int(sys.argv[3]) if len(sys.argv) > 3 else 4
    matrix = load_matrix(matrix_path)
    case = next(c for c in matrix["cases"] if c["name"] == name)
    out = Path("/tmp/host_lead")
    cfg = case_config(matrix, case, out)
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    if case.get("cap_gib"):
        total = torch.cuda.get_device_properties(device).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, case["cap_gib"] * 2**30 / total), device)
    recipe = Recipe(cfg)
    recipe.setup()
    batch_size = recipe.cfg.training.batch_size
    marks: list[tuple[str, float, torch.cuda.Event]] = []

    def mark(label: str) -> None:
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        marks.append((label, time.perf_counter(), event))

    seen: set[int] = set()

    def after_layer(i: int, output) -> None:
        # The first call is the forward; a later one in the same step is its recompute. The
        # output's gradient hook marks where backward reaches the layer (queued by autograd's
        # device thread, on the same stream).
        mark(f"layer {i} {'recompute' if i in seen else 'forward'}")
        out = output[0] if isinstance(output, tuple) else output
        if i not in seen and isinstance(out, torch.Tensor) and out.requires_grad:
            out.register_hook(lambda g, i=i: mark(f"layer {i} backward"))
        seen.add(i)

    for i, layer in enumerate(decoder_layers(recipe.model)):
        layer.register_forward_hook(lambda m, a, o, i=i: after_layer(i, o))
    recipe.model.register_forward_hook(lambda m, a, o: mark("loss"))
    engine, optimizer = recipe.engine, recipe.optimizer
    clip, opt_step = engine.clip_grad_norm, optimizer.step
    engine.clip_grad_norm = lambda *a, **k: (mark("backward done"), clip(*a, **k), mark("clipped"))[1]
    optimizer.step = lambda *a, **k: (opt_step(*a, **k), mark("optimizer queued"))[0]
    rows = []
    from kit.budget.shapes import shape_of
    from kit.inputs import builtin

    vocab = shape_of(builtin.resolve(cfg.model.name)).vocab
    for step in range(steps):
        batch = synthetic_batch(step, 0, batch_size, cfg.data.max_seq_len, vocab, device)
        recipe.train_batches = iter([batch])
        torch.cuda.synchronize()
        marks.clear()
        seen.clear()
        mark("start")
        t0 = marks[0][1]
        if step == steps - 1:  # the last step names every read-back that makes the host wait
            torch.cuda.set_sync_debug_mode("warn")
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            warnings.showwarning = _show_sync
            row = recipe.train_step()
        torch.cuda.set_sync_debug_mode("default")
        mark("end")
        torch.cuda.synchronize()
        start_event = marks[0][2]
        points = [(label, round(1e3 * (host - t0), 1), round(start_event.elapsed_time(ev), 1))
                  for label, host, ev in marks]
        rows.append({"step": step, "step_s": row["step_s"], "batch": batch_size, "points": points})
        print(json.dumps({"step": step, "step_ms": round(1e3 * row["step_s"], 1)}), flush=True)
    last = rows[-1]
    print(f"case {name}: batch {batch_size}, step {1e3 * statistics.median(r['step_s'] for r in rows[1:]):.1f} ms")
    print("| point | host ms | GPU ms | lead ms |\n|---|---|---|---|")
    for label, host, gpu in sorted(last["points"], key=lambda p: p[2]):
        if not label.startswith("layer") or label.split()[1] in ("0", "1", "2", "15", "29", "30", "31"):
            print(f"| {label} | {host} | {gpu} | {round(gpu - host, 1)} |")
    Path(sys.argv[4] if len(sys.argv) > 4 else "host_lead.json").write_text(json.dumps(rows))


if __name__ == "__main__":
    main()
