#!/usr/bin/env bash
# model.loading on ONE GPU from an 8B checkpoint written locally (kit:llama-8b, Llama-3-8B's
# shape, random weights, 16 GB of bf16 safetensors): each mode in its own process
# (python -m kit.lab.loading_rank: load, LoRA r16, FSDP2, one forward), so each row's peaks are its
# own. With one process rank0 is full (nobody to receive), so the modes are full and stream.
# table.md: seconds, peak host memory and its file-backed part, device memory after sharding and
# its peak while loading, the model's own bytes, and the digests (equal: the same model).
# Run through benchmarks/run.sh (it sets the machine up, detaches and polls):
#   bash benchmarks/run.sh benchmarks/tools/gpu_loading.sh /tmp/load
set -uo pipefail
OUT=${1:-/tmp/load}; mkdir -p "$OUT"
start=$(date +%s)
python3 -c "from kit.inputs import builtin; print(builtin.build('llama-8b'))" > "$OUT/build.log" 2>&1
echo "build: rc=$? in $(( $(date +%s) - start ))s" | tee -a "$OUT/progress.txt"
for mode in ${MODES:-full stream}; do
  start=$(date +%s)
  torchrun --standalone --nproc_per_node=1 -m kit.lab.loading_rank kit/configs/llama-1b-gpu.yaml \
    "$OUT/report" model.name=kit:llama-8b model.loading="$mode" > "$OUT/$mode.log" 2>&1
  echo "$mode: rc=$? in $(( $(date +%s) - start ))s" | tee -a "$OUT/progress.txt"
done
python3 - "$OUT/report" <<'PY' | tee "$OUT/table.md"
import json, sys
from pathlib import Path
print("| mode | seconds | host peak MiB | file-backed peak MiB | anon peak MiB | device GiB after sharding | device peak GiB | model MiB at most | digest | logits |")
print("|---|---|---|---|---|---|---|---|---|---|")
for f in sorted(Path(sys.argv[1]).glob("*/rank0.json")):
    r = json.loads(f.read_text())
    print(f"| {r['mode']} | {r['seconds']:.1f} | {r['peak_rss_mib']:,.0f} | {r['peak_file_mib']:,.0f} | "
          f"{r['peak_anon_mib']:,.0f} | {r['held_after_sharding_gib']:.2f} | {r['device_peak_gib']:.2f} | "
          f"{r['model_most_mib']:,.0f} | {r['digest'][:12]} | {r['logits_digest'][:12]} |")
PY
touch "$OUT/DONE"
