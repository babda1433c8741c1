#!/usr/bin/env bash
# Issue 30: training.recompute.host_layers at 24 GiB on one GPU: the host link's speed
# (host_link.py), the host tests on the GPU (a failure stops here: nothing to measure), then the
# Llama-3-8B shape's matrix beside the article recipe, the peer stack and the kit's defaults
# (QWEN3=1: Qwen3-8B's after it). ~12 minutes: started detached and polled:
#   setsid nohup bash benchmarks/gpu_host.sh /tmp/host > /tmp/host/speed.log 2>&1 < /dev/null &
#   bash benchmarks/poll.sh /tmp/host/8b 540 DONE
set -uo pipefail
OUT=${1:-/tmp/host}; mkdir -p "$OUT"
bash benchmarks/gpu_setup.sh
python3 benchmarks/host_link.py 2>&1 | tee "$OUT/host_link.txt"
if ! python3 -m pytest -q -p no:cacheprovider tests/test_recompute.py -k host_layers -m "gpu or not gpu" \
    > "$OUT/tests.log" 2>&1; then
  tail -30 "$OUT/tests.log"; mkdir -p "$OUT/8b"; touch "$OUT/8b/DONE" "$OUT/ALL_DONE"; exit 1
fi
tail -3 "$OUT/tests.log"
MATRIX=benchmarks/matrices/bench-8b-24-host.yaml SKIP_EXTRAS=1 bash benchmarks/gpu_speed.sh "$OUT/8b"
[ -n "${QWEN3:-}" ] && MATRIX=benchmarks/matrices/bench-qwen3-8b-24-host.yaml SKIP_EXTRAS=1 \
  bash benchmarks/gpu_speed.sh "$OUT/qwen3"
touch "$OUT/ALL_DONE"
