#!/usr/bin/env bash
# Issue 30: four seeds of the article recipe and of the kit's defaults (held-out loss), on one GPU,
# ~9 minutes: started detached and polled (a device call ends at 10 minutes):
#   setsid nohup bash benchmarks/gpu_seeds.sh /tmp/seeds > /tmp/seeds.log 2>&1 < /dev/null &
#   bash benchmarks/poll.sh /tmp/seeds/bench 540 DONE
set -uo pipefail
OUT=${1:-/tmp/seeds}; mkdir -p "$OUT"
MATRIX=benchmarks/matrices/bench-8b-seeds.yaml SKIP_EXTRAS=1 bash benchmarks/gpu_speed.sh "$OUT/bench"
touch "$OUT/ALL_DONE"
