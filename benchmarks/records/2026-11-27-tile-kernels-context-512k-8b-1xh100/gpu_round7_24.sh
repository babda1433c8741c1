#!/usr/bin/env bash
# Round 7 on one H100: the tiles' kernels at one layer's size (131,072 to 524,288 tokens), then
# issue 35's 24 GiB context with them (bench-8b-context-round7-24.yaml). ~12 minutes, detached,
# polled back to back:
#   mkdir -p /tmp/r7; setsid nohup bash benchmarks/gpu_round7_24.sh /tmp/r7 > /tmp/r7/speed.log 2>&1 < /dev/null &
#   bash benchmarks/poll.sh /tmp/r7/ctx 540 DONE   (again, at once, until DONE)
set -uo pipefail
OUT=${1:-/tmp/r7}; mkdir -p "$OUT"
PYTHONPATH=. python3 benchmarks/tile_attention_bench.py --skip-check --lengths 524288 \
  --paths tiles:cudnn --out "$OUT/tiles.jsonl" > "$OUT/tiles.log" 2>&1
echo "tiles rc=$?"
MATRIX=benchmarks/matrices/bench-8b-context-round7-24.yaml SKIP_EXTRAS=1 bash benchmarks/gpu_speed.sh "$OUT/ctx"
