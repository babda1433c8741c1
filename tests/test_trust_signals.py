"""Signals the front door owns (issue 57, item 3), done for real on 2 CPU processes: SIGTERM and
SIGHUP to `kit train` are the stop request Ctrl-C is (a verified checkpoint, exit 75), a second
one ends the ranks at once, a notebook's `launch` ends with the process that called it, and a
`kit train --detach` run is the only one that outlives its command. After each, no process
whose command line names the run folder is left (run.sh, torchrun, the ranks, the tether)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest
from conftest import ROOT, TINY

from kit.inference.merge import main as checkpoints
from kit.run.runs import Run

pytestmark = pytest.mark.slow
ARGS = ["training.steps=100000", "training.eval_every=0", "checkpointing.save_every=0"]
FIRST_STEP_S = 900  # the first step on a busy 2-core machine: model build, imports, the group


def of_the_run(out: Path) -> list[psutil.Process]:
    """Every live process whose command line names the run folder."""
    found = []
    for p in psutil.process_iter(["cmdline", "status"]):
        try:
            if p.pid != os.getpid() and p.info["status"] != psutil.STATUS_ZOMBIE and \
                    str(out) in " ".join(p.info["cmdline"] or []):
                found.append(p)
        except psutil.Error:
            pass
    return found


def roles(procs: list[psutil.Process]) -> list[str]:
    names = []
    for p in procs:
        line = " ".join(p.cmdline())
        names.append("tether" if "kit.run.tether" in line else "torchrun" if
                     "torch.distributed.run" in line else "rank" if "-m kit.train" in line
                     else "door" if "-m kit train" in line else "run.sh" if "run.sh" in line
                     else line)
    return sorted(names)


def training(out: Path, proc: subprocess.Popen | None = None) -> list[psutil.Process]:
    """Wait for the first train step in metrics.jsonl; the run's processes then."""
    began = time.monotonic()
    metrics = out / "metrics.jsonl"
    while not (metrics.is_file() and metrics.read_text().strip()):
        assert proc is None or proc.poll() is None, f"ended early: {proc.returncode}"
        assert time.monotonic() - began < FIRST_STEP_S, "no train step"
        time.sleep(0.2)
    return of_the_run(out)


def _signals_as_a_terminal_leaves_them():
    """A terminal or a service manager starts `kit train` with every signal at its default; the
    test's own process may have inherited some ignored (`nohup pytest` ignores SIGHUP, a shell's
    `&` SIGINT), which the door keeps ignored on purpose: `nohup kit train` outlives a hangup."""
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.SIG_DFL)


def door(out: Path, tmp_path: Path, *extra: str, env: dict | None = None) -> subprocess.Popen:
    """`kit train` in a session of its own, as a terminal or a service manager starts it."""
    return subprocess.Popen(
        [sys.executable, "-m", "kit", "train", str(TINY), *ARGS, f"run.output_dir={out}", *extra],
        cwd=ROOT, start_new_session=True, env={**os.environ, **(env or {})},
        preexec_fn=_signals_as_a_terminal_leaves_them,
        stdout=open(tmp_path / "stdout", "w"), stderr=open(tmp_path / "stderr", "w"))


def verified(out: Path) -> None:
    """The run stopped at a step and saved it: `kit checkpoints verify` on that checkpoint (the
    run folder has no adapter/ yet: that is written when the run completes)."""
    result = json.loads((out / "result.json").read_text())
    assert result["status"] == "preempted", result
    step = out / "checkpoints" / f"step-{result['steps']:06d}"
    assert checkpoints(["verify", str(step)]) == 0
    assert not list((out / "checkpoints").glob("*.tmp"))


