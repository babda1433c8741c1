#!/usr/bin/env bash
# Issue 30 on one GPU: Qwen2.5-7B's and Qwen3-8B's shapes at 24, 40 and 80 GiB, the kit with no
# flags beside the article recipe and the peer stack (bench-qwen2-7b-caps.yaml, then
# bench-qwen3-8b-caps.yaml). ~14 minutes: started detached and polled back to back (a device call
# ends at 10 minutes, and an idle machine is given back ~30 s after a call):
#   setsid nohup bash benchmarks/gpu_caps.sh /tmp/caps > /tmp/caps/speed.log 2>&1 < /dev/null &
#   bash benchmarks/poll.sh /tmp/caps/qwen2 540 DONE; bash benchmarks/poll.sh /tmp/caps/qwen3 540 DONE
set -uo pipefail
OUT=${1:-/tmp/caps}; mkdir -p "$OUT"
for m in qwen2-7b qwen3-8b; do
  dir=$OUT/${m%%-*}
  MATRIX=benchmarks/matrices/bench-$m-caps.yaml SKIP_EXTRAS=1 bash benchmarks/gpu_speed.sh "$dir"
  for gib in 24 40 80; do
    python3 -m kit plan kit/configs/tiny-cpu.yaml "model.name=kit:$m" data.max_seq_len=2048 \
      training.batch_size=auto lora.r=16 lora.alpha=32 lora.dropout=0.05 training.lr=1e-3 \
      --gpus 1 --gpu-mem "$gib" --gpu H100 > "$dir/plan-$gib.txt" 2>&1
  done
done
touch "$OUT/ALL_DONE"
