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
``adapter/`` and ``exit_code`` out. The handle on a started run (`Run`: status, wait, stop,
metrics, failure, attach) is kit/run/runs.py.
"""

from __future__ import annotations

import shutil
import sys
from datetime import datetime
from pathlib import Path

from kit import ROOT
from kit.config import Config, apply_overrides, config_from_dict, load_config
from kit.folder import runfolder
from kit.folder.layout import RunFolder
from kit.run import quoting
from kit.run.check import check as check_start
from kit.run.check import inputs as check_inputs

# The run handle lives in kit.run.runs; notebooks import it from here with launch.
from kit.run.runs import DONE, Follow, Run, RunFailed, command, runs  # noqa: F401

# What a new start in a folder replaces: the files of the start itself, never a run's results or
# logs. A recipe run's earlier files move into earlier/ first (kit.folder.runfolder); another module's
# (a benchmark case, a reproduction) log of an earlier start is replaced.
PLUMBING = (RunFolder.RUN_SH, RunFolder.PID, RunFolder.EXIT_CODE, RunFolder.STOP_REQUESTED)


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
        cfg = load_config(cfg_or_path, overrides)  # a bundled config's name reads kit/configs/
    if name:
        cfg.run.name = name
        cfg = config_from_dict(cfg.to_dict())  # the name checked as the config's own is
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
# Run "{name}": {what} under torchrun. Written by kit.run.launch, {date}.
# Runs as is from any directory, here or on each node of a cluster (with the kit installed).
# {nproc} processes on this machine; key=value arguments override config.yaml:
#   bash {script}
#   NPROC_PER_NODE=8 bash {script} training.steps=100
# Two nodes: on node 0, then on node 1 with NODE_RANK=1 (Kubeflow's PET_* variables work too):
#   NNODES=2 NODE_RANK=0 MASTER_ADDR=node0 MASTER_PORT=29500 bash {script}
# Outputs land next to this script: run.log (every rank, lines prefixed [defaultN]:), logs/ (per
# rank stdout.log, stderr.log, error.json with a failed rank's traceback), metrics.jsonl,
# result.json, adapter/, exit_code (node 0's; node N's pid and exit_code: logs/node-N/).
set -euo pipefail
RUN_DIR="$(cd "$(dirname "${{BASH_SOURCE[0]}}")" && pwd -P)"
# The folder as a YAML string for run.output_dir=: single-quoted, quotes doubled, so a folder
# named like YAML (': ', ' #', a leading quote or brace, yes, 123) stays the same text.
Q=\\'
RUN_DIR_YAML="$Q${{RUN_DIR//$Q/$Q$Q}}$Q"
KIT_ROOT=${{KIT_ROOT:-{root}}}  # ranks run here: -m kit.train, relative data paths
PYTHON=${{PYTHON:-{python}}}  # on a cluster: PYTHON=python3
NNODES="${{NNODES:-${{PET_NNODES:-{nnodes}}}}}"  # the kit's variables win; Kubeflow's PET_* fill in
NODE_RANK="${{NODE_RANK:-${{PET_NODE_RANK:-0}}}}"
NPROC_PER_NODE="${{NPROC_PER_NODE:-${{PET_NPROC_PER_NODE:-{nproc}}}}}"
MASTER_ADDR="${{MASTER_ADDR:-${{PET_MASTER_ADDR:-127.0.0.1}}}}"   # multi-node: node 0's address
MASTER_PORT="${{MASTER_PORT:-${{PET_MASTER_PORT:-29500}}}}"
RDZV_ID=${{RDZV_ID:-{rdzv_id}}}  # multi-node: one id per job, the same on every node
DIST_TIMEOUT_MIN="${{DIST_TIMEOUT_MIN:-{timeout}}}"  # collective timeout (run.dist_timeout_min)
{check}
# This node's pid, exit_code and terminal log: node 0 (and a lone node) keeps them in the run
# folder, where kit.run.launch.Run reads them; another node in logs/node-<rank>/, so that nodes
# sharing one folder (Slurm, a Kubernetes volume) each keep their own.
NODE_DIR="$RUN_DIR"
if [ "$NNODES" != 1 ] && [ "$NODE_RANK" != 0 ]; then
  NODE_DIR="$RUN_DIR/{LOGS}/node-$NODE_RANK"
  mkdir -p "$NODE_DIR"
fi
# The pid lets kit.run.launch.Run.attach find a terminal-started run; written whole by a rename, as
# a watcher (kit.run.launch started this with the same pid written) may read it at any moment.
echo $$ > "$NODE_DIR/{PID}.$$" && mv -f "$NODE_DIR/{PID}.$$" "$NODE_DIR/{PID}"
rm -f "$NODE_DIR/{EXIT_CODE}"
trap 'echo $? > "$NODE_DIR/{EXIT_CODE}"' EXIT
if [ -t 1 ]; then exec > >(tee -a "$NODE_DIR/{LOG}") 2>&1; fi   # the notebook redirects itself

# Across nodes NCCL reads these; export them before run.sh (job.sbatch, a manifest's env):
#   NCCL_SOCKET_IFNAME=eth0  the interface the nodes reach each other on, for NCCL's bootstrap
#                            and socket transport (unset: NCCL picks one, skipping lo, docker*)
#   GLOO_SOCKET_IFNAME=eth0  the same for gloo (CPU runs)
#   NCCL_IB_DISABLE=1        no InfiniBand/RoCE, TCP sockets only: slow; rules IB out of a hang
#   NCCL_DEBUG=INFO          every rank says which transport NCCL chose (NET/IB, NET/Socket, P2P)
# A collective stuck past DIST_TIMEOUT_MIN (run.dist_timeout_min, the process group's timeout)
# fails its rank, and torchrun stops every node; NCCL_TIMEOUT is not a variable PyTorch reads.
export NCCL_DEBUG="${{NCCL_DEBUG:-WARN}}"
export TOKENIZERS_PARALLELISM={TOKENIZERS_PARALLELISM}                     # fast tokenizers + forked ranks deadlock
export PYTORCH_CUDA_ALLOC_CONF={PYTORCH_CUDA_ALLOC_CONF}  # fewer fragmentation OOMs on GPUs
# A collective stuck past DIST_TIMEOUT_MIN tears its rank down (torchrun then reports it) rather
# than hanging; the NCCL watchdog's own heartbeat (default 8 min) must not fire earlier.
export TORCH_NCCL_ASYNC_ERROR_HANDLING="${{TORCH_NCCL_ASYNC_ERROR_HANDLING:-{TORCH_NCCL_ASYNC_ERROR_HANDLING}}}"
export TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC="${{TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC:-$((DIST_TIMEOUT_MIN * 60 + 60))}}"

RUN_NAME={name_word}
ON_CPU={on_cpu}                                # config.yaml has training.device={device}
echo "=== run $RUN_NAME on $(hostname), $(date '+%F %T'): $NNODES node(s) x $NPROC_PER_NODE processes"
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
  # c10d rendezvous: every node's torchrun meets at the store node 0 hosts (is_host) on
  # MASTER_ADDR:MASTER_PORT; ranks are numbered in the order nodes join.
  IS_HOST=0
  if [ "$NODE_RANK" = 0 ]; then IS_HOST=1; fi
  RDZV=(--nnodes="$NNODES" --rdzv-backend=c10d --rdzv-endpoint="$MASTER_ADDR:$MASTER_PORT"
        --rdzv-id="$RDZV_ID" --rdzv-conf=is_host="$IS_HOST")
fi
cd "$KIT_ROOT"
# torchrun: --log-dir keeps each rank's output and error.json (a failed rank's traceback, written
# by the entry point's @record); --tee also streams them here, each line prefixed [defaultN]:.
# A stop request (Kubernetes' SIGTERM to this script, Slurm's SIGTERM, or its SIGUSR1 ahead of a
# time limit) reaches torchrun as SIGTERM: bash passes nothing on by itself. torchrun forwards it
# to every rank, which saves a checkpoint and exits 75 (kit.recipe.preempt), and kills what is left 30 s
# later. A second request, 2 s or more after the first, ends torchrun and the ranks at once (a
# checkpoint being written stays step-N.tmp, which no resume takes).
STOP_AT=""
TORCHRUN=""
# shellcheck disable=SC2329  # the trap below invokes it
on_stop() {{
  if [ -z "$STOP_AT" ]; then
    STOP_AT=$SECONDS
    if [ -n "$TORCHRUN" ]; then kill -TERM "$TORCHRUN" 2>/dev/null || true; fi
  elif [ $((SECONDS - STOP_AT)) -ge 2 ] && [ -n "$TORCHRUN" ]; then
    pkill -KILL -P "$TORCHRUN" 2>/dev/null || true
    kill -KILL "$TORCHRUN" 2>/dev/null || true
  fi
}}
trap on_stop TERM INT USR1
# A failed start is started again, KIT_MAX_RESTARTS times (0 here; the Slurm and Kubernetes
# files set 3), each by a fresh torchrun (its own rendezvous: torchrun's in-place --max-restarts
# was seen to leave gloo connecting to the last attempt's ports); KIT_RESTART_COUNT > 0 makes the
# ranks resume from the last valid checkpoint by themselves (kit.folder.runfolder). Never after a stop.
ATTEMPT=0
while :; do
  if [ "$ATTEMPT" -gt 0 ] && [ "$NNODES" != 1 ]; then  # every node restarts: meet afresh
    RDZV=("${{RDZV[@]/--rdzv-id=*/--rdzv-id=$RDZV_ID-restart-$ATTEMPT}}")
  fi
  ( set -x; exec "$PYTHON" -m torch.distributed.run "${{RDZV[@]}}" --nproc_per_node="$NPROC_PER_NODE" \\
    --log-dir "$RUN_DIR/{LOGS}" --redirects 3 --tee 3 \\
    -m {module} {args} "$@" ) &
  TORCHRUN=$!
  while :; do  # wait returns early (128 + n) when a trapped signal arrives: wait again
    rc=0; wait "$TORCHRUN" || rc=$?
    if ! kill -0 "$TORCHRUN" 2>/dev/null; then  # gone: its own exit status, kept by bash
      rc=0; wait "$TORCHRUN" || rc=$?
      break
    fi
  done
  if [ "$rc" = 0 ] || [ -n "$STOP_AT" ] || [ "$ATTEMPT" -ge "${{KIT_MAX_RESTARTS:-0}}" ]; then
    break
  fi
  ATTEMPT=$((ATTEMPT + 1))
  export KIT_RESTART_COUNT="$ATTEMPT"
  unset KIT_CHECKED  # a restart plans anew: the folder holds newer checkpoints now
  echo "=== restart $ATTEMPT of ${{KIT_MAX_RESTARTS}} after exit code $rc, $(date '+%F %T')"
done
# Preempted: the ranks saved and wrote result.json "preempted" in this start (newer than pid).
if [ -n "$(find "$RUN_DIR/{RESULT}" -newer "$NODE_DIR/{PID}" 2>/dev/null)" ] &&
   grep -q '"status": "preempted"' "$RUN_DIR/{RESULT}"; then
  exit 75
fi
exit "$rc"
"""
# The run folder's names in run.sh's commands (its comments say them in words).
FOLDER_NAMES = {"PID": RunFolder.PID, "EXIT_CODE": RunFolder.EXIT_CODE, "LOG": RunFolder.LOG,
                "LOGS": RunFolder.LOGS, "RESULT": RunFolder.RESULT}
