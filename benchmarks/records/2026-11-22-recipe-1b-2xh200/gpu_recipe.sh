#!/usr/bin/env bash
# The recipe on a GPU machine (issue 2's check): tiny and ~1B Llama, NF4, FSDP2 and FSDP1, 2 GPUs.
# Run from the repo root on a machine with >= 2 GPUs, with the bitsandbytes wheel in .whl/:
#   bash benchmarks/gpu_recipe.sh OUT_DIR
# Prints a table; per-run logs, metrics and results land in OUT_DIR.
set -uo pipefail
OUT=${1:-/tmp/gpu_recipe}; mkdir -p "$OUT"
bash benchmarks/gpu_setup.sh
export KIT_HOME=${KIT_HOME:-/tmp/kit_home} TOKENIZERS_PARALLELISM=false
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
NPROC=${NPROC:-2}
python3 - <<'PY' | tee "$OUT/versions.txt"
import torch, transformers, peft, bitsandbytes, accelerate
print("torch", torch.__version__, "transformers", transformers.__version__, "peft", peft.__version__,
      "bitsandbytes", bitsandbytes.__version__, "accelerate", accelerate.__version__)
print("gpus", torch.cuda.device_count(), torch.cuda.get_device_name(0))
PY
nvidia-smi topo -m 2>/dev/null | head -5 | tee -a "$OUT/versions.txt"
run() {  # name config overrides...
  local name=$1 config=$2; shift 2
  local start=$(date +%s)
  torchrun --standalone --nproc_per_node="$NPROC" -m kit.train "$config" \
    run.output_dir="$OUT/$name" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  local reload="-"
  if [ $rc -eq 0 ]; then
    reload=$(python3 tests/reload_adapter.py "$OUT/$name" cuda 2>>"$OUT/$name.log" | tail -1)
  fi
  echo "$name rc=$rc wall=$(( $(date +%s) - start ))s reload=$reload" | tee -a "$OUT/summary.txt"
}
run tiny-fsdp2 kit/configs/tiny-cpu.yaml sharding.engine=fsdp2 training.device=cuda
run tiny-fsdp1 kit/configs/tiny-cpu.yaml sharding.engine=fsdp1 training.device=cuda
run 1b-fsdp2 kit/configs/llama-1b-gpu.yaml sharding.engine=fsdp2
run 1b-fsdp1 kit/configs/llama-1b-gpu.yaml sharding.engine=fsdp1
python3 - "$OUT" <<'PY' | tee "$OUT/table.md"
import json, sys, pathlib
out = pathlib.Path(sys.argv[1])
print("| run | first loss | final loss | val loss | tokens/s/GPU (median) | peak GiB | trainable | ranks agree |")
print("|---|---|---|---|---|---|---|---|")
for d in sorted(p for p in out.iterdir() if (p / "result.json").exists()):
    r = json.loads((d / "result.json").read_text())
    m = [json.loads(l) for l in (d / "metrics.jsonl").read_text().splitlines()]
    tr = [x for x in m if x["split"] == "train"][3:] or [x for x in m if x["split"] == "train"]
    tps = sorted(x["tokens_per_s"] for x in tr)[len(tr) // 2]
    agree = len(set(r["lora_checksums"])) == 1
    print(f"| {d.name} | {r['first_loss']:.3f} | {r['final_loss']:.3f} | {r['final_val_loss']:.3f} | "
          f"{tps:,.0f} | {max(x['peak_mem_gib'] for x in m):.2f} | {r['params']['trainable']:,} | {agree} |")
PY
