#!/usr/bin/env bash
# The speed benchmark on 2 GPUs, then notebook 06 with GPU parameters, then the FSDP1 checkpoint
# re-check (save, resume from full and sharded, merge). Runs ~15 minutes: longer than one device
# call, so it is started detached and polled with benchmarks/poll.sh (results file names it):
#   setsid nohup bash benchmarks/gpu_speed.sh /tmp/speed > /tmp/speed.log 2>&1 &
# MATRIX=benchmarks/matrices/<matrix>.yaml runs another matrix (default bench-8b.yaml; its model
# is built first); BENCH_NPROC=4 runs it on 4 GPUs (cases with their own nproc keep it).
# Results: /tmp/speed/bench/{table.md,results.jsonl,bench.png}, /tmp/speed/nb06*, /tmp/speed/ckpt.
set -uo pipefail
OUT=${1:-/tmp/speed}; mkdir -p "$OUT"
bash benchmarks/gpu_setup.sh
export KIT_HOME=${KIT_HOME:-/tmp/kit_home} TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
python3 - <<'PY' | tee "$OUT/versions.txt"
import torch, transformers, peft, bitsandbytes
print("torch", torch.__version__, "transformers", transformers.__version__, "peft", peft.__version__,
      "bitsandbytes", bitsandbytes.__version__, "gpus", torch.cuda.device_count(), torch.cuda.get_device_name(0))
PY
start=$(date +%s)
MATRIX=${MATRIX:-benchmarks/matrices/bench-8b.yaml}
python3 -c "import sys, yaml; from kit.inputs import builtin; print(builtin.resolve(yaml.safe_load(open(sys.argv[1]))['model']))" "$MATRIX"
echo "build: $(( $(date +%s) - start ))s"
python3 -m kit.bench "$MATRIX" --out "$OUT/bench" ${BENCH_ONLY:+--only "$BENCH_ONLY"} ${BENCH_NPROC:+--nproc "$BENCH_NPROC"}
echo "bench: $(( $(date +%s) - start ))s"
touch "$OUT/BENCH_DONE"
if [ -z "${SKIP_EXTRAS:-}" ]; then
  python3 -m papermill notebooks/06-attention-and-checkpointing.ipynb "$OUT/nb06.ipynb" --cwd notebooks \
    -p device cuda ${NB06_PARAMS:-} > "$OUT/nb06.log" 2>&1; echo "nb06 rc=$?"
  ENGINES=fsdp1 bash benchmarks/gpu_checkpoints.sh "$OUT/ckpt" > "$OUT/ckpt.log" 2>&1; echo "ckpt rc=$?"
fi
echo "all: $(( $(date +%s) - start ))s"
touch "$OUT/DONE"