# What the recipe's run.sh passes kit.train: its config and where to write.
TRAIN_ARGS = ("{config}", "run.output_dir={run_dir_yaml}", "run.dist_timeout_min={timeout}")
# The recipe's check step (kit.run.check), before anything in the folder is touched.
CHECK_STEP = """
# The check step (kit.run.check): config, model.name, the data rows, this machine and the run folder,
# in one process before torchrun starts any rank: a mistake is one line. 3 = finished, nothing
# to do. KIT_CHECK=0 skips it (the ranks check the run folder again themselves).
if [ "${{KIT_CHECK:-1}}" != 0 ]; then
  rc=0
  ( cd "$KIT_ROOT" && "$PYTHON" -m kit.run.check {args} "$@" --nproc "$NPROC_PER_NODE" \\
      --nnodes "$NNODES" ) || rc=$?
  if [ "$rc" = 3 ]; then exit 0; fi
  if [ "$rc" != 0 ]; then exit "$rc"; fi
fi"""


def prepare(cfg_or_path: Config | str | Path, overrides: list[str] | None = None,
            nproc: int = 2, name: str | None = None, module: str = "kit.train",
            args: tuple[str, ...] | list[str] = TRAIN_ARGS,
            plan: runfolder.Plan | None = None, nnodes: int = 1) -> Path:
    """Write config.yaml and run.sh into the run folder; return the folder. A resolved Config is
    used as it is (launch and run_to_end resolve once); a path or name is resolved here.

    module, args: what torchrun runs on each rank (default: the recipe). In args, "{config}",
    "{run_dir}" and "{timeout}" stand for the folder's config.yaml, the folder and the collective
    timeout ("{run_dir_yaml}": the folder as a quoted YAML string, for a key=value override);
    everything else is passed as written. Nothing a run wrote is deleted: a recipe
    start that would replace an earlier run is refused (kit.folder.runfolder: run.start_over moves it
    into earlier/, a resume keeps what it replaces there).

    plan: for the recipe, what kit.folder.runfolder decided (launch and run_to_end plan before they
    call this); planned here when not given. Its earlier files move into earlier/ first.
    nnodes: the nodes run.sh starts on when neither NNODES nor PET_NNODES says (kit.run.jobs).

    The folder is claimed first (kit.folder.runfolder.claim): of two starts of one run at once, one
    writes and the other is refused (FolderRefused, one line). The claim stays until run.sh has
    started (its pid file) or this process ends; `runfolder.release(folder / runfolder.CLAIM)`
    gives it up earlier. A folder that cannot be written is a ConfigError naming it."""
    cfg = cfg_or_path
    if not isinstance(cfg, Config) or overrides or name:
        cfg = resolve(cfg_or_path, overrides, name)
    folder = run_dir(cfg)
    made = [p for p in (folder, *folder.parents) if not p.exists()]  # to take back if refused
    held = None
    try:
        folder.mkdir(parents=True, exist_ok=True)
        held = runfolder.claim(folder, cfg.run.name)
        if Run(folder).status == "running":
            raise RuntimeError(f"run {cfg.run.name!r} is running; stop it first: "
                               f"Run.attach({cfg.run.name!r}).stop()")
        _write(cfg, folder, nproc, module, args, plan, nnodes)
    except BaseException as e:
        runfolder.release(held)
        _remove_empty(made)
        if isinstance(e, OSError):
            raise runfolder.FolderRefused(
                f"run.output_dir: {str(folder)!r} cannot be written ({e.strerror or e}: "
                f"{e.filename or folder}); allowed: a folder this user can create and write "
                "(run.output_dir=<path>)") from None
        raise
    return folder


