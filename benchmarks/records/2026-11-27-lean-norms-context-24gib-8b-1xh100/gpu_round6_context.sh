#!/usr/bin/env bash
# Issue 35's 24 GiB context goal: bench-8b-context-lean.yaml (the peer stack, then the kit with
# attention tiles and lean norms). ~12 minutes (the kit's steps at 131,072 and 163,840 tokens should take
# ~100 and ~150 s, from 78.6 s at 114,688; each length two steps), so it runs detached and is polled back to back: a
# machine left idle is given back within a minute, and the job with it.
#   mkdir -p /tmp/r6c; setsid nohup bash benchmarks/gpu_round6_context.sh /tmp/r6c > /tmp/r6c/speed.log 2>&1 < /dev/null &
#   bash benchmarks/poll.sh /tmp/r6c/ctx 560 DONE   (again, at once, until DONE)
set -uo pipefail
OUT=${1:-/tmp/r6c}; mkdir -p "$OUT"
MATRIX=benchmarks/matrices/bench-8b-context-lean.yaml SKIP_EXTRAS=1 bash benchmarks/gpu_speed.sh "$OUT/ctx"
