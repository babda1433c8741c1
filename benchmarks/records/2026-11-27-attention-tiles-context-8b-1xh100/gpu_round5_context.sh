#!/usr/bin/env bash
# Issue 35's context goal on one GPU: benchmarks/tile_sdpa_check.py (the tile's causal mask and
# kernel; SKIP_CHECK=1 skips it), then bench-8b-context-tiles.yaml (the peer stack, then the kit
# with attention tiles; 24 GiB). ~10 minutes: run it in the foreground with a 590 s limit, or
# detached and polled back to back (an idle machine is given back within a minute):
#   setsid nohup bash benchmarks/gpu_round5_context.sh /tmp/r5c > /tmp/r5c/speed.log 2>&1 < /dev/null &
#   bash benchmarks/poll.sh /tmp/r5c/ctx 560 DONE
set -uo pipefail
OUT=${1:-/tmp/r5c}; mkdir -p "$OUT"
bash benchmarks/gpu_setup.sh
export KIT_HOME=${KIT_HOME:-/tmp/kit_home} PYTHONPATH=$PWD PYTHONUNBUFFERED=1
[ -n "${SKIP_CHECK:-}" ] || python3 benchmarks/tile_sdpa_check.py 2>&1 | tail -5
MATRIX=benchmarks/matrices/bench-8b-context-tiles.yaml SKIP_EXTRAS=1 bash benchmarks/gpu_speed.sh "$OUT/ctx"
