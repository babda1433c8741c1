#!/usr/bin/env bash
# The 70B shape (Llama-2-70B's, the first article's model) trained on ONE GPU with the kit's
# recipe: kit:llama-70b has no weights on disk, each tensor is initialised on the GPU at load and
# quantized to NF4 as it is made (kit.recipe.loading.initialise). LoRA r16 on all linear layers, packed
# rows of 2048 tokens (the bundled sample), FSDP2 on one process, whole-layer recompute, the
# fused loss, 20 steps, at batch 1 and 2. table.md: load time, host and GPU memory after load,
# tokens/s, peak GPU memory and the memory estimator's prediction beside it (kit.budget.estimate).
#   bash benchmarks/fetch_gpu_wheels.sh        # here, once: fills .whl/gpu (carried)
#   setsid nohup bash benchmarks/gpu_70b.sh /tmp/big > /tmp/big.log 2>&1 &   # there
#   python3 benchmarks/big_table.py /tmp/big/runs/70b-b1 /tmp/big/runs/70b-b2  # the table
set -uo pipefail
OUT=${1:-/tmp/big}; mkdir -p "$OUT/runs"
# shellcheck source=benchmarks/gpu_env.sh
source benchmarks/gpu_env.sh
for batch in ${BATCHES:-1 2}; do
  run=$OUT/runs/70b-b$batch
  start=$(date +%s)
  torchrun --standalone --nproc_per_node=1 -m kit.train kit/configs/llama-1b-gpu.yaml \
    model.name=kit:llama-70b data.max_seq_len=2048 data.packing=true \
    training.batch_size="$batch" training.steps=20 training.eval_every=10 training.loss=fused \
    run.output_dir="$run" > "$OUT/70b-b$batch.log" 2>&1
  echo "70b batch $batch: rc=$? in $(( $(date +%s) - start ))s" | tee -a "$OUT/progress.txt"
done
python3 benchmarks/big_table.py "$OUT"/runs/70b-b* | tee "$OUT/table.md"
touch "$OUT/DONE"
