#!/usr/bin/env bash
# The house check on one GPU (issues 13 and 29: same behaviour after a restructure): the
# GPU-marked tests, the recipe on a 1.24B Llama under FSDP2 and FSDP2 with the speed levers (each
# started through kit.run.launch.run_to_end, each adapter reloaded with plain PEFT; FSDP1 on one
# process is refused in one line by design), the same FSDP2 run through the front door
# (`kit train`), notebook 04's per-rank report on the GPU, then the 8B pair of
# benchmarks/matrices/bench-8b-1gpu-house.yaml.
# Longer than one device call: run through benchmarks/run.sh (it sets the machine up, detaches and polls):
#   bash benchmarks/run.sh benchmarks/tools/gpu_house_check.sh /tmp/house   # then --poll /tmp/house
set -uo pipefail
OUT=${1:-/tmp/house}; mkdir -p "$OUT"
export KIT_HOME=${KIT_HOME:-/tmp/kit_home} TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1 PYTHONPATH=$PWD  # the kit is not installed here
python3 - <<'PY' | tee "$OUT/versions.txt"
import torch, transformers, peft, bitsandbytes
print("torch", torch.__version__, "transformers", transformers.__version__, "peft", peft.__version__,
      "bitsandbytes", bitsandbytes.__version__, "gpus", torch.cuda.device_count(), torch.cuda.get_device_name(0))
PY
start=$(date +%s)
python3 -m pytest -q -m gpu tests/test_quantize.py tests/test_offload.py -p no:cacheprovider > "$OUT/pytest-gpu.log" 2>&1
echo "pytest -m gpu rc=$? $(tail -1 "$OUT/pytest-gpu.log")"
python3 - "$OUT" <<'PY'
import json, subprocess, sys, time
from pathlib import Path
from kit.run.launch import run_to_end
from kit.lab.sharding_report import bytes_per_rank, launch_report
out = Path(sys.argv[1])
cases = {"1b-fsdp2": [],
         "1b-fsdp2-levers": ["training.compile=true", "training.loss=fused",
                             "training.recompute.keeps=matmuls"]}
rows = []
for name, over in cases.items():
    t = time.time()
    run = run_to_end("kit/configs/llama-1b-gpu.yaml", [f"run.output_dir={out / name}", *over],
                     nproc=1, timeout=400, check=False)
    r, m = run.result() or {}, run.metrics()
    train = [x for x in m if x["split"] == "train"]
    tps = sorted(x["tokens_per_s"] for x in train[3:] or train)[len(train[3:] or train) // 2] if train else None
    reload = subprocess.run([sys.executable, "tests/reload_adapter.py", str(out / name), "cuda"],
                            capture_output=True, text=True).stdout.strip().splitlines()[-1:] if r else ["-"]
    rows.append(f"| {name} | {run.status} | {r.get('first_loss', 0):.3f} -> {r.get('final_loss', 0):.3f} | "
                f"{tps or 0:,.0f} | {max((x['peak_mem_gib'] for x in m), default=0):.2f} | {reload[0]} | {time.time() - t:.0f}s |")
    print(rows[-1], flush=True)
(out / "recipe.md").write_text("| run | status | loss | tokens/s (median) | peak GiB | reload | wall |\n|---|---|---|---|---|---|---|\n" + "\n".join(rows) + "\n")
report = launch_report(out / "nb04", ("fsdp2", "ddp"), 1,  # FSDP1: refused on 1 process
                        ["model.name=kit:llama-1b", "training.device=cuda"])
for engine, ranks in report.items():
    print("report", engine, ranks[0]["units"][:3], bytes_per_rank(ranks), flush=True)
PY
echo "recipe: $(( $(date +%s) - start ))s"
python3 -m kit train kit/configs/llama-1b-gpu.yaml --nproc 1 "run.output_dir=$OUT/1b-door" > "$OUT/door.log" 2>&1
echo "kit train rc=$? $(tail -1 "$OUT/door.log")"
python3 - "$OUT" <<'PY'
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
losses = {n: [r["loss"] for r in map(json.loads, (out / n / "metrics.jsonl").read_text().splitlines())
              if r.get("split") == "train"] for n in ("1b-fsdp2", "1b-door")}
print("door vs run_to_end: steps", len(losses["1b-door"]), "max |loss diff|",
      max(abs(a - b) for a, b in zip(*losses.values())))
PY
echo "door: $(( $(date +%s) - start ))s"
python3 -c "from kit.inputs import builtin; print(builtin.resolve('kit:llama-8b'))"
echo "build 8b: $(( $(date +%s) - start ))s"
python3 -m kit.bench benchmarks/matrices/bench-8b-1gpu-house.yaml --out "$OUT/bench"
echo "bench: $(( $(date +%s) - start ))s"
touch "$OUT/DONE"
