"""The front door: `kit train CONFIG [key=value ...] [--nproc N] [--nnodes N] [--detach]`.

    kit train tiny-cpu training.steps=20              # 2 processes on this machine
    kit train my.yaml --nproc 8                       # 8 GPUs
    NODE_RANK=1 MASTER_ADDR=node0 kit train my.yaml --nnodes 2 --nproc 8   # on each node

One start, built as a notebook's `launch` and the captured `run_to_end` build theirs
(kit.run.check.check): the config, the model, the data rows, this machine and the run folder are
checked once, and the values left at auto planned once, here (a mistake is one line per problem
on stderr and exit code 2, before any process starts and with every file of the run folder as it
was); then the run folder is written with the start in it (kit.run.launch.prepare: start.json,
which the ranks read instead of checking, planning and reading the data again) and its run.sh
started, its output followed here.

Signals: Ctrl-C (SIGINT), SIGTERM (a service manager, `kill`) and SIGHUP (a closed terminal) are
one stop request: run.sh passes it on, the ranks finish their step, save a verified checkpoint
and exit 75 (`training.resume=auto` continues). A second one, SAME_REQUEST_S or more after the
first, ends torchrun and the ranks at once (exit 128 + its number; a checkpoint being written
stays step-N.tmp, which no resume takes); closer together they are the same request. A signal
ignored when the command starts stays ignored (`nohup kit train ...` keeps training after the
terminal closes, still followed and still stopped by its own end). However this
command ends, an exception or SIGKILL included, no process of the run outlives it
(kit.run.tether), unless `--detach`: then it returns once the run has started, and `kit runs NAME
--follow` (or `Run.attach(NAME)`) follows it, `kit runs NAME --stop` stops it.

Exit codes: run.sh's (0 completed, 75 preempted or stopped, 1 failed), 2 refused, 0 also for a
run that is already finished (said in one line) or started detached. Kernel side: torch is
imported only to read the data's rows for the plan and the data line, in this command's own
process.
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import signal
import sys
import time

from kit import ROOT
from kit.config import ConfigError, load_config
from kit.folder import start as start_file
from kit.recipe import progress  # its line's prefix only: no torch
from kit.run import check as check_step
from kit.run import tether
from kit.run.launch import prepare, resolve, run_dir
from kit.run.runs import Follow, Run
from kit.run.tether import GRACE_S, end_at_once

SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)  # what a terminal or a service sends
SAME_REQUEST_S = 2.0  # kit.recipe.preempt's window: signals closer than this are one request


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="kit train", description="Check a config once, write its run folder, train it "
        "under torchrun and follow its output here. Ctrl-C, SIGTERM or SIGHUP (a closed "
        "terminal) asks the ranks to stop: they finish their step, save a checkpoint and exit "
        "75 (training.resume=auto continues); a second one, 2 s or more later, ends them at once. "
        "However this command ends, no process of the run outlives it unless --detach.")
    p.add_argument("config", help="a kit YAML, or a bundled config's name (tiny-cpu); "
                   "key=value only starts from the defaults")
    p.add_argument("overrides", nargs="*", help="key=value, e.g. training.steps=200")
    p.add_argument("--nproc", type=int, default=2, help="processes (GPUs) per node (default 2)")
    p.add_argument("--nnodes", type=int, default=1, help="nodes (default 1; NODE_RANK, "
                   "MASTER_ADDR and MASTER_PORT from the environment, as run.sh reads them)")
    p.add_argument("--detach", action="store_true", help="start the run and return at once; "
                   "it outlives this command (kit runs NAME --follow | --stop)")
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
        begun = check_step.check(cfg, args.nproc, args.nnodes, here=True)
        if begun.folder.start is None:
            print(begun.folder.message)
            return 0
        for note in begun.folder.notes:
            print(note)
        print(check_step.success_line(cfg, begun, overrides))
    except ConfigError as e:
        return _refuse(str(e).splitlines())
    try:
        run = Run(prepare(cfg, nproc=args.nproc, nnodes=args.nnodes, start=begun))
    except ConfigError as e:  # another start holds the folder, or it cannot be written
        return _refuse([str(e)])
    except RuntimeError as e:  # the folder's run is running now
        return _refuse([f"run.name: {e}"])
    tether.start(run, {**start_file.environment(run.folder), "NPROC_PER_NODE": str(args.nproc),
                       "NNODES": str(args.nnodes)}, detach=args.detach)
    if args.detach:
        ref = run.name if run.folder == ROOT / "launch" / run.name else str(run.folder)
        print(f"kit: run {run.name!r} started, detached: {run.folder}\n"
              f"  follow it: kit runs {shlex.quote(ref)} --follow   "
              f"(Python: Run.attach({ref!r}).wait())\n"
              f"  stop it:   kit runs {shlex.quote(ref)} --stop     (a checkpoint of its step first)")
        return 0
    return follow(run)


def _refuse(lines: list[str]) -> int:
    for line in lines:
        sys.stderr.write(f"ConfigError: {line}\n")
    return 2


class _Requests:
    """Stop requests to the front door (Ctrl-C, SIGTERM, SIGHUP): the first is a stop request
    to run.sh; one more, SAME_REQUEST_S or later after it, ends torchrun and the ranks at once.
    Within SAME_REQUEST_S it is the same request: a closed terminal can hang the door up twice
    (its shell's SIGHUP and the kernel's), and a service manager signals a whole group at once.
    The handler only notes a request: acting on it (printing, psutil) waits for `act`, as a
    handler runs between any two bytecodes, a print to the same stream among them."""

    def __init__(self, run: Run, out: _Output):
        self.run, self.out = run, out
        self.pending: list[tuple[int, float]] = []
        self.first: float | None = None
        self.ended_by: int | None = None  # the signal that ended the run at once

    def __call__(self, signum, frame) -> None:
        self.pending.append((signum, time.monotonic()))

    def act(self) -> None:
        while self.pending:
            signum, at = self.pending.pop(0)
            name = signal.Signals(signum).name
            if self.first is None:
                self.first = at
                self.out.stopping = True
                self.out.say(f"kit: {name}: stopping: the ranks finish their step and save a "
                             "checkpoint (Ctrl-C, SIGTERM or SIGHUP again ends them at once)")
                self.stop_request()
            elif at - self.first >= SAME_REQUEST_S and self.ended_by is None:
                self.ended_by = signum
                self.out.say(f"kit: {name} again: ending the run at once")
                end_at_once(self.run)

    def stop_request(self) -> None:
        try:
            self.run.send_signal(signal.SIGTERM)  # run.sh passes it on to torchrun
        except (OSError, ValueError):  # run.sh ended already (its pid gone): nothing to stop
            pass


def follow(run: Run, poll_s: float = 0.2) -> int:
    """Print the run's output (run.log) as it grows until run.sh exits; its exit code (128 + the
    signal's number when a second request ended it). However this ends, no process of the run
    is left: an exception here is a stop request and a wait for it."""
    out = _Output()
    requests = _Requests(run, out)
    # One ignored already stays ignored: `nohup kit train` asked to outlive the terminal.
    previous = {sig: signal.signal(sig, requests) for sig in SIGNALS
                if signal.getsignal(sig) is not signal.SIG_IGN}
    ended = False
    try:
        log = Follow(run.files.log)
        while run.status == "running":
            out.lines(log.new_lines())
            requests.act()
            time.sleep(poll_s)
        out.lines(log.new_lines())
        out.flush()
        requests.act()
        ended = True
    finally:
        if not ended:  # an exception: the run must not outlive this command
            requests.stop_request()
            deadline = time.monotonic() + GRACE_S
            while run.processes() and time.monotonic() < deadline:
                time.sleep(poll_s)
            end_at_once(run)
        if run.tether is not None:
            run.tether.release()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if requests.ended_by is not None:
        out.say(f"kit: run {run.name!r} ended at once; training.resume=auto continues from its "
                f"last complete checkpoint: {run.folder}")
        return 128 + requests.ended_by
    return _said_end(run, out)


def _said_end(run: Run, out: _Output) -> int:
    status, code = run.status, run.exit_code
    if status == "failed":
        out.say(f"kit: run {run.name!r} failed: {run.failure().args[0]}", sys.stderr)
    elif status == "preempted":  # stopped at a step with its checkpoint: resumable
        out.say(f"kit: run {run.name!r} stopped after saving a checkpoint: {run.folder}; the "
                "same command with training.resume=auto continues it")
    else:
        out.say(f"kit: run {run.name!r} {status}: {run.folder}")
    return code if code is not None else 1


# torchrun's own lines for a stop it was asked for (kit.run.script's run.sh sends it SIGTERM):
# its log lines as it signals the ranks, and the traceback of the SignalException it ends with.
TORCHRUN_STOPPING = re.compile(r"[WI]\d{4} [\d:.]+ \d+ \S*torch/distributed/elastic/\S*\] "
                               r"(Sending process \d+ closing signal|Received \S+ death signal)")
TRACEBACK = "Traceback (most recent call last):"
CHAINED = ("During handling of the above exception", "The above exception was the direct cause")
# kit.recipe.progress's plain lines from rank 0, drawn in place on a terminal.
PROGRESS = re.compile(r"\[default0\]:" + re.escape(progress.PREFIX) + r"\d+/\d+ ")
TEE_PREFIX = re.compile(r"\[default\d+\]:")  # torchrun's --tee, before each rank's line
EXIT_STOPPED = 75  # kit.recipe.preempt.EXIT_PREEMPTED: a rank that saved and stopped on request


class _Output:
    """Lines to the terminal until it is gone (a hung-up terminal or a closed pipe fails every
    write): the run is still followed to its end and its exit code returned. On a terminal,
    rank 0's progress lines are one line redrawn in place. torchrun's traceback for a stop the
    user asked for is left out (run.log keeps everything): its SignalException after the door's
    stop request, and a ChildFailedError report whose every rank exited 75 (saved and stopped on
    request, e.g. SIGUSR1 to a rank); a failure's report is shown whole."""

    def __init__(self, terminal: bool | None = None):
        self.gone = False
        self.stopping = False  # a stop request was sent: torchrun's traceback for it is noise
        self.held: list[str] = []  # a traceback of torchrun's own, until its end says whose
        self.report = 0  # '=' rules seen of a ChildFailedError report (it ends at the second)
        self.ended = False  # the held traceback's exception line came: a chained one may follow
        self.terminal = sys.stdout.isatty() if terminal is None else terminal
        self.drawn = False  # a progress line drawn in place, the cursor still on it

    def say(self, line: str, stream=None, in_place: bool = False) -> None:
        if self.gone:
            return
        try:
            if self.drawn and not in_place:
                sys.stdout.write("\n")  # the last progress line stays, the next goes below it
            self.drawn = in_place
            if in_place:
                sys.stdout.write(f"\r\033[K{line}")
                sys.stdout.flush()
            else:
                print(line, file=stream or sys.stdout, flush=True)
        except OSError:
            self.gone = True
            sys.stdout = open(os.devnull, "w")  # Python's own flush at exit fails no more

    def lines(self, lines: list[str]) -> None:
        """The run's lines, as above. The ranks' own lines carry a [defaultN]: prefix; a
        traceback's first line may follow a rank's unfinished line."""
        for line in lines:
            if self.held and self._holds(line):
                continue
            if self.stopping and TORCHRUN_STOPPING.match(line):
                continue
            at = line.find(TRACEBACK)  # a rank's own is "[defaultN]:Traceback ...": shown
            if at == 0 or at > 0 and not TEE_PREFIX.fullmatch(line[:at]):
                if at:
                    self.say(line[:at])
                self.held, self.report, self.ended = [line[at:]], 0, False
            else:
                self.say(line, in_place=self.terminal and PROGRESS.match(line) is not None)

    def _holds(self, line: str) -> bool:
        """Whether `line` belongs to the held traceback (else the traceback is over: it is shown
        or left out, and `line` is the run's next)."""
        if self.report:  # a ChildFailedError report, up to its closing rule
            self.held.append(line)
            self.report += line.startswith("====")
            if self.report > 2:
                self._end()
            return True
        if not self.ended and (line[:1].isspace() or line.startswith(TRACEBACK)) or \
                line.startswith(CHAINED) or self.ended and line.startswith(TRACEBACK):
            self.held.append(line)
            self.ended = False
            return True
        if self.ended:
            self._end()
            return False
        self.held.append(line)  # the exception line
        self.ended = True
        if "ChildFailedError" in line:
            self.report = 1
        return True

    def _end(self) -> None:
        block, self.held, self.report, self.ended = self.held, [], 0, False
        exits = re.findall(r"exitcode\s*:\s*(-?\d+)", "\n".join(block))
        asked = self.stopping and "SignalException" in block[-1] or (
            exits and all(int(code) == EXIT_STOPPED for code in exits))
        for held in [] if asked else block:
            self.say(held)

    def flush(self) -> None:
        """The log's end: a finished traceback shown or left out as above; one cut short, whole."""
        if self.ended or self.report:
            self._end()
        for line in self.held:
            self.say(line)
        self.held = []
