"""Launch the recipe from a notebook: write ``launch/<run>/``, start torchrun, watch, stop, re-attach.

    run = launch("tiny-cpu", overrides=["training.steps=40"], nproc=2, name="try1")
    run.wait()                 # blocks; raises RunFailed naming the rank that crashed
    run.metrics()[-1], run.result()
    Run.attach("try1")         # from a new kernel: same handle, found through the run folder
    run = run_to_end("tiny-cpu", ["training.steps=4"])   # a short run, output captured: blocks

The two ways to start ranks: `launch` (watched: returns at once, a notebook streams its progress)
and `run_to_end` (captured: returns when it ended, for short demonstrations, tests and the
benchmark runner). Both write the same run folder through `prepare`, so every run, whoever
started it, is a folder a person can re-run from a terminal with its run.sh.

Kernel side: imports neither torch nor ipywidgets and never creates a process group; the ranks
are started by ``launch/<run>/run.sh``, a plain bash torchrun script that a person can also run
from a terminal or copy to a cluster node. Everything the two sides share is a file in the run
folder: ``config.yaml`` in; ``pid``, ``run.log`` (all ranks, each line prefixed ``[defaultN]:``),
``logs/`` (torchrun's per-rank stdout/stderr/error.json), ``metrics.jsonl``, ``result.json``,
``adapter/`` and ``exit_code`` out. A process is the only state; nothing lives in the kernel, so a
run survives a kernel restart and ``Run.attach`` finds it again.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from datetime import datetime
from pathlib import Path

import psutil

from kit import ROOT, jsonl
from kit.config import Config, ConfigError, apply_overrides, config_from_dict, load_config

CONFIGS = ROOT / "kit" / "configs"
DONE = ("completed", "failed", "stopped")
# Files a run writes; a new launch under the same name removes exactly these (never the folder:
# run.output_dir may point anywhere).
RUN_FILES = ("config.yaml", "run.sh", "run.log", "pid", "exit_code", "stop_requested",
             "metrics.jsonl", "result.json", "probe.pt")
TRAINED = ("metrics.jsonl", "result.json", "probe.pt")


class RunFailed(RuntimeError):
    """A run ended with an error: which rank, its message and traceback, where the logs are."""

    def __init__(self, name: str, rank: int | None, message: str, traceback: str = "",
                 log: str = ""):
        self.name, self.rank, self.message, self.traceback, self.log = (
            name, rank, message, traceback, log)
        where = f"rank {rank}" if rank is not None else "unknown rank"
        tail = "\n".join(traceback.rstrip().splitlines()[-12:])
        super().__init__(f"run {name!r} failed on {where}: {message}"
                         + (f"\n{tail}" if tail else "") + (f"\nlog: {log}" if log else ""))


class PreflightFailed(RuntimeError):
    """kit.doctor found error-level problems; launch(..., force=True) starts anyway."""

    def __init__(self, findings: list):
        self.findings = findings
        lines = [f"{f.code}: {f.message}" + (f" (fix: {f.fix})" if f.fix else "")
                 for f in findings]
        super().__init__("preflight found errors; fix them or pass force=True:\n  "
                         + "\n  ".join(lines))


# --------------------------------------------------------------------------- writing a run folder


def resolve(cfg_or_path: Config | str | Path, overrides: list[str] | None = None,
            name: str | None = None) -> Config:
    """A validated Config from a Config, a YAML path or a bundled config's name ("tiny-cpu")."""
    overrides = list(overrides or [])
    if isinstance(cfg_or_path, Config):
        cfg = config_from_dict(apply_overrides(cfg_or_path.to_dict(), overrides))
    else:
        path = Path(cfg_or_path)
        if not path.exists() and (CONFIGS / f"{path}.yaml").is_file():
            path = CONFIGS / f"{path}.yaml"
        cfg = load_config(path, overrides)
    cfg.run.name = name or cfg.run.name
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*", cfg.run.name):
        raise ConfigError(f"run.name: {cfg.run.name!r} is not allowed; expected letters, digits, "
                          "'.', '_' or '-' (it names a folder)")
    return cfg


def run_dir(cfg: Config) -> Path:
    """Where the run's files go: cfg.output_dir, relative ones under the checkout."""
    out = cfg.output_dir
    return out if out.is_absolute() else ROOT / out


