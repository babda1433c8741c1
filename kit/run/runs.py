"""The run handle: a run folder and the process tree started from it, by a kernel, a former
kernel or a terminal.

    run = Run.attach("try1")     # launch/try1, or a folder path
    run.status                   # prepared | running | completed | failed | stopped | preempted
    run.wait(); run.stop(); run.metrics(); run.result(); run.tail(20); run.failure()

A process is the only state; nothing lives in the kernel: a run started detached survives a kernel
restart and `Run.attach` finds it again (else the kernel's end is its stop request, kit.run.tether).
kit.run.launch writes the folder and starts it; kit.run.widgets watches it.
Kernel side: imports neither torch nor ipywidgets.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shlex
import signal
import subprocess
import time
from collections.abc import Callable
from datetime import datetime
from pathlib import Path

import psutil

from kit import ROOT
from kit.config import Config, load_config
from kit.folder import runfolder
from kit.folder.layout import RunFolder

DONE = ("completed", "failed", "stopped", "preempted")
EXIT_PREEMPTED = 75  # kit.recipe.preempt's: the ranks saved a checkpoint on a stop request and left


class RunFailed(RuntimeError):
    """A run ended with an error: which rank, its message and traceback, where the logs are."""

    def __init__(self, name: str, rank: int | None, message: str, traceback: str = "",
                 log: str = ""):
        self.name, self.rank, self.message, self.traceback, self.log = (
            name, rank, message, traceback, log)
        where = f"rank {rank}" if rank is not None else "its check step (no rank started)" if \
            message.startswith("ConfigError") else "unknown rank"
        tail = "\n".join(traceback.rstrip().splitlines()[-12:])
        super().__init__(f"run {name!r} failed on {where}: {message}"
                         + (f"\n{tail}" if tail else "") + (f"\nlog: {log}" if log else ""))


class Run:
    """A run folder and the process tree started from it (by us, a former kernel or a terminal)."""

    def __init__(self, folder: str | Path):
        self.folder = Path(folder).resolve()
        self.files = RunFolder(self.folder)  # the folder's files by name
        self.name = self.folder.name
        self._proc: subprocess.Popen | None = None
        self.tether = None  # kit.run.tether's, while this process started the run and holds it

    def __repr__(self) -> str:
        return f"Run({self.name!r}, status={self.status!r}, folder={str(self.folder)!r})"

    @classmethod
    def attach(cls, name: str | Path) -> Run:
        """The run launch/<name> (or a folder path), started earlier, possibly by another kernel."""
        folder = Path(name)
        if not folder.is_absolute() and len(folder.parts) == 1:  # a bare name: launch/<name>
            folder = ROOT / "launch" / folder
        if not RunFolder(folder).run_sh.is_file():
            raise FileNotFoundError(f"no run folder with run.sh at {folder}")
        return cls(folder)

    @property
    def config(self) -> Config:
        return load_config(self.files.config)

    def start(self, env: dict | None = None) -> Run:
        """Start run.sh in its own session, output into run.log; returns at once. The starters
        (kit.run.tether.start) tie the run to their own process unless detached."""
        env = {**os.environ, **{k: str(v) for k, v in (env or {}).items()}}
        with open(self.files.log, "wb") as log:
            self._proc = subprocess.Popen(
                ["bash", str(self.files.run_sh)], cwd=self.folder, env=env,
                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                start_new_session=True,  # its own process group: stop() signals it as one
            )
        self.files.pid.write_text(f"{self._proc.pid}\n")  # run.sh writes the same
        runfolder.release(self.folder / runfolder.CLAIM)  # from here the running run refuses
        return self

    # ------------------------------------------------------------------ state
    def _root(self) -> psutil.Process | None:
        """The bash process of run.sh while it lives (checked against pid reuse by start time)."""
        if self._proc is not None:
            self._proc.poll()  # reap our child, so a finished run is not a zombie
        try:
            pid_file = self.files.pid
            proc = psutil.Process(int(pid_file.read_text()))
            if proc.create_time() > pid_file.stat().st_mtime + 5 or \
                    proc.status() == psutil.STATUS_ZOMBIE:
                return None
            return proc
        except (FileNotFoundError, ValueError, psutil.Error):
            return None

    def processes(self) -> list[psutil.Process]:
        """Every live process of the run: bash, torchrun, and the ranks (torchrun starts each
        rank in a session of its own, so a process-group signal alone would miss them)."""
        root = self._root()
        procs = [root] if root else []
        if root is None and self.exit_code is None:  # bash gone: a torchrun left behind?
            try:
                pgid = int(self.files.pid.read_text())
            except (FileNotFoundError, ValueError):
                pgid = None
            for p in psutil.process_iter() if pgid else []:
                try:  # same group and this folder on its command line: not a reused pid
                    if os.getpgid(p.pid) == pgid and str(self.folder) in " ".join(p.cmdline()):
                        procs.append(p)
                except (OSError, psutil.Error):
                    pass
        for p in list(procs):
            try:
                procs += [c for c in p.children(recursive=True) if c not in procs]
            except psutil.Error:
                pass
        return [p for p in procs if _alive(p)]

    @property
    def exit_code(self) -> int | None:
        try:
            return int(self.files.exit_code.read_text())
        except (FileNotFoundError, ValueError):
            return None

    @property
    def status(self) -> str:
        """prepared | running | completed | failed | stopped | preempted (a stop request from
        outside, e.g. a cluster's SIGTERM, after which the ranks saved a checkpoint: resumable)."""
        if self.processes():
            return "running"
        if not self.files.pid.exists():
            return "prepared"
        if self.exit_code == 0:  # run.sh's exit code: torchrun's, so every rank's
            return "completed"
        if self.files.stop_requested.exists():
            return "stopped"
        return "preempted" if self.exit_code == EXIT_PREEMPTED else "failed"

    def wait(self, timeout: float | None = None, step: int | None = None, poll_s: float = 0.5,
             on_update: Callable[[Run], None] | None = None) -> str:
        """Block until the run ends (or, with step=N, until train step N is logged); return the
        status. A failed run raises RunFailed; timeout raises TimeoutError (the run goes on)."""
        if self.status == "prepared":
            raise RuntimeError(f"run {self.name!r} was never started: .start() or bash run.sh")
        deadline = None if timeout is None else time.monotonic() + timeout
        try:
            while True:
                status = self.status
                if on_update:
                    on_update(self)
                if status in DONE or (step and self.last_step() >= step):
                    break
                if deadline is not None and time.monotonic() > deadline:
                    raise TimeoutError(f"run {self.name!r} still {status} after {timeout}s")
                time.sleep(poll_s)
        except KeyboardInterrupt:
            print(f"interrupted; run {self.name!r} goes on ({self.status}): .stop() ends it")
            raise
        if status == "failed":
            raise self.failure()
        return status

    def stop(self, grace_s: float = 30.0) -> str:
        """SIGTERM to every process of the run, SIGKILL to those left after grace_s. The ranks
        finish their step and save a checkpoint first (kit.recipe.preempt): training.resume=auto
        continues from it. Kubernetes' default grace period is the default here too."""
        procs = self.processes()
        if not procs:
            return self.status
        self.files.stop_requested.write_text(datetime.now().isoformat() + "\n")
        for p in procs:
            _signal(p, signal.SIGTERM)
        # Polled, not psutil.wait_procs: a run started by another interpreter leaves its bash a
        # zombie there until that one reaps it, and wait_procs counts a zombie as running.
        deadline = time.monotonic() + grace_s
        while (alive := [p for p in procs if _alive(p)]) and time.monotonic() < deadline:
            time.sleep(0.1)
        if alive or self.processes():
            left = list({p.pid: p for p in alive + self.processes()}.values())
            for p in left:
                _signal(p, signal.SIGKILL)
            psutil.wait_procs(left, timeout=5)
        if self._proc is not None:
            self._proc.wait(timeout=5)
        if self.tether is not None:  # its watcher leaves now, not at its next look
            self.tether.release()
        return self.status

    def send_signal(self, sig: int) -> None:
        """`sig` to run.sh alone, which passes a stop request on to torchrun and the ranks."""
        os.kill(int(self.files.pid.read_text()), sig)

    def preempt(self, sig: int = signal.SIGTERM, timeout: float = 60.0) -> float:
        """What a cluster does to a running run: `sig` to run.sh alone (Kubernetes' SIGTERM to a
        pod's first process; Slurm's SIGUSR1 ahead of a time limit), then wait until every
        process is gone. Returns the seconds that took. run.sh passes the request on: the ranks
        save their step and exit 75 (kit.recipe.preempt); the status is then "preempted"."""
        asked = time.monotonic()
        self.send_signal(sig)
        while self.processes():
            if time.monotonic() - asked > timeout:
                raise TimeoutError(f"run {self.name!r} still running {timeout}s after {sig!r}")
            time.sleep(0.1)
        return time.monotonic() - asked

    # ------------------------------------------------------------------ outputs
    def metrics(self) -> list[dict]:
        """Rows of metrics.jsonl (rank 0): split train|val, step, loss, lr, tokens_per_s, ..."""
        return self.files.read_metrics()

    def output(self) -> str:
        """run.log as text: every rank's output, torchrun's own lines, run.sh's header."""
        try:
            return self.files.log.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def last_step(self) -> int:
        return max((r["step"] for r in self.metrics() if r.get("split") == "train"), default=0)

    def result(self) -> dict | None:
        return self.files.read_result()

    def tail(self, n: int = 20, rank: int | None = None) -> list[str]:
        """Last n lines of run.log (all ranks), or of one rank's stdout+stderr under logs/."""
        if rank is None:
            return _lines(self.files.log)[-n:]
        lines = []
        for stream in ("stdout.log", "stderr.log"):
            for f in self.files.logs.glob(f"*/attempt_*/{rank}/{stream}"):
                lines += _lines(f)
        return lines[-n:]

    def failure(self) -> RunFailed:
        """Which rank failed and why: a rank killed by a signal torchrun does not send (SIGKILL
        from the OOM killer, SIGSEGV: it leaves no error of its own, and its peers then fail with
        "Connection reset by peer"); else torchrun's per-rank error.json (written by @record) of
        the earliest failure; else the recipe's "[rank N] ..." line; else torchrun's summary."""
        log = str(self.files.log)
        errors = self._errors()
        # A rank's own error (not a lost peer's) comes first: a peer torchrun then stops may die
        # of a signal in the same second (SIGABRT in gloo's teardown was seen), and the summary's
        # times cannot order the two.
        own = [e for e in errors if not _LOST_PEER.search(_text(e[2]))]
        killed = None if own else _killed_rank(self.tail(400))
        if killed is not None:
            rank, sig = killed
            hint = (": what the kernel's OOM killer sends when host memory runs out (see dmesg)"
                    if sig == signal.SIGKILL else "")
            return RunFailed(self.name, rank, f"killed by {sig.name} (signal {int(sig)}), with no "
                             f"error of its own{hint}; the other ranks then lost their peer",
                             log=log)
        if errors:  # the first to fail; the others died of its absence ("closed by peer")
            _, rank, msg, extra, f = min(own or errors, key=lambda e: e[0])
            # The folder is the local rank; the recipe's "[rank N]" lines carry the global one.
            m = re.search(r"^\[rank (\d+)\]", "\n".join(_lines(f.parent / "stderr.log")), re.M)
            rank = int(m.group(1)) if m else rank
            return RunFailed(self.name, rank, _text(msg), extra.get("py_callstack", ""),
                             str(f.parent / "stderr.log"))
        return self._from_log(log)

    def _errors(self) -> list[tuple]:
        """(when, local rank, message, extra info, file) of every rank's error.json (@record)."""
        errors = []
        for f in self.files.logs.glob("*/attempt_*/*/error.json"):
            try:
                msg = json.loads(f.read_text())["message"]
                extra = msg.get("extraInfo", {}) if isinstance(msg, dict) else {}
                when = (int(extra.get("timestamp", 0)), f.stat().st_mtime)
                errors.append((when, int(f.parent.name), msg, extra, f))
            except (OSError, ValueError, KeyError, TypeError):
                pass
        return errors

    def _from_log(self, log: str) -> RunFailed:
        """No rank left an error.json: the recipe's "[rank N] ..." line, else torchrun's summary."""
        lines = self.tail(400)
        for line in lines:
            m = re.search(r"\[rank (\d+)\] (\w*Error: .*)", line)
            if m:
                return RunFailed(self.name, int(m.group(1)), m.group(2), log=log)
        refused = [line for line in lines if line.startswith("ConfigError: ")]
        if refused:  # run.sh's check step (kit.run.check): no rank was started
            return RunFailed(self.name, None, "; ".join(refused), log=log)
        text = "\n".join(lines)
        rank = re.search(r"rank\s*:\s*(\d+) \(local_rank", text)
        code = re.search(r"exitcode\s*:\s*(-?\d+)", text)
        if rank and code:
            n = int(code.group(1))
            why = f"killed by {signal.Signals(-n).name}" if n < 0 else f"exit code {n}"
            return RunFailed(self.name, int(rank.group(1)), why, log=log)
        return RunFailed(self.name, None, f"run.sh exit code {self.exit_code}; last lines:\n"
                         + "\n".join(lines[-10:]), log=log)


class Follow:
    """New complete lines of a file another process appends to (tqdm's \\r redraws split too);
    starts over when the file is replaced or truncated, as a relaunch does."""

    def __init__(self, path: Path):
        self.path, self.offset, self.partial = Path(path), 0, b""
        self.restarts = 0  # times the file was found shorter than what was read: start over

    def new_lines(self) -> list[str]:
        try:
            with open(self.path, "rb") as f:
                if os.fstat(f.fileno()).st_size < self.offset:
                    self.offset, self.partial = 0, b""
                    self.restarts += 1
                f.seek(self.offset)
                data = f.read()
        except FileNotFoundError:
            return []
        self.offset += len(data)
        data = self.partial + data
        cut = max(data.rfind(b"\n"), data.rfind(b"\r")) + 1
        self.partial = data[cut:]
        text = data[:cut].decode(errors="replace")
        return [s for s in re.split(r"[\r\n]+", text) if s.strip()]

    def new_rows(self) -> list[dict]:
        return [json.loads(line) for line in self.new_lines()]


def runs() -> list[Run]:
    """Every run folder under launch/, newest first."""
    folders = [p.parent for p in (ROOT / "launch").glob(f"*/{RunFolder.RUN_SH}")]
    return [Run(f) for f in sorted(folders, key=lambda f: f.stat().st_mtime, reverse=True)]


# Signals torchrun itself sends to stop the ranks that are left after a failure.
_TORCHRUN_SENDS = {signal.SIGTERM, signal.SIGINT, signal.SIGHUP}
# What a rank says when another one is gone: not a cause of its own.
_LOST_PEER = re.compile(r"(closed|reset) by peer|Broken pipe|Connection refused|ECONNRESET|"
                        r"Socket Timeout|Timed out waiting|gloo/transport|"
                        r"NCCL (error|communicator was aborted)", re.I)


def _text(msg) -> str:
    return msg["message"] if isinstance(msg, dict) else str(msg)


def _killed_rank(lines: list[str]) -> tuple[int, signal.Signals] | None:
    """(rank, signal) of the first rank in torchrun's failure summary that died of a signal
    torchrun does not send, at or before the root cause's time if one is, else after it; None if
    there is none."""
    text = "\n".join(lines)
    found = []
    for m in re.finditer(r"time\s*:\s*(\S+)\s*host\s*:.*?rank\s*:\s*(\d+) \(local_rank.*?"
                         r"exitcode\s*:\s*(-?\d+)", text, re.S):
        when, rank, code = m.group(1), int(m.group(2)), int(m.group(3))
        if code < 0 and -code in signal.Signals._value2member_map_:
            sig = signal.Signals(-code)
            if sig not in _TORCHRUN_SENDS:
                found.append((when, rank, sig))
    root = re.search(r"Root Cause.*?time\s*:\s*(\S+)", text, re.S)
    first = [f for f in found if root is None or f[0] <= root.group(1)]
    # Called only when every rank's error is a lost peer's: on a loaded machine torchrun may see
    # the peer's error before the kill (it polls), so a later kill still explains it.
    return min(first or found)[1:] if found else None


def _lines(path: Path) -> list[str]:
    try:
        text = path.read_text(errors="replace")
    except FileNotFoundError:
        return []
    return [s for s in re.split(r"[\r\n]+", text) if s.strip()]  # tqdm redraws with \r


def _alive(p: psutil.Process) -> bool:
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _signal(p: psutil.Process, sig: int) -> None:
    with contextlib.suppress(psutil.Error):
        p.send_signal(sig)


def command(folder: Path) -> str:
    """The terminal command that runs a prepared folder (what the notebook shows)."""
    return f"bash {shlex.quote(str(RunFolder(folder).run_sh))}"
