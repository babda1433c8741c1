"""Benchmark runner: a matrix of training configurations, each in its own torchrun, in one invocation.

    python -m kit.bench benchmarks/matrices/bench-8b.yaml --out runs/bench          # the whole matrix
    python -m kit.bench benchmarks/matrices/bench-8b.yaml --out runs/bench --only kit-40-none,article-40

A matrix (YAML) names the model, sequence length and processes, and its cases. A case is the
article recipe (`kit.bench.article`, the hand-written baseline), the peer stack (`kit.bench.peer`:
the same plus liger-kernel's fused kernels, the second baseline; a case of it is skipped, in one
line and one row, where it cannot run: no CUDA GPU or no liger-kernel), unsloth
(`kit.bench.unsloth`, the third baseline, one process, its packages in a folder of their own) or
the kit's recipe
(`kit.train.Recipe`) with config overrides, under an optional memory cap per GPU (`cap_gib`:
emulates a smaller GPU with `torch.cuda.set_per_process_memory_fraction`). Each case tries its batch sizes in ascending order
on synthetic tokens (the same for every case), until one does not fit: an out-of-memory is a
result row, not a crash. Per batch: warm-up steps excluded, tokens/s per GPU as the median step,
peak allocated and reserved memory, MFU (model FLOPs per token are printed with the table).
A case marked `equivalence: true` first trains `equivalence.steps` steps at one common batch size
from its initial adapter and records the loss of every step, so that two recipes can be compared
for what they learn, not only for speed. A case with `scales: <case>` and its own `nproc` is that
case's setup on another number of GPUs (the report's scaling table); `--nproc` runs a whole
matrix on another number. Every recipe is seeded alike (the matrix's `seed`,
default 42): the same LoRA initialisation, and dropout that differs per rank the same way.

Kernel side: imports no torch. Each case starts the way every run of the kit starts,
kit.run.launch.run_to_end: a run folder `--out/runs/<case>/` with the case's config.yaml and run.sh,
whose ranks run kit.bench.worker; a timeout (`timeout_s`, default 600) stops the case's whole
process tree and costs that case only. Output in --out: results.jsonl (every row), table.md (the
article's table, kit vs baseline per cap, every case, equivalence; kit.bench.report), bench.png,
cases/<case>.jsonl (each case's rows as they come), logs/<case>.log (a copy of its run.log).
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import time
from pathlib import Path

from kit.bench import peer, unsloth
from kit.bench.matrix import case_nproc, load_matrix
from kit.bench.report import plot, render
from kit.config import Config, ConfigError, load_config
from kit.folder import jsonl
from kit.folder.layout import RunFolder
from kit.run.launch import run_to_end

# The kit recipe's settings in every case, before the case's own overrides: LoRA r16 on every
# linear layer, AdamW at a constant learning rate, one micro-step per step, nothing saved.
KIT_SETTINGS = [
    "lora.r=16", "lora.alpha=32", "lora.dropout=0.05", "lora.target_modules=all-linear",
    "training.warmup_steps=0", "training.scheduler=constant", "training.weight_decay=0",
    "training.max_grad_norm=1.0", "training.eval_every=0", "training.grad_accum=1",
    "checkpointing.save_adapter=false", "checkpointing.save_probe_logits=false",
]


def case_config(matrix: dict, case: dict, out: Path) -> Config:
    """The training setup of one case, as its run folder's config.yaml holds it: the matrix's
    model, device, sequence length, learning rate and seed for every recipe (kit.bench.article and
    kit.bench.peer take the rest from the case's options); for the kit's recipe also KIT_SETTINGS and the case's
    overrides. A bad value raises ConfigError naming the case."""
    overrides = [
        f"run.name={case['name']}", f"run.output_dir={out / 'runs' / case['name']}",
        "run.start_over=true", f"run.dist_timeout_min={case.get('dist_timeout_min', 5)}",
        f"model.name={matrix['model']}", f"training.device={matrix.get('device', 'auto')}",
        f"data.max_seq_len={matrix['seq_len']}", f"training.lr={matrix.get('lr', 2e-4)}",
        # The kit recipe's training.seed default; a case's own seed measures the noise between
        # two seeds of one recipe (what a lever's loss difference is held against).
        f"training.seed={case.get('seed', matrix.get('seed', 42))}",
    ]
    if case["recipe"] == "kit":
        overrides += KIT_SETTINGS
        # Batches given as numbers: the recipe plans the rest (recompute, offload, loss) for the
        # largest of them, the one that must fit, not for a batch of its own choosing that the
        # case then never runs. A case's own overrides still win.
        if case.get("batches") and all(isinstance(b, int) for b in case["batches"]):
            overrides.append(f"training.batch_size={max(case['batches'])}")
        overrides += case.get("overrides", [])
    try:
        return load_config(matrix.get("kit_config"), overrides)
    except ConfigError as e:
        raise ConfigError(f"cases.{case['name']}: {e}") from None


def skipped(matrix: dict, case: dict) -> str | None:
    """Why a case cannot run on this machine, in one line (the peer stack without a CUDA GPU or
    without liger-kernel: kit.bench.peer.unavailable; unsloth without a CUDA GPU, on more than one
    process or without its folder: kit.bench.unsloth.unavailable; asked without torch); None
    when it can."""
    if case["recipe"] == "peer":
        return peer.unavailable(matrix.get("device", "auto"))
    if case["recipe"] == "unsloth":
        return unsloth.unavailable(matrix.get("device", "auto"), case_nproc(matrix, case))
    return None


def case_env(case: dict) -> dict:
    """The environment a case's processes get beyond the runner's own: one thread per process for
    the CPU's math libraries; for unsloth its folder of packages (unsloth and the trl and datasets
    it pins) in front of the path, and no hub (the model is a local folder)."""
    env = {"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    if case["recipe"] == "unsloth":
        path = [str(unsloth.folder()), os.environ.get("PYTHONPATH", "")]
        env.update(PYTHONPATH=os.pathsep.join(p for p in path if p), HF_HUB_OFFLINE="1")
    return env


def run_case(matrix_path: Path, case: dict, cfg: Config, nproc: int, out: Path) -> int:
    """One case in its own torchrun (kit.run.launch.run_to_end); its exit code, -9 after a timeout."""
    log = out / "logs" / f"{case['name']}.log"
    folder = RunFolder(out / "runs" / case["name"])  # the case's run folder (case_config)
    for stale in (log, folder.result):
        stale.unlink(missing_ok=True)
    try:
        run = run_to_end(cfg, nproc=nproc, module="kit.bench.worker",
                         args=["{config}", str(out), case["name"], "--matrix", str(matrix_path)],
                         env=case_env(case),
                         timeout=case.get("timeout_s", 600), check=False)
        rc = run.exit_code if run.exit_code is not None else -1
    except TimeoutError:
        rc = -9
    if folder.log.exists():
        shutil.copyfile(folder.log, log)
    return rc


def run(matrix_path: str | Path, out: str | Path, only: list[str] | None = None,
        nproc: int | None = None) -> list[dict]:
    """Every case of the matrix (or those in `only`), then results.jsonl, table.md, bench.png.
    `nproc` replaces the matrix's processes (one per GPU: the same matrix on 2 or 4 GPUs); a case
    with its own `nproc` keeps it."""
    matrix_path, out = Path(matrix_path).resolve(), Path(out).resolve()
    matrix = load_matrix(matrix_path)
    if nproc:
        matrix["nproc"] = nproc
    (out / "logs").mkdir(parents=True, exist_ok=True)
    (out / "cases").mkdir(exist_ok=True)
    # Every case's config first: a misspelt override stops the matrix before anything runs.
    configs = {c["name"]: case_config(matrix, c, out) for c in matrix["cases"]
               if not only or c["name"] in only}
    for case in [c for c in matrix["cases"] if c["name"] in configs]:
        name = case["name"]
        (out / "cases" / f"{name}.jsonl").unlink(missing_ok=True)
        head = {"case": name, "recipe": case["recipe"], "label": case.get("label", name),
                "role": case.get("role", ""), "cap_gib": case.get("cap_gib"),
                "table": case.get("table", "")}
        why = skipped(matrix, case)
        if why:  # before any process starts: the rest of the matrix runs
            jsonl.append(out / "cases" / f"{name}.jsonl", {**head, "kind": "skipped", "why": why})
            print(f"{name}: skipped: {why}", flush=True)
            continue
        t = time.perf_counter()
        rc = run_case(matrix_path, case, configs[name], case_nproc(matrix, case), out)
        rows = jsonl.read(out / "cases" / f"{name}.jsonl")
        ended = ""
        if rc != 0 and any(r["kind"] == "done" for r in rows):
            # Every row was written before the processes ended badly (a teardown that hung until
            # the timeout, a crash at exit): the measurements stand, and the end is said so.
            jsonl.append(out / "cases" / f"{name}.jsonl", {**head, "kind": "ended", "rc": rc})
            ended = " after its last row (its measurements stand)"
        elif rc != 0 or not any(r["kind"] == "done" for r in rows):
            log = out / "logs" / f"{name}.log"
            tail = log.read_text(errors="replace").splitlines()[-3:] if log.exists() else []
            jsonl.append(out / "cases" / f"{name}.jsonl",
                         {**head, "kind": "failed", "rc": rc, "log_tail": tail})
        print(f"{name}: rc={rc}{ended} in {time.perf_counter() - t:.0f}s", flush=True)
    rows = [r for p in sorted((out / "cases").glob("*.jsonl")) for r in jsonl.read(p)]
    jsonl.write(out / "results.jsonl", rows)
    table = render(rows, matrix)
    (out / "table.md").write_text(table)
    print(table)
    try:
        plot(rows, out / "bench.png")
    except ImportError:
        pass
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="kit bench", description=__doc__.split("\n\n")[0])
    p.add_argument("matrix")
    p.add_argument("--out", required=True)
    p.add_argument("--only", default="", help="comma-separated case names")
    p.add_argument("--nproc", type=int, default=None,
                   help="processes (GPUs) instead of the matrix's; cases with their own keep them")
    a = p.parse_args(sys.argv[1:] if argv is None else argv)
    if a.nproc is not None and a.nproc < 1:
        p.error(f"--nproc: {a.nproc} is not allowed; expected a positive whole number")
    run(a.matrix, a.out, [s for s in a.only.split(",") if s] or None, a.nproc)
    return 0