# What run.sh exports for the ranks (kit.doctor judges the environment the ranks will see).
RUN_ENV = {
    "TOKENIZERS_PARALLELISM": "false",
    "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True",
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1",
}


def preflight(cfg: Config, force: bool = False, nproc: int = 2, env: dict | None = None) -> list:
    """Run kit.doctor's pre-flight checks on cfg, for the environment run.sh gives the ranks:
    print the findings; raise PreflightFailed on an error-level one unless force.
    env: extra variables for the ranks."""
    from kit import doctor

    variables = {**RUN_ENV, **{k: str(v) for k, v in (env or {}).items()}}
    machine = doctor.detect_env(vars=variables, nproc_per_node=nproc)
    findings = list(doctor.preflight(cfg, machine))
    errors = [f for f in findings if f.level == "error"]
    if errors and not force:
        raise PreflightFailed(errors)
    for f in findings:
        print(f"[preflight {f.level}] {f.code}: {f.message}" + (f" (fix: {f.fix})" if f.fix else ""))
    return findings


RUN_SH = """\
#!/usr/bin/env bash
# Run "{name}": {what} under torchrun. Written by kit.launch, {date}.
# Runs as is from any directory, here or on each node of a cluster (with the kit installed).
# {nproc} processes on this machine; key=value arguments override config.yaml:
#   bash {rel}/run.sh
#   NPROC_PER_NODE=8 bash {rel}/run.sh training.steps=100
# Two nodes: on node 0, then on node 1 with NODE_RANK=1:
#   NNODES=2 NODE_RANK=0 MASTER_ADDR=node0 MASTER_PORT=29500 bash {rel}/run.sh
# Outputs land next to this script: run.log (every rank, lines prefixed [defaultN]:), logs/ (per
# rank stdout.log, stderr.log, error.json with a failed rank's traceback), metrics.jsonl,
# result.json, adapter/, exit_code.
set -euo pipefail
RUN_DIR="$(cd "$(dirname "${{BASH_SOURCE[0]}}")" && pwd -P)"
echo $$ > "$RUN_DIR/pid"               # lets kit.launch.Run.attach find a terminal-started run
rm -f "$RUN_DIR/exit_code"
trap 'echo $? > "$RUN_DIR/exit_code"' EXIT
trap 'exit 143' TERM                   # after torchrun has stopped its ranks: exit_code 143
if [ -t 1 ]; then exec > >(tee "$RUN_DIR/run.log") 2>&1; fi   # the notebook redirects itself

KIT_ROOT="${{KIT_ROOT:-{root}}}"  # ranks run here: -m kit.train, relative data paths
PYTHON="${{PYTHON:-{python}}}"  # on a cluster: PYTHON=python3
NNODES="${{NNODES:-1}}"
NODE_RANK="${{NODE_RANK:-0}}"
NPROC_PER_NODE="${{NPROC_PER_NODE:-{nproc}}}"
MASTER_ADDR="${{MASTER_ADDR:-127.0.0.1}}"   # multi-node only: node 0's address, reachable by all
MASTER_PORT="${{MASTER_PORT:-29500}}"
DIST_TIMEOUT_MIN="${{DIST_TIMEOUT_MIN:-{timeout}}}"  # collective timeout (run.dist_timeout_min)

export TOKENIZERS_PARALLELISM={TOKENIZERS_PARALLELISM}                     # fast tokenizers + forked ranks deadlock
export PYTORCH_CUDA_ALLOC_CONF={PYTORCH_CUDA_ALLOC_CONF}  # fewer fragmentation OOMs on GPUs
# A collective stuck past DIST_TIMEOUT_MIN tears its rank down (torchrun then reports it) rather
# than hanging; the NCCL watchdog's own heartbeat (default 8 min) must not fire earlier.
export TORCH_NCCL_ASYNC_ERROR_HANDLING="${{TORCH_NCCL_ASYNC_ERROR_HANDLING:-{TORCH_NCCL_ASYNC_ERROR_HANDLING}}}"
export TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC="${{TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC:-$((DIST_TIMEOUT_MIN * 60 + 60))}}"

ON_CPU={on_cpu}                                # config.yaml has training.device={device}
echo "=== run {name} on $(hostname), $(date '+%F %T'): $NNODES node(s) x $NPROC_PER_NODE processes"
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  nvidia-smi --query-gpu=index,name,memory.total,memory.used,driver_version --format=csv,noheader
  echo "NVLink links active on GPU 0: $(nvidia-smi nvlink --status -i 0 2>/dev/null | grep -c 'GB/s' || true)"
else
  echo "no GPU visible (nvidia-smi): CPU run over gloo"
  ON_CPU=1
fi
if [ "$ON_CPU" = 1 ]; then
  export OMP_NUM_THREADS="${{OMP_NUM_THREADS:-1}}"      # ranks share the cores: one thread each
fi

if [ "$NNODES" = 1 ]; then
  RDZV=(--standalone)                   # one node: torchrun picks a free port itself
else
  RDZV=(--nnodes="$NNODES" --node_rank="$NODE_RANK" --master_addr="$MASTER_ADDR" --master_port="$MASTER_PORT")
fi
cd "$KIT_ROOT"
# torchrun: --log-dir keeps each rank's output and error.json (a failed rank's traceback, written
# by the entry point's @record); --tee also streams them here, each line prefixed [defaultN]:.
( set -x; exec "$PYTHON" -m torch.distributed.run "${{RDZV[@]}}" --nproc_per_node="$NPROC_PER_NODE" \\
  --log-dir "$RUN_DIR/logs" --redirects 3 --tee 3 \\
  -m {module} {args} "$@" )
"""
# What the recipe's run.sh passes kit.train: its config and where to write.
TRAIN_ARGS = ("{config}", "run.output_dir={run_dir}", "run.dist_timeout_min={timeout}")


