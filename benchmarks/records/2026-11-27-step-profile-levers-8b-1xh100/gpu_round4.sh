#!/usr/bin/env bash
# Issue 35's first look on one GPU (benchmarks/matrices/bench-8b-round4-explore.yaml): the matrix
# as it is, then its two default cases again with torch's GEMM autotuning and coordinate-descent
# tuning, on the same machine. ~10 minutes: started detached and polled:
#   setsid nohup bash benchmarks/gpu_round4.sh /tmp/r4 > /tmp/r4/speed.log 2>&1 < /dev/null &
#   bash benchmarks/poll.sh /tmp/r4/plain 560 DONE; bash benchmarks/poll.sh /tmp/r4/tuned 560 DONE
set -uo pipefail
OUT=${1:-/tmp/r4}; mkdir -p "$OUT"
M=benchmarks/matrices/bench-8b-round4-explore.yaml
MATRIX=$M SKIP_EXTRAS=1 bash benchmarks/gpu_speed.sh "$OUT/plain"
TORCHINDUCTOR_MAX_AUTOTUNE_GEMM=1 TORCHINDUCTOR_COORDINATE_DESCENT_TUNING=1 BENCH_ONLY="kit-24,kit-80" \
  MATRIX=$M SKIP_EXTRAS=1 bash benchmarks/gpu_speed.sh "$OUT/tuned"
touch "$OUT/ALL_DONE"
