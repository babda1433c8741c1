"""The front door: `kit train CONFIG [key=value ...] [--nproc N] [--nnodes N]`.

    kit train tiny-cpu training.steps=20              # 2 processes on this machine
    kit train my.yaml --nproc 8                       # 8 GPUs
    NODE_RANK=1 MASTER_ADDR=node0 kit train my.yaml --nnodes 2 --nproc 8   # on each node

One start sequence, the same as a notebook's `launch` and the captured `run_to_end`: the config,
the model, the data rows, this machine and the run folder are checked once, here (kit.run.check:
a mistake is one line per problem on stderr and exit code 2, before any process starts and with
every file of the run folder as it was); then the run folder is written (kit.run.launch.prepare)
and its run.sh started with the check's plan (KIT_CHECKED: the ranks neither check nor plan
again), its output followed here. Ctrl-C asks the ranks to stop: they finish their step, save a
checkpoint and exit 75 (`training.resume=auto` continues); a second Ctrl-C ends them at once.

Exit codes: run.sh's (0 completed, 75 preempted or stopped, 1 failed), 2 refused, 0 also for a
run that is already finished (said in one line). Kernel side: torch is imported only for the
check's data line, in this command's own process.
"""

from __future__ import annotations

import argparse
import signal
import sys
import time

from kit.config import ConfigError, load_config
from kit.run import check as check_step
from kit.run.launch import checked_env, prepare, resolve, run_dir
from kit.run.runs import Follow, Run


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="kit train", description="Check a config once, write its run folder, train it "
        "under torchrun and follow its output here.")
    p.add_argument("config", help="a kit YAML, or a bundled config's name (tiny-cpu); "
                   "key=value only starts from the defaults")
    p.add_argument("overrides", nargs="*", help="key=value, e.g. training.steps=200")
    p.add_argument("--nproc", type=int, default=2, help="processes (GPUs) per node (default 2)")
    p.add_argument("--nnodes", type=int, default=1, help="nodes (default 1; NODE_RANK, "
                   "MASTER_ADDR and MASTER_PORT from the environment, as run.sh reads them)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_intermixed_args(sys.argv[1:] if argv is None else argv)
    path, overrides = args.config, list(args.overrides)
    if "=" in path:
        path, overrides = None, [path, *overrides]
    for flag, value in (("--nproc", args.nproc), ("--nnodes", args.nnodes)):
        if value < 1:
            return _refuse([f"{flag}: {value} is not allowed; expected a positive whole number"])
    try:
        cfg = resolve(path, overrides) if path else load_config(None, overrides)
        cfg.run.output_dir = str(run_dir(cfg))
        plan = check_step.check(cfg, args.nproc, args.nnodes)
        if plan.start is None:
            print(plan.message)
            return 0
        for note in plan.notes:
            print(note)
        print(check_step.data_line(cfg, args.nproc * args.nnodes, plan))
    except ConfigError as e:
        return _refuse(str(e).splitlines())
    try:
        run = Run(prepare(cfg, nproc=args.nproc, plan=plan, nnodes=args.nnodes))
    except RuntimeError as e:  # the folder's run is running now
        return _refuse([f"run.name: {e}"])
    run.start({**checked_env(plan), "NPROC_PER_NODE": str(args.nproc),
               "NNODES": str(args.nnodes)})
    return follow(run)


def _refuse(lines: list[str]) -> int:
    for line in lines:
        sys.stderr.write(f"ConfigError: {line}\n")
    return 2


def follow(run: Run, poll_s: float = 0.2) -> int:
    """Print the run's output (run.log) as it grows until run.sh exits; its exit code."""
    log = Follow(run.files.log)
    asked = []

    def stop(signum, frame):
        asked.append(time.monotonic())
        if len(asked) == 1:
            print("kit: stopping: the ranks finish their step and save a checkpoint "
                  "(Ctrl-C again ends them at once)", flush=True)
        run.send_signal(signal.SIGTERM)  # run.sh: a second request 2 s or more later kills

    previous = signal.signal(signal.SIGINT, stop)
    try:
        while True:
            for line in log.new_lines():
                print(line, flush=True)
            if run.status != "running":
                break
            time.sleep(poll_s)
        for line in log.new_lines():
            print(line, flush=True)
    finally:
        signal.signal(signal.SIGINT, previous)
    status, code = run.status, run.exit_code
    if status == "failed":
        sys.stderr.write(f"kit: run {run.name!r} failed: {run.failure().args[0]}\n")
    elif status == "preempted":  # stopped at a step with its checkpoint: resumable
        print(f"kit: run {run.name!r} stopped after saving a checkpoint: {run.folder}; the same "
              "command with training.resume=auto continues it")
    else:
        print(f"kit: run {run.name!r} {status}: {run.folder}")
    return code if code is not None else 1