def prepare(cfg_or_path: Config | str | Path, overrides: list[str] | None = None,
            nproc: int = 2, name: str | None = None, module: str = "kit.train",
            args: tuple[str, ...] | list[str] = TRAIN_ARGS) -> Path:
    """Write config.yaml and run.sh into the run folder; return the folder. A resolved Config is
    used as it is (launch and run_to_end resolve once); a path or name is resolved here.

    module, args: what torchrun runs on each rank (default: the recipe). In args, "{config}",
    "{run_dir}" and "{timeout}" stand for the folder's config.yaml, the folder and the collective
    timeout; everything else is passed as written. Files of an earlier start (run.sh, logs) are
    replaced; trained results (adapter, checkpoints, metrics, result) are the recipe's to keep:
    it refuses a fresh start over them unless run.overwrite (and a resume continues them)."""
    cfg = cfg_or_path
    if not isinstance(cfg, Config) or overrides or name:
        cfg = resolve(cfg_or_path, overrides, name)
    folder = run_dir(cfg)
    if folder.exists() and Run(folder).status == "running":
        raise RuntimeError(f"run {cfg.run.name!r} is running; stop it first: "
                           f"Run.attach({cfg.run.name!r}).stop()")
    for f in RUN_FILES:
        if f not in TRAINED:
            (folder / f).unlink(missing_ok=True)
    shutil.rmtree(folder / "logs", ignore_errors=True)
    folder.mkdir(parents=True, exist_ok=True)
    cfg.run.output_dir = str(folder)
    (folder / "config.yaml").write_text(cfg.to_yaml())
    try:
        rel = folder.relative_to(ROOT)
    except ValueError:
        rel = folder
    words = " ".join(_shell_word(str(arg)) for arg in args)
    what = (f"kit.train (NF4 + LoRA + {cfg.sharding.engine})" if module == "kit.train"
            else module)
    script = RUN_SH.format(
        name=cfg.run.name, what=what, date=datetime.now().strftime("%F %T"),
        rel=rel, root=ROOT, python=sys.executable, nproc=int(nproc),
        timeout=cfg.run.dist_timeout_min, module=module, args=words,
        device=cfg.training.device, on_cpu=int(cfg.training.device == "cpu"), **RUN_ENV,
    )
    (folder / "run.sh").write_text(script)
    (folder / "run.sh").chmod(0o755)
    return folder


# Placeholders in run.sh arguments, and the shell expressions they become there.
_PLACEHOLDERS = {"{config}": '"$RUN_DIR/config.yaml"', "{run_dir}": '"$RUN_DIR"',
                 "{timeout}": '"$DIST_TIMEOUT_MIN"'}