def _remove_empty(made: list[Path]) -> None:
    """Take back the folders a refused start created (while empty): what was there stays."""
    for path in made:
        try:
            path.rmdir()
        except OSError:
            return


def _write(cfg: Config, folder: Path, nproc: int, module: str, args, plan, nnodes: int) -> None:
    """prepare's writing, under its claim: earlier files aside, config.yaml, run.sh."""
    files = RunFolder(folder)
    cfg.run.output_dir = str(folder)
    if module == "kit.train":
        plan = plan or runfolder.plan(cfg, nproc)
        plan.keep_earlier(folder)
    else:
        files.log.unlink(missing_ok=True)
        shutil.rmtree(files.logs, ignore_errors=True)
    for f in PLUMBING:
        (folder / f).unlink(missing_ok=True)
    files.config.write_text(cfg.to_yaml())
    files.run_sh.write_text(run_sh(cfg, folder, nproc, module, args, nnodes))
    files.run_sh.chmod(0o755)


def run_sh(cfg: Config, folder: Path, nproc: int, module: str, args, nnodes: int) -> str:
    """run.sh's text: every value from the config, a path or an argument through
    kit.run.quoting (a shell word in commands, escaped in comments)."""
    try:
        rel = folder.relative_to(ROOT)
    except ValueError:
        rel = folder
    words = " ".join(_shell_word(str(arg)) for arg in args)
    what = (f"kit.train (NF4 + LoRA + {cfg.sharding.engine})" if module == "kit.train"
            else module)
    check = CHECK_STEP.format(args=words) if module == "kit.train" else ""
    return RUN_SH.format(
        name=quoting.comment(cfg.run.name), name_word=quoting.shell_word(cfg.run.name),
        what=quoting.comment(what), date=datetime.now().strftime("%F %T"),
        script=quoting.comment(quoting.shell_word(f"{rel}/{RunFolder.RUN_SH}")),
        root=quoting.shell_word(ROOT), python=quoting.shell_word(sys.executable),
        nproc=int(nproc), nnodes=int(nnodes), rdzv_id=quoting.shell_word(cfg.run.name),
        timeout=int(cfg.run.dist_timeout_min), module=quoting.shell_word(module), args=words,
        device=quoting.comment(cfg.training.device), on_cpu=int(cfg.training.device == "cpu"),
        check=check, **{k: quoting.shell_word(v) for k, v in RUN_ENV.items()}, **FOLDER_NAMES,
    )


