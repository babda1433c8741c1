#!/usr/bin/env bash
# Issue 35's 24 GiB context goal: bench-8b-context-lean.yaml (the peer stack, then the kit with
# attention tiles and lean norms). ~10 minutes: run it in the foreground within one device call
# (a detached job is lost when an idle machine is given back):
#   timeout 575 bash benchmarks/gpu_round6_context.sh /tmp/r6c
set -uo pipefail
OUT=${1:-/tmp/r6c}; mkdir -p "$OUT"
MATRIX=benchmarks/matrices/bench-8b-context-lean.yaml SKIP_EXTRAS=1 bash benchmarks/gpu_speed.sh "$OUT/ctx"