def _shell_word(arg: str) -> str:
    """One run.sh argument: quoted, with a placeholder (at most one) left for the shell."""
    for key, value in _PLACEHOLDERS.items():
        if key in arg:
            before, after = arg.split(key, 1)
            return "".join([shlex.quote(before) if before else "", value,
                            shlex.quote(after) if after else ""])
    return shlex.quote(arg)


def launch(cfg_or_path: Config | str | Path, overrides: list[str] | None = None, nproc: int = 2,
           name: str | None = None, env: dict | None = None, force: bool = False) -> Run:
    """Check (kit.doctor), write launch/<run>/, start run.sh; returns at once (the watched way).

    env: extra environment for the ranks, e.g. {"KIT_FAIL_RANK": "1"} (see kit/faults.py)."""
    cfg = resolve(cfg_or_path, overrides, name)
    preflight(cfg, force, nproc, env)
    run = Run(prepare(cfg, nproc=nproc))
    run.start(env)
    return run


def run_to_end(cfg_or_path: Config | str | Path, overrides: list[str] | None = None,
               nproc: int = 2, name: str | None = None, module: str = "kit.train",
               args: tuple[str, ...] | list[str] = TRAIN_ARGS, env: dict | None = None,
               timeout: float = 900, check: bool = True) -> Run:
    """Prepare the run folder, run it, and return when it has ended (the captured way: output in
    the folder's run.log, `Run.output()`). A failed run raises RunFailed (check=False: returns
    it, `run.status == "failed"`); past `timeout` seconds every process of the run, ranks
    included, is stopped and TimeoutError raised. No pre-flight: demonstrations of what goes
    wrong run through here on purpose."""
    cfg = resolve(cfg_or_path, overrides, name)
    run = Run(prepare(cfg, nproc=nproc, module=module, args=args))
    run.start(env)
    try:
        run.wait(timeout=timeout, poll_s=0.2)
    except TimeoutError:
        run.stop()
        raise TimeoutError(f"run {run.name!r} stopped after {timeout}s (every process of it); "
                           f"log: {run.folder / 'run.log'}") from None
    except RunFailed:
        if check:
            raise
    return run


# --------------------------------------------------------------------------- the run handle


