"""One experiment harness (rank side): what every experiment main under torchrun does, once.

    torchrun --nproc_per_node=2 -m MODULE CONFIG OUT [CASE ...] [key=value ...] [--option VALUE]

A module declares an `Experiment` (its case table: name -> function(case) -> row dict) and keeps
a two-line `__main__` that calls `experiment.main(EXPERIMENT)`. The harness parses the command
line (the run's config.yaml, the output folder, the cases to run in order, config overrides, the
module's own options), joins the process group the kit's way (kit.recipe.dist.init), resolves the
model on rank 0 first, then runs each case in turn: seeded, timed, its exception caught. Each rank
(or rank 0 alone) writes ONE row per case, atomically (kit.folder.jsonl.write_json: a reader never
sees half a file), prints one line `[rank R] CASE: ok|error`, and waits for the others (barrier)
before the next case starts. The process group is destroyed at the end, on failure too.

A case that raises: with `failures="record"` (experiments where some cases are meant to fail) its
row says ok=false and the error on every rank, and the next case runs; with `failures="raise"`
(the default: a failure is a broken run) the exception ends the run, after the cleanup. A module
whose rows are its own (kit.bench.worker streams a JSON line per measurement) declares no row_path:
the harness then writes none.

The six experiments on it: kit.lab.collectives_rank (the primer), kit.lab.order_rank (05),
kit.lab.sharding (04), kit.lab.loading_rank (10), kit.lab.reproduce_rank (08, 11),
kit.bench.worker (09); tests/test_experiment.py tests it.
"""

from __future__ import annotations

import argparse
import sys
import time
import traceback
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import torch

from kit.recipe import dist as kdist


@dataclass
class Case:
    """One case on this rank: what its function gets, and (after it ran) what it took."""

    name: str
    index: int  # its place in this launch's order
    cfg: object  # the kit Config of this case (the launch's, with the case's overrides)
    env: kdist.DistEnv
    out: Path  # the launch's output folder (OUT)
    options: dict  # the module's own --options, parsed
    started: float  # time.perf_counter() when the harness started (before the group was joined)
    notes: dict = field(default_factory=dict)  # kept in the row even when the case raised
    seconds: float = 0.0  # how long the function ran


def error_line(e: BaseException) -> str:
    """'Type: first line of the message', as the rows record an exception."""
    first = str(e).strip().splitlines()[0] if str(e).strip() else ""
    return f"{type(e).__name__}: {first}"


def plain_row(case: Case, got: dict | None, error: str, trace: str) -> dict | None:
    """The default row: which case and rank, ok, the error and its traceback, then what the case
    returned (or noted before it raised)."""
    return {"case": case.name, "rank": case.env.rank, "ok": not error, "error": error,
            "traceback": trace, **case.notes, **(got or {})}  # fmt: skip


@dataclass
class Experiment:
    """What a rank-side experiment module declares; `main(experiment)` runs it."""

    prog: str  # the module, for usage lines: "kit.lab.order_rank"
    cases: Mapping[str, Callable] | Callable[[str], Callable]  # name -> function(case) -> dict
    row_path: Callable[[Path, str, int], Path] | None  # (OUT, case, rank) -> its row's file
    row: Callable = plain_row  # (case, what it returned, error line, traceback) -> row or None
    writers: str = "every"  # "every" rank writes its row, or "main": rank 0 alone
    failures: str = "raise"  # "record": a row with ok=false, then the next case
    default: Callable[[object], list[str]] | None = None  # cfg -> the cases when none are named
    expand: Callable[[list[str]], list[str]] | None = None  # named -> cases (validates)
    overrides: Callable[[str], list[str]] | None = None  # case -> its config overrides
    options: dict = field(default_factory=dict)  # --name: help (each takes one value)
    seed: bool = True  # torch.manual_seed(cfg.training.seed) before each case
    stop: Callable[[Case, dict | None], bool] | None = None  # stop after it (no barrier)
    doc: str = ""


def parse(experiment: Experiment, argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog=f"torchrun ... -m {experiment.prog}",
                                     description=experiment.doc)
    parser.add_argument("config", help="the run's config.yaml")
    parser.add_argument("out", help="the output folder")
    parser.add_argument("rest", nargs="*", help="cases to run, in order, and config key=value")
    for name, text in experiment.options.items():
        parser.add_argument(f"--{name}", required=True, help=text)
    args = parser.parse_intermixed_args(argv)
    args.overrides = [a for a in args.rest if "=" in a]
    args.names = [a for a in args.rest if "=" not in a]
    return args


def _function(experiment: Experiment, name: str) -> Callable:
    if callable(experiment.cases) and not isinstance(experiment.cases, Mapping):
        return experiment.cases(name)
    if name not in experiment.cases:
        raise SystemExit(f"{experiment.prog}: no case {name!r}; "
                         f"cases: {', '.join(experiment.cases)}")  # fmt: skip
    return experiment.cases[name]


def run(experiment: Experiment, args: argparse.Namespace, started: float) -> int:
    """Join the group, run every case (one row per case and rank), clean up. `args`: parse()'s."""
    from kit.config import load_config
    from kit.folder import jsonl
    from kit.inputs import builtin

    base = load_config(args.config, args.overrides)
    names = args.names or (experiment.default(base) if experiment.default else list(
        experiment.cases) if isinstance(experiment.cases, Mapping) else [])  # fmt: skip
    names = experiment.expand(names) if experiment.expand else names
    if not names:
        raise SystemExit(f"{experiment.prog}: no case to run")
    functions = [_function(experiment, n) for n in names]
    cfgs = [load_config(args.config, [*args.overrides, *experiment.overrides(n)])
            if experiment.overrides else base for n in names]  # fmt: skip
    out = Path(args.out)
    options = {k: getattr(args, k.replace("-", "_")) for k in experiment.options}
    env = kdist.init(cfgs[0].training.device, cfgs[0].run.dist_timeout_min)
    try:
        with kdist.main_process_first(env):
            builtin.resolve(cfgs[0].model.name)
        for index, (name, fn, cfg) in enumerate(zip(names, functions, cfgs, strict=True)):
            case = Case(name, index, cfg, env, out, options, started)
            if experiment.seed:
                torch.manual_seed(cfg.training.seed)
            error = trace = ""
            got = None
            begin = time.perf_counter()
            try:
                got = fn(case)
            except Exception as e:  # noqa: BLE001 - recorded, or re-raised below
                if experiment.failures != "record":
                    raise
                error, trace = error_line(e), traceback.format_exc()
            case.seconds = time.perf_counter() - begin
            row = experiment.row(case, got, error, trace)
            if row is not None and experiment.row_path and (
                    experiment.writers == "every" or env.is_main):
                jsonl.write_json(experiment.row_path(out, name, env.rank), row)
            print(f"[rank {env.rank}] {name}: {error or 'ok'}", file=sys.stderr, flush=True)
            if experiment.stop and experiment.stop(case, row):
                break
            torch.distributed.barrier()  # every rank finished this case before the next starts
    finally:
        kdist.cleanup()
    return 0


def main(experiment: Experiment, argv: list[str] | None = None) -> int:
    """A module's `__main__`: parse argv, then run() as a rank's entry point (kit.recipe.dist.entry:
    a ConfigError is one line and exit 2; other exceptions are prefixed with the rank and
    re-raised, which torchrun's @record writes to the rank's error file)."""
    from torch.distributed.elastic.multiprocessing.errors import record

    started = time.perf_counter()
    args = parse(experiment, sys.argv[1:] if argv is None else argv)  # a usage error: exit 2
    return record(lambda: kdist.entry(lambda: run(experiment, args, started)))()
