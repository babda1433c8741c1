#!/usr/bin/env bash
# Issue 35 / 30, round 5's first look: benchmarks/host_lead.py on the kit's default 8B cases at
# 24 and 80 GiB (bench-8b-round4.yaml's kit-24, kit-80) with every layer's backward marked, and
# the last step run under torch.cuda.set_sync_debug_mode("warn") (lines "SYNC ...": each read-back
# that makes the host wait, and where it is called from). ~5 minutes, detached and polled:
#   setsid nohup bash benchmarks/gpu_round5_lead.sh /tmp/r5 > /tmp/r5/speed.log 2>&1 < /dev/null &
#   bash benchmarks/poll.sh /tmp/r5/x 560 DONE
set -uo pipefail
OUT=${1:-/tmp/r5}; mkdir -p "$OUT/x"
bash benchmarks/gpu_setup.sh
export KIT_HOME=${KIT_HOME:-/tmp/kit_home} TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
M=${MATRIX:-benchmarks/matrices/bench-8b-round4.yaml}
for c in ${CASES:-kit-24 kit-80}; do
  torchrun --nproc_per_node=1 benchmarks/host_lead.py $M $c 5 "$OUT/x/$c.json" > "$OUT/x/$c.log" 2>&1
  echo "$c rc=$?"; grep -A80 "^case" "$OUT/x/$c.log"; grep "^SYNC" "$OUT/x/$c.log" | sort | uniq -c | sort -rn | head -20
done
touch "$OUT/x/DONE"
