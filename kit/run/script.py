"""run.sh: the bash torchrun script of a run folder, written by kit.run.launch.prepare.

Every value in it, from the config, a path or an argument, goes through kit.run.quoting (a shell
word in commands, escaped in comments): a config value is data there, never a command.
Kernel side: no torch.
"""

from __future__ import annotations

import sys
from datetime import datetime
from pathlib import Path

from kit import ROOT
from kit.config import Config
from kit.folder.layout import RunFolder
from kit.run import quoting

# What run.sh exports for the ranks (kit.doctor judges the environment the ranks will see).
RUN_ENV = {
    "TOKENIZERS_PARALLELISM": "false",
    "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True",
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1",
}


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
  export KIT_RESTART_COUNT="$ATTEMPT"  # rank 0 plans the run folder anew: newer checkpoints now
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
# to do. It writes the start (start.json: its plan, what it does to the folder) for the ranks,
# which then neither check nor plan again. KIT_CHECK=0 skips it (kit train and a notebook's
# launch checked already and name their start in KIT_START; without one, rank 0 checks).
if [ "${{KIT_CHECK:-1}}" != 0 ]; then
  rc=0
  ( cd "$KIT_ROOT" && "$PYTHON" -m kit.run.check {args} "$@" --nproc "$NPROC_PER_NODE" \\
      --nnodes "$NNODES" --start ) || rc=$?
  if [ "$rc" = 3 ]; then exit 0; fi
  if [ "$rc" != 0 ]; then exit "$rc"; fi
  export KIT_START="$RUN_DIR/{START}"
fi"""


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
    check = CHECK_STEP.format(args=words, START=RunFolder.START) if module == "kit.train" else ""
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
