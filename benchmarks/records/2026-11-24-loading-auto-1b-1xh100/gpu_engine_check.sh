#!/usr/bin/env bash
# One GPU: the GPU-marked tests, then the recipe on a 1.24B Llama (kit/configs/llama-1b-gpu.yaml,
# NF4, LoRA r16, FSDP2 on one process, 30 steps) loaded by model.loading=auto (stream in an FSDP
# run) and by full, each adapter reloaded with plain PEFT (tests/reload_adapter.py): the same
# losses either way, and result.json's load record. Writes OUT/table.md.
#   setsid nohup bash benchmarks/gpu_engine_check.sh /tmp/engine > /tmp/engine.log 2>&1 &   # there
set -uo pipefail
OUT=${1:-/tmp/engine}; mkdir -p "$OUT"
# shellcheck source=benchmarks/gpu_env.sh
source benchmarks/gpu_env.sh
python3 -m pip install -q --no-index --no-deps --find-links .whl/gpu pytest iniconfig pluggy \
  2>&1 | grep -v WARNING
python3 -m pytest -q -m gpu tests/test_quantize.py tests/test_offload.py -p no:cacheprovider \
  > "$OUT/pytest-gpu.log" 2>&1
echo "pytest -m gpu rc=$? $(tail -1 "$OUT/pytest-gpu.log")" | tee "$OUT/progress.txt"
python3 - "$OUT" <<'PY' | tee "$OUT/table.md"
import json, subprocess, sys
from pathlib import Path
from kit.run.launch import run_to_end
out = Path(sys.argv[1])
print("| model.loading | status | loaded as | load s | host MiB peak | loss step 1 -> 30 | peak GiB | reload: max logit diff |")
print("|---|---|---|---|---|---|---|---|")
losses = {}
for mode in ("auto", "full"):
    run = run_to_end("kit/configs/llama-1b-gpu.yaml", [f"run.output_dir={out / mode}",
                     f"model.loading={mode}"], nproc=1, timeout=400, check=False)
    r, m = run.result() or {}, run.metrics()
    losses[mode] = [x["loss"] for x in m if x["split"] == "train"]
    reload = subprocess.run([sys.executable, "tests/reload_adapter.py", str(out / mode), "cuda"],
                            capture_output=True, text=True).stdout.strip().splitlines()[-1:] or ["-"]
    load = r.get("load", {})
    print(f"| {mode} | {run.status} | {load.get('mode')} | {load.get('seconds')} | "
          f"{max(load.get('peak_host_mib') or [0]):,.0f} | {r.get('first_loss', 0):.3f} -> "
          f"{r.get('final_loss', 0):.3f} | {max((x['peak_mem_gib'] for x in m), default=0):.2f} | "
          f"{reload[0]} |", flush=True)
print(f"\nper-step losses identical: {losses['auto'] == losses['full']}")
PY
touch "$OUT/DONE"
