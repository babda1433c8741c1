#!/usr/bin/env bash
# Issue 30: training.recompute.host_layers at 24 GiB on one GPU: the host link's speed
# (host_link.py), then the Llama-3-8B shape's matrix and Qwen3-8B's, each beside the article
# recipe, the peer stack and the kit's defaults. ~20 minutes: started detached and polled:
#   setsid nohup bash benchmarks/gpu_host.sh /tmp/host > /tmp/host/speed.log 2>&1 < /dev/null &
#   bash benchmarks/poll.sh /tmp/host/8b 540 DONE; bash benchmarks/poll.sh /tmp/host/qwen3 540 DONE
set -uo pipefail
OUT=${1:-/tmp/host}; mkdir -p "$OUT"
bash benchmarks/gpu_setup.sh
python3 benchmarks/host_link.py 2>&1 | tee "$OUT/host_link.txt"
MATRIX=benchmarks/matrices/bench-8b-24-host.yaml SKIP_EXTRAS=1 bash benchmarks/gpu_speed.sh "$OUT/8b"
MATRIX=benchmarks/matrices/bench-qwen3-8b-24-host.yaml SKIP_EXTRAS=1 bash benchmarks/gpu_speed.sh "$OUT/qwen3"
touch "$OUT/ALL_DONE"