# Placeholders in run.sh arguments, and the shell expressions they become there.
_PLACEHOLDERS = {"{config}": f'"$RUN_DIR/{RunFolder.CONFIG}"', "{run_dir}": '"$RUN_DIR"',
                 "{run_dir_yaml}": '"$RUN_DIR_YAML"', "{timeout}": '"$DIST_TIMEOUT_MIN"'}


def _shell_word(arg: str) -> str:
    """One run.sh argument: quoted, with a placeholder (at most one) left for the shell."""
    for key, value in _PLACEHOLDERS.items():
        if key in arg:
            before, after = arg.split(key, 1)
            return "".join([quoting.shell_word(before) if before else "", value,
                            quoting.shell_word(after) if after else ""])
    return quoting.shell_word(arg)


def launch(cfg_or_path: Config | str | Path, overrides: list[str] | None = None, nproc: int = 2,
           name: str | None = None, env: dict | None = None, force: bool = False,
           detach: bool = False) -> Run:
    """Check (kit.doctor), write launch/<run>/, start run.sh; returns at once (the watched way).
    The run ends with this kernel (its shutdown or restart is a stop request: a checkpoint, exit
    75, kit.run.tether) unless detach=True: then it goes on, and Run.attach(name) finds it.

    env: extra environment for the ranks, e.g. {"KIT_FAIL_RANK": "1"} (see kit/recipe/faults.py).
    A finished run (training.resume=auto at its training.steps) is said so and returned as it
    is, nothing started; a start that would replace a run raises ConfigError, nothing written."""
    cfg = resolve(cfg_or_path, overrides, name)
    check_inputs(cfg)
    preflight(cfg, force, nproc, env)
    plan = _plan(cfg, nproc)
    if plan.start is None:
        return Run(run_dir(cfg))
    run = Run(prepare(cfg, nproc=nproc, plan=plan))
    run.start({**(env or {}), **checked_env(plan)}, detach=detach)
    return run


