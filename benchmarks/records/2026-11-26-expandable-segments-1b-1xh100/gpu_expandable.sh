#!/usr/bin/env bash
# Claim B15 on one GPU: bash benchmarks/gpu_expandable.sh OUT  (device run; carry .whl)
# Writes OUT/expandable-segments.jsonl (benchmarks/expandable_segments.py: the same steps with and
# without PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True, free and under memory caps).
set -euo pipefail
OUT=${1:?OUT}; mkdir -p "$OUT"
source benchmarks/gpu_env.sh
unset PYTORCH_CUDA_ALLOC_CONF  # the script sets it per setting, in each child
python3 benchmarks/expandable_segments.py "$OUT/expandable-segments.jsonl" --model kit:llama-1b \
  --steps 60 2>&1 | tee "$OUT/expandable-segments.log"
