#!/usr/bin/env bash
# Issue 35 / 30, round 5: where the default 8B step's GPU sits idle between kernels
# (benchmarks/gaps.py on bench-8b-round4.yaml's kit-24 and kit-80). ~5 minutes, detached, polled:
#   setsid nohup bash benchmarks/gpu_round5_gaps.sh /tmp/r5g > /tmp/r5g/speed.log 2>&1 < /dev/null &
#   bash benchmarks/poll.sh /tmp/r5g/x 560 DONE
set -uo pipefail
OUT=${1:-/tmp/r5g}; mkdir -p "$OUT/x"
bash benchmarks/gpu_setup.sh
export KIT_HOME=${KIT_HOME:-/tmp/kit_home} TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
M=${MATRIX:-benchmarks/matrices/bench-8b-round4.yaml}
for c in ${CASES:-kit-24 kit-80}; do
  torchrun --nproc_per_node=1 benchmarks/gaps.py $M $c "$OUT/x/$c.json" > "$OUT/x/$c.log" 2>&1
  echo "$c rc=$?"; grep -A80 '^{$' "$OUT/x/$c.log" | head -60
done
touch "$OUT/x/DONE"
