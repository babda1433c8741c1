#!/usr/bin/env bash
# Issue 35 after kit.recipe.optim, one GPU: bench-8b-round4.yaml, then bench-qwen2-7b-round4.yaml,
# then benchmarks/host_lead.py on the 8B shape's kit-24 case (where the GPU now waits). ~13
# minutes: started detached and polled (a device call ends at 10 minutes):
#   setsid nohup bash benchmarks/gpu_round4_confirm.sh /tmp/r4c > /tmp/r4c/speed.log 2>&1 < /dev/null &
#   bash benchmarks/poll.sh /tmp/r4c/8b 560 DONE; bash benchmarks/poll.sh /tmp/r4c/qwen2 560 DONE
set -uo pipefail
OUT=${1:-/tmp/r4c}; mkdir -p "$OUT/lead"
MATRIX=benchmarks/matrices/bench-8b-round4.yaml SKIP_EXTRAS=1 bash benchmarks/gpu_speed.sh "$OUT/8b"
MATRIX=benchmarks/matrices/bench-qwen2-7b-round4.yaml SKIP_EXTRAS=1 bash benchmarks/gpu_speed.sh "$OUT/qwen2"
export KIT_HOME=${KIT_HOME:-/tmp/kit_home} PYTHONPATH=$PWD PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
torchrun --nproc_per_node=1 benchmarks/host_lead.py benchmarks/matrices/bench-8b-round4.yaml kit-24 5 \
  "$OUT/lead/kit-24.json" > "$OUT/lead/kit-24.log" 2>&1; echo "lead rc=$?"
touch "$OUT/ALL_DONE"