def checked_env(plan: runfolder.Plan) -> dict:
    """What a start checked here gives run.sh: no check step (it ran here, once), and the plan
    for the ranks (kit.folder.runfolder.CHECKED: they neither check nor plan again)."""
    return {"KIT_CHECK": "0", runfolder.CHECKED: runfolder.checked_value(plan)}


def _plan(cfg: Config, nproc: int) -> runfolder.Plan:
    """The run folder's plan (kit.folder.runfolder), said in a line when the run is finished, with a
    line per checkpoint it skips."""
    plan = runfolder.plan(cfg, nproc, run_dir(cfg))
    for line in [plan.message] if plan.start is None else plan.notes:
        print(line)
    return plan


def run_to_end(cfg_or_path: Config | str | Path, overrides: list[str] | None = None,
               nproc: int = 2, name: str | None = None, module: str = "kit.train",
               args: tuple[str, ...] | list[str] = TRAIN_ARGS, env: dict | None = None,
               timeout: float = 900, check: bool = True) -> Run:
    """Prepare the run folder, run it, and return when it has ended (the captured way: output in
    the folder's run.log, `Run.output()`). A failed run raises RunFailed (check=False: returns
    it, `run.status == "failed"`); past `timeout` seconds every process of the run, ranks
    included, is stopped and TimeoutError raised. The recipe (module kit.train) is checked first
    as run.sh's check step would (kit.run.check: a ConfigError, one line per problem, before anything
    is written; a finished run is said so and returned, nothing started); other modules, such as
    the pitfalls' reproductions of what goes wrong, are not checked."""
    cfg = resolve(cfg_or_path, overrides, name)
    plan = None
    if module == "kit.train":  # what run.sh's check step would refuse, before writing anything
        cfg.run.output_dir = str(run_dir(cfg))
        plan = check_start(cfg, nproc)
        for line in [plan.message] if plan.start is None else plan.notes:
            print(line)
        if plan.start is None:
            return Run(run_dir(cfg))
    run = Run(prepare(cfg, nproc=nproc, module=module, args=args, plan=plan))
    run.start({**(env or {}), **(checked_env(plan) if plan else {})})
    try:
        run.wait(timeout=timeout, poll_s=0.2)
    except TimeoutError:
        run.stop()
        raise TimeoutError(f"run {run.name!r} stopped after {timeout}s (every process of it); "
                           f"log: {run.files.log}") from None
    except RunFailed:
        if check:
            raise
    return run


