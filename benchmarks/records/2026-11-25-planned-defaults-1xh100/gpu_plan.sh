#!/usr/bin/env bash
# Issue 30 on one GPU, one invocation: the kit with no flags beside the article recipe and the peer
# stack on three shapes (bench-8b-planned.yaml at 24/40/80 GiB with the equivalence phase; then
# Qwen2.5-7B's and Qwen3-8B's shapes at 24 GiB). ~25 minutes: started detached, polled:
#   setsid nohup bash benchmarks/gpu_plan.sh /tmp/plan > /tmp/plan/speed.log 2>&1 < /dev/null &
#   bash benchmarks/poll.sh /tmp/plan/8b 540 DONE
set -uo pipefail
OUT=${1:-/tmp/plan}; mkdir -p "$OUT"
for m in 8b qwen2-7b qwen3-8b; do
  model=$m; [ "$m" = 8b ] && model=llama-8b
  MATRIX=benchmarks/matrices/bench-$m-planned.yaml SKIP_EXTRAS=1 bash benchmarks/gpu_speed.sh "$OUT/$m"
  python3 -m kit plan kit/configs/tiny-cpu.yaml "model.name=kit:$model" data.max_seq_len=2048 \
    training.batch_size=auto lora.r=16 lora.alpha=32 lora.dropout=0.05 training.lr=1e-3 \
    --gpus 1 --gpu-mem 24 --gpu H100 > "$OUT/$m/plan-24.txt" 2>&1
done
touch "$OUT/ALL_DONE"
