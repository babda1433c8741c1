#!/usr/bin/env bash
# Issue 30: the corrected estimate's plans at 24 GiB on one GPU, the Llama-3-8B shape then
# Qwen2.5-7B's, each beside the article recipe, the peer stack and the previous plan. ~9 minutes:
# started detached and polled (a device call ends at 10 minutes):
#   setsid nohup bash benchmarks/gpu_estimate.sh /tmp/est > /tmp/est/speed.log 2>&1 < /dev/null &
#   bash benchmarks/poll.sh /tmp/est/8b 540 DONE; bash benchmarks/poll.sh /tmp/est/qwen2 540 DONE
set -uo pipefail
OUT=${1:-/tmp/est}; mkdir -p "$OUT"
MATRIX=benchmarks/matrices/bench-8b-24-estimate.yaml SKIP_EXTRAS=1 bash benchmarks/gpu_speed.sh "$OUT/8b"
MATRIX=benchmarks/matrices/bench-qwen2-7b-24-estimate.yaml SKIP_EXTRAS=1 bash benchmarks/gpu_speed.sh "$OUT/qwen2"
touch "$OUT/ALL_DONE"
