#!/usr/bin/env bash
# Issue 35's 512k within 80 GiB (bench-8b-context-512k.yaml) on one GPU of nvidia-h100-x2 (its
# 256 GiB of host memory hold the 128 GiB of offloaded layer inputs). ~20 minutes, detached,
# polled back to back:
#   mkdir -p /tmp/r7k; setsid nohup bash benchmarks/gpu_round7_512k.sh /tmp/r7k > /tmp/r7k/speed.log 2>&1 < /dev/null &
#   bash benchmarks/poll.sh /tmp/r7k/ctx 540 DONE   (again, at once, until DONE)
set -uo pipefail
OUT=${1:-/tmp/r7k}; mkdir -p "$OUT"
free -g > "$OUT/free.txt"
CUDA_VISIBLE_DEVICES=0 MATRIX=benchmarks/matrices/bench-8b-context-512k.yaml SKIP_EXTRAS=1 \
  bash benchmarks/gpu_speed.sh "$OUT/ctx"
