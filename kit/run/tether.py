"""A run tied to the process that started it (`kit train`, a notebook kernel, a script).

    start(run, env)         # run.start(env), then tie(run): the run now ends with its starter
    tether = tie(run)       # after run.start()
    tether.release()        # the run has ended (or goes on detached): the watcher leaves

Why: run.sh starts in a session of its own, so that a terminal's Ctrl-C or a process-group
signal reaches only the front door, which turns it into one stop request. The price was that
nothing ended the run when its starter died: a `kit train` killed by SIGTERM, a closed terminal,
a notebook kernel shut down or restarted, all left torchrun and the ranks training with nobody
following them.

How: the starter holds the write end of a pipe, a small watcher process (`python -m
kit.run.tether`, in a session of its own) the read end. The kernel closes the write end however
the starter ends, an exception, a signal or SIGKILL included, and the watcher reads end-of-file:
it sends run.sh the stop request Ctrl-C sends (the ranks finish their step, save a checkpoint,
exit 75; `training.resume=auto` continues), and ends whatever is left after GRACE_S. The watcher
leaves by itself when the run ends first. A detached run (`kit train --detach`, `launch(...,
detach=True)`) has no tether; `Run.attach(name)` or `kit runs NAME` follows and stops it.
Kernel side: no torch.
"""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil

from kit import ROOT
from kit.run.runs import Run

# torchrun kills the ranks 30 s after its SIGTERM; this is for a torchrun that cannot get there.
GRACE_S = 90.0
POLL_S = 0.5
_HELD: list[int] = []  # write ends of the tethers of this process: open while it lives


class Tether:
    """The watcher of one run and the write end of its pipe, held by the starter."""

    def __init__(self, proc: subprocess.Popen, fd: int):
        self.proc, self.fd = proc, fd

    def release(self, timeout: float = 10.0) -> None:
        """Let the watcher go: it leaves at once when the run has ended. A run still going on
        gets the stop request, as when the starter ends."""
        if self.fd in _HELD:
            _HELD.remove(self.fd)
            os.close(self.fd)
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            pass


def start(run: Run, env: dict | None = None, detach: bool = False) -> Run:
    """Start run.sh (Run.start) and, unless detach, tie the run to this process (run.tether)."""
    run.start(env)
    if not detach:
        run.tether = tie(run)
    return run


def tie(run: Run) -> Tether:
    """Start the watcher of a started run; the run gets a stop request when this process ends."""
    read, write = os.pipe()  # both ends non-inheritable: no other child keeps the run alive
    try:
        proc = subprocess.Popen(
            [sys.executable, "-m", "kit.run.tether", str(run.folder)], cwd=ROOT,
            stdin=read, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            start_new_session=True,  # a terminal's signals to the starter's group miss it
        )  # fmt: skip
    finally:
        os.close(read)
    _HELD.append(write)
    return Tether(proc, write)


def end_at_once(run: Run, wait_s: float = 5.0) -> None:
    """SIGKILL torchrun and the ranks (a checkpoint being written stays step-N.tmp, which no
    resume takes); run.sh itself is left to write its exit code, and killed if it does not."""
    root = run._root()
    rest = [p for p in run.processes() if root is None or p.pid != root.pid]
    for p in rest:
        _kill(p)
    psutil.wait_procs(rest, timeout=wait_s)
    deadline = time.monotonic() + wait_s
    while run._root() is not None and time.monotonic() < deadline:
        time.sleep(0.05)
    for p in run.processes():  # anything that was starting while the others were killed
        _kill(p)


def _kill(p: psutil.Process) -> None:
    try:
        p.kill()
    except psutil.Error:
        pass


def _watch(folder: Path, grace_s: float = GRACE_S) -> int:
    """The watcher: wait for end-of-file on stdin (the starter ended) or the run's end."""
    for sig in (signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)
    run = Run(folder)
    while run.processes():
        ready, _, _ = select.select([0], [], [], POLL_S)
        if ready and not os.read(0, 4096):
            break  # the starter is gone
    else:
        return 0  # the run ended first
    if not run.processes():
        return 0
    run.send_signal(signal.SIGTERM)  # what Ctrl-C at the front door sends
    deadline = time.monotonic() + grace_s
    while run.processes() and time.monotonic() < deadline:
        time.sleep(POLL_S)
    if run.processes():
        end_at_once(run)
    return 0


if __name__ == "__main__":
    sys.exit(_watch(Path(sys.argv[1])))