class Run:
    """A run folder and the process tree started from it (by us, a former kernel or a terminal)."""

    def __init__(self, folder: str | Path):
        self.folder = Path(folder).resolve()
        self.name = self.folder.name
        self._proc: subprocess.Popen | None = None

    def __repr__(self) -> str:
        return f"Run({self.name!r}, status={self.status!r}, folder={str(self.folder)!r})"

    @classmethod
    def attach(cls, name: str | Path) -> Run:
        """The run launch/<name> (or a folder path), started earlier, possibly by another kernel."""
        folder = Path(name)
        if not folder.is_absolute() and len(folder.parts) == 1:  # a bare name: launch/<name>
            folder = ROOT / "launch" / folder
        if not (folder / "run.sh").is_file():
            raise FileNotFoundError(f"no run folder with run.sh at {folder}")
        return cls(folder)

    @property
    def config(self) -> Config:
        return load_config(self.folder / "config.yaml")

    def start(self, env: dict | None = None) -> Run:
        """Start run.sh in its own session, output into run.log; returns at once."""
        env = {**os.environ, **{k: str(v) for k, v in (env or {}).items()}}
        with open(self.folder / "run.log", "wb") as log:
            self._proc = subprocess.Popen(
                ["bash", str(self.folder / "run.sh")], cwd=self.folder, env=env,
                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                start_new_session=True,  # its own process group: stop() signals it as one
            )
        (self.folder / "pid").write_text(f"{self._proc.pid}\n")  # run.sh writes the same
        return self

    # ------------------------------------------------------------------ state
    def _root(self) -> psutil.Process | None:
        """run.sh's bash process while it lives (checked against pid reuse by start time)."""
        if self._proc is not None:
            self._proc.poll()  # reap our child, so a finished run is not a zombie
        try:
            pid_file = self.folder / "pid"
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
                pgid = int((self.folder / "pid").read_text())
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
            return int((self.folder / "exit_code").read_text())
        except (FileNotFoundError, ValueError):
            return None

    @property
    def status(self) -> str:
        """prepared | running | completed | failed | stopped."""
        if self.processes():
            return "running"
        if not (self.folder / "pid").exists():
            return "prepared"
        if self.exit_code == 0 and (self.folder / "result.json").exists():
            return "completed"
        if (self.folder / "stop_requested").exists():
            return "stopped"
        return "failed"

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

    def stop(self, grace_s: float = 10.0) -> str:
        """SIGTERM to every process of the run, SIGKILL to those left after grace_s."""
        procs = self.processes()
        if not procs:
            return self.status
        (self.folder / "stop_requested").write_text(datetime.now().isoformat() + "\n")
        for p in procs:
            _signal(p, signal.SIGTERM)
        _, alive = psutil.wait_procs(procs, timeout=grace_s)
        if alive or self.processes():
            left = list({p.pid: p for p in alive + self.processes()}.values())
            for p in left:
                _signal(p, signal.SIGKILL)
            psutil.wait_procs(left, timeout=5)
        if self._proc is not None:
            self._proc.wait(timeout=5)
        return self.status

    # ------------------------------------------------------------------ outputs
    def metrics(self) -> list[dict]:
        """Rows of metrics.jsonl (rank 0): split train|val, step, loss, lr, tokens_per_s, ..."""
        return jsonl.read(self.folder / "metrics.jsonl")

    def output(self) -> str:
        """run.log as text: every rank's output, torchrun's own lines, run.sh's header."""
        try:
            return (self.folder / "run.log").read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def last_step(self) -> int:
        return max((r["step"] for r in self.metrics() if r.get("split") == "train"), default=0)

    def result(self) -> dict | None:
        try:
            return json.loads((self.folder / "result.json").read_text())
        except (FileNotFoundError, json.JSONDecodeError):
            return None

    def tail(self, n: int = 20, rank: int | None = None) -> list[str]:
        """Last n lines of run.log (all ranks), or of one rank's stdout+stderr under logs/."""
        if rank is None:
            return _lines(self.folder / "run.log")[-n:]
        lines = []
        for stream in ("stdout.log", "stderr.log"):
            for f in self.folder.glob(f"logs/*/attempt_*/{rank}/{stream}"):
                lines += _lines(f)
        return lines[-n:]

    def failure(self) -> RunFailed:
        """Which rank failed and why: torchrun's per-rank error.json (written by @record) of the
        earliest failure; else the recipe's "[rank N] ..." line; else torchrun's summary."""
        log = str(self.folder / "run.log")
        errors = []
        for f in self.folder.glob("logs/*/attempt_*/*/error.json"):
            try:
                msg = json.loads(f.read_text())["message"]
                extra = msg.get("extraInfo", {}) if isinstance(msg, dict) else {}
                when = (int(extra.get("timestamp", 0)), f.stat().st_mtime)
                errors.append((when, int(f.parent.name), msg, extra, f))
            except (OSError, ValueError, KeyError, TypeError):
                pass
        if errors:  # the first to fail; the others died of its absence ("closed by peer")
            _, rank, msg, extra, f = min(errors, key=lambda e: e[0])
            text = msg["message"] if isinstance(msg, dict) else str(msg)
            # The folder is the local rank; the recipe's "[rank N]" lines carry the global one.
            m = re.search(r"^\[rank (\d+)\]", "\n".join(_lines(f.parent / "stderr.log")), re.M)
            rank = int(m.group(1)) if m else rank
            return RunFailed(self.name, rank, text, extra.get("py_callstack", ""),
                             str(f.parent / "stderr.log"))
        lines = self.tail(400)
        for line in lines:
            m = re.search(r"\[rank (\d+)\] (\w*Error: .*)", line)
            if m:
                return RunFailed(self.name, int(m.group(1)), m.group(2), log=log)
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
    folders = [p.parent for p in (ROOT / "launch").glob("*/run.sh")]
    return [Run(f) for f in sorted(folders, key=lambda f: f.stat().st_mtime, reverse=True)]


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
    try:
        p.send_signal(sig)
    except psutil.Error:
        pass


def command(folder: Path) -> str:
    """The terminal command that runs a prepared folder (what the notebook shows)."""
    return f"bash {shlex.quote(str(folder / 'run.sh'))}"
