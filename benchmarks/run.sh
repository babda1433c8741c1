#!/usr/bin/env bash
# The one runner for device runs: set the GPU machine up, start the run detached, poll it.
#
#   bash benchmarks/run.sh MATRIX DIR [OPTIONS]    # python -m kit.bench MATRIX --out DIR/bench OPTIONS
#   bash benchmarks/run.sh SCRIPT.sh DIR [ARGS]    # bash SCRIPT.sh DIR ARGS (a tool: benchmarks/tools/)
#   bash benchmarks/run.sh SCRIPT.py DIR [ARGS]    # python3 SCRIPT.py ARGS (it writes where ARGS say)
#   bash benchmarks/run.sh --poll DIR [SECONDS]    # a later device call: poll the same run again
#
# A device call ends at 10 minutes and a run may take longer, so the run starts detached (setsid
# nohup: it outlives the call while the machine stays warm) and is polled for SECONDS (POLL_S,
# default 540). Each poll prints the log's tail and the bench's table, and packs DIR (without
# weights and checkpoints) into $OUT/<DIR's name>.tgz where $OUT is set: what a device call
# brings back. Exit: the run's exit status once it is done, 3 while it still runs, 2 on misuse.
#
# Setup, each start: the wheels the GPU images lack, from .whl/gpu (benchmarks/tools/
# fetch_gpu_wheels.sh fills it on a machine with a registry; what is installed already is kept),
# the unsloth baseline from .whl/unsloth into /tmp/unsloth-site (benchmarks/tools/unsloth_env.sh),
# the environment the kit's runs read, and DIR/device.txt (the GPU, the versions, the commit).
# DIR also gets command.txt (what ran), run.log, rc and DONE. From the repository root or not.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2

usage() { sed -n 3,6p "$0" | sed 's/^# *//' >&2; exit 2; }

pack() {  # DIR -> $OUT/<name>.tgz, without what is large and rebuilt
  [ -n "${OUT:-}" ] && [ -d "$OUT" ] || return 0
  tar czf "$OUT/$(basename "$1").tgz" --exclude='*.safetensors' --exclude='*.pt' --exclude='*.bin' \
    --exclude='*.distcp' --exclude=merged --exclude=checkpoints -C "$(dirname "$1")" "$(basename "$1")"
}

poll() {  # DIR [SECONDS]
  local dir=$1 limit=${2:-${POLL_S:-540}} start=$SECONDS
  [ -f "$dir/command.txt" ] || { echo "run.sh: $dir: no run started there" >&2; exit 2; }
  while [ ! -e "$dir/DONE" ] && (( SECONDS - start < limit )); do sleep 10; done
  tail -n "${TAIL:-25}" "$dir/run.log" 2>/dev/null
  [ -f "$dir/bench/table.md" ] && cat "$dir/bench/table.md"
  pack "$dir"
  if [ -e "$dir/DONE" ]; then
    local rc; rc=$(cat "$dir/rc" 2>/dev/null || echo 1)
    echo "done: rc=$rc, $(cat "$dir/command.txt")"; exit "$rc"
  fi
  echo "running ($(( SECONDS - start )) s this call): bash benchmarks/run.sh --poll $dir"; exit 3
}

have() { python3 -c "import $1" 2>/dev/null; }

setup() {  # DIR
  if [ -d .whl/gpu ]; then
    local bare=() full=()
    have bitsandbytes || bare+=(bitsandbytes)
    have liger_kernel || bare+=(liger-kernel==0.8.5)  # the peer stack (kit.bench.peer)
    have pytest || full+=(pytest)
    have papermill || full+=(papermill ipykernel ipywidgets matplotlib nbformat nbclient)
    (( ${#bare[@]} )) && python3 -m pip install -q --no-index --no-deps --find-links .whl/gpu \
      "${bare[@]}" 2>&1 | grep -v WARNING
    (( ${#full[@]} )) && python3 -m pip install -q --no-index --find-links .whl/gpu \
      "${full[@]}" 2>&1 | grep -v WARNING
    have ipykernel && python3 -m ipykernel install --user --name python3 > /dev/null 2>&1
  fi
  # The unsloth baseline (kit.bench.unsloth), in a folder of its own: its pins are not the kit's.
  if [ -d .whl/unsloth ] && bash benchmarks/tools/unsloth_env.sh /tmp/unsloth-site > /dev/null; then
    export KIT_UNSLOTH_PATH=/tmp/unsloth-site
  fi
  export KIT_HOME=${KIT_HOME:-/tmp/kit_home} TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
  export HF_HUB_DISABLE_PROGRESS_BARS=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
  export PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}
  { nvidia-smi --query-gpu=name,memory.total --format=csv,noheader 2>/dev/null || echo "no GPU"
    python3 - << 'PY' 2>&1
import importlib.metadata as md
def version(name):
    try:
        return md.version(name)
    except md.PackageNotFoundError:
        return "-"
print(", ".join(f"{n} {version(n)}" for n in ("torch", "transformers", "peft", "bitsandbytes",
                                             "liger-kernel")))
PY
    [ -n "${KIT_UNSLOTH_PATH:-}" ] && cat "$KIT_UNSLOTH_PATH/.ready"
    echo "commit $(git rev-parse --short HEAD 2>/dev/null || echo unknown)"; } > "$1/device.txt"
  cat "$1/device.txt"
}

[ $# -ge 2 ] || usage
if [ "$1" = --poll ]; then poll "$2" "${3:-}"; fi
what=$1 dir=$2; shift 2
[ -e "$what" ] || { echo "run.sh: $what: no such file" >&2; exit 2; }
case $what in
  *.yaml) cmd=(python3 -m kit.bench "$what" --out "$dir/bench" "$@") ;;
  *.sh) cmd=(bash "$what" "$dir" "$@") ;;
  *.py) cmd=(python3 "$what" "$@") ;;
  *) echo "run.sh: $what: expected a matrix (.yaml) or a script (.sh, .py)" >&2; exit 2 ;;
esac
if [ -f "$dir/command.txt" ] && [ ! -e "$dir/DONE" ]; then
  echo "run.sh: $dir: a run is in progress there (bash benchmarks/run.sh --poll $dir)" >&2; exit 2
fi
mkdir -p "$dir" && rm -f "$dir/DONE" "$dir/rc"
setup "$dir"
printf '%q ' "${cmd[@]}" | sed 's/ $/\n/' > "$dir/command.txt"
setsid nohup bash -c '"${@:2}" > "$1/run.log" 2>&1; echo $? > "$1/rc"; touch "$1/DONE"' \
  run "$dir" "${cmd[@]}" < /dev/null > /dev/null 2>&1 &
echo "started: $(cat "$dir/command.txt") (log: $dir/run.log)"
poll "$dir"
