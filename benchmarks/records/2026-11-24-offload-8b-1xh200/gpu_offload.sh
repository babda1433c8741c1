#!/usr/bin/env bash
# training.offload_activations on ONE GPU at the 8B shape (kit:llama-8b, a local checkpoint of
# random weights): the recipe's 10 steps of 2,048-token rows, with and without offloading, under
# whole-layer recompute (what a layer keeps is its input) and with recompute off (everything the
# layers keep), in one invocation; then the GPU test of kit.recipe.levers.offload. table.md: peak GPU memory,
# tokens/s, loss per run.
#   setsid nohup bash benchmarks/gpu_offload.sh /tmp/offload > /tmp/offload.log 2>&1 &   # there
set -uo pipefail
OUT=${1:-/tmp/offload}; mkdir -p "$OUT/runs"
# shellcheck source=benchmarks/gpu_env.sh
source benchmarks/gpu_env.sh
python3 -m pip install -q --no-index --no-deps --find-links .whl/gpu pytest iniconfig pluggy \
  2>&1 | grep -v WARNING
python3 -m pytest -q -m gpu tests/test_offload.py 2>&1 | tail -3 | tee "$OUT/gpu-test.txt"
python3 -c "from kit.inputs import builtin; builtin.build('llama-8b')" > "$OUT/build.log" 2>&1
# name, batch, recompute, offload
while read -r name batch recompute offload; do
  start=$(date +%s)
  torchrun --standalone --nproc_per_node=1 -m kit.train kit/configs/llama-1b-gpu.yaml \
    model.name=kit:llama-8b data.path=kit:sample data.max_seq_len=2048 data.packing=true \
    data.val_path=kit:sample training.batch_size="$batch" training.steps=10 training.eval_every=0 \
    training.loss=fused training.recompute.enabled="$recompute" \
    training.offload_activations="$offload" run.output_dir="$OUT/runs/$name" \
    > "$OUT/$name.log" 2>&1
  echo "$name: rc=$? in $(( $(date +%s) - start ))s" | tee -a "$OUT/progress.txt"
done <<'RUNS'
recompute-b2 2 true false
recompute-b2-offload 2 true true
no-recompute-b1 1 false false
no-recompute-b1-offload 1 false true
RUNS
python3 benchmarks/big_table.py "$OUT"/runs/* | tee "$OUT/table.md"
touch "$OUT/DONE"
