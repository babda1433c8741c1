#!/usr/bin/env bash
# Issue 35's 24 GiB context with nothing set but the rows' length: bench-8b-context-planned.yaml.
# ~6 minutes (load ~40 s, two steps of ~100 s at 131,072 tokens), so it runs detached and is
# polled back to back (a machine left idle is given back within a minute, and the job with it):
#   mkdir -p /tmp/r6p; setsid nohup bash benchmarks/gpu_round6_planned.sh /tmp/r6p > /tmp/r6p/speed.log 2>&1 < /dev/null &
#   bash benchmarks/poll.sh /tmp/r6p/ctx 540 DONE   (again, at once, until DONE)
set -uo pipefail
OUT=${1:-/tmp/r6p}; mkdir -p "$OUT"
MATRIX=benchmarks/matrices/bench-8b-context-planned.yaml SKIP_EXTRAS=1 bash benchmarks/gpu_speed.sh "$OUT/ctx"