def gone(out: Path, seen: list[psutil.Process], timeout: float = 0.0) -> None:
    deadline = time.monotonic() + timeout
    while (left := [p for p in seen + of_the_run(out) if p.is_running() and
                    p.status() != psutil.STATUS_ZOMBIE]) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert left == [], [" ".join(p.cmdline()) for p in left]


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP], ids=["SIGTERM", "SIGHUP"])
def test_sigterm_and_sighup_to_kit_train_are_a_stop_request(sig, tmp_path):
    """SIGTERM and SIGHUP (Ctrl-C's SIGINT takes the same handler; CI time: not a run of its
    own): the kit's stop lines on the terminal, and nothing of torchrun's own for the stop it
    was asked for (its lines as it signals the ranks, its traceback: kit.run.door), which run.log
    keeps."""
    out = tmp_path / "run"
    proc = door(out, tmp_path)
    try:
        seen = training(out, proc)
        assert roles(seen) == ["door", "rank", "rank", "run.sh", "tether", "torchrun"], roles(seen)
        proc.send_signal(sig)
        assert proc.wait(timeout=300) == 75
        gone(out, seen)  # nothing left once the command has returned
        stdout, stderr = (tmp_path / "stdout").read_text(), (tmp_path / "stderr").read_text()
        assert f"kit: {sig.name}: stopping: the ranks finish their step" in stdout
        assert stdout.rstrip().endswith("training.resume=auto continues it"), stdout[-3000:]
        assert "Traceback" not in stdout and stderr == "", stdout[-3000:] + stderr
        assert "ChildFailedError" not in stdout and "closing signal" not in stdout, stdout[-3000:]
        log = (out / "run.log").read_text()
        assert "SignalException" in log or "ChildFailedError" in log, log[-3000:]
        verified(out)
    finally:
        proc.kill()


def test_a_second_signal_ends_the_run_at_once(tmp_path):
    out = tmp_path / "run"
    proc = door(out, tmp_path, env={"KIT_SLOW_SAVE_S": "120"})  # the second lands in the save
    try:
        seen = training(out, proc)
        proc.send_signal(signal.SIGTERM)
        time.sleep(0.5)
        proc.send_signal(signal.SIGINT)  # within 2 s: the same request (one hang-up, twice)
        time.sleep(3)
        assert proc.poll() is None, "a signal within 2 s of the first ended the run"
        proc.send_signal(signal.SIGHUP)
        began = time.monotonic()
        assert proc.wait(timeout=60) == 128 + signal.SIGHUP
        assert time.monotonic() - began < 20  # at once, not after the 120 s save
        gone(out, seen)
        stdout = (tmp_path / "stdout").read_text()
        assert "kit: SIGHUP again: ending the run at once" in stdout, stdout[-3000:]
        assert not list((out / "checkpoints").glob("step-??????")), "a save that was cut short"
    finally:
        proc.kill()


def test_a_launch_ends_with_the_process_that_called_it(tmp_path):
    """A kernel's shutdown (or restart) is its process' end: the run it launched gets the stop
    request, saves and exits 75, and nothing of it is left."""
    out = tmp_path / "run"
    code = textwrap.dedent(f"""
        from kit.run.launch import launch
        run = launch({str(TINY)!r}, {[*ARGS, f"run.output_dir={out}"]!r}, nproc=2)
        run.wait(step=1, timeout={FIRST_STEP_S})
    """)  # then the interpreter exits, as a kernel does when it is shut down
    kernel = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                            timeout=FIRST_STEP_S + 60)
    assert kernel.returncode == 0, kernel.stderr[-3000:]
    seen = of_the_run(out)
    gone(out, seen, timeout=120)
    assert (out / "exit_code").read_text().strip() == "75"
    verified(out)


def test_a_detached_run_outlives_its_command_and_is_stopped_by_name(tmp_path):
    out = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "kit", "train", str(TINY), *ARGS,
                           f"run.output_dir={out}", "--detach"], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0 and proc.stderr == "", proc.stdout + proc.stderr
    assert f"kit: run 'run' started, detached: {out}" in proc.stdout
    assert f"kit runs {out} --stop" in proc.stdout
    assert Run(out).status == "running"  # returned at once: the run is starting still
    seen = training(out)
    assert roles(seen) == ["rank", "rank", "run.sh", "torchrun"], roles(seen)  # no tether
    stop = subprocess.run([sys.executable, "-m", "kit", "runs", str(out), "--stop"], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert stop.returncode == 0 and f"kit: run 'run' stopped: {out}" in stop.stdout, stop.stderr
    gone(out, seen)
    assert (out / "exit_code").read_text().strip() == "75"
    verified(out)
    follow = subprocess.run([sys.executable, "-m", "kit", "runs", str(out), "--follow"], cwd=ROOT,
                            capture_output=True, text=True, timeout=120)
    assert follow.returncode == 75 and "[default0]:preempted (SIGTERM)" in follow.stdout
    assert follow.stdout.rstrip().endswith(f"kit: run 'run' stopped: {out}"), follow.stdout
