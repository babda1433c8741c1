#!/usr/bin/env bash
# Speed round 2 on one GPU (issue 18): notebook 03 on the GPU first (what it writes to stderr),
# then benchmarks/matrices/bench-8b-round2.yaml (every cap and the context sweep, one invocation).
# Longer than one device call: started detached and polled. MATRIX=... runs another matrix;
# SKIP_NB03=1 leaves the notebook out (bench-8b-context.yaml ran so).
#   setsid nohup bash benchmarks/gpu_round2.sh /tmp/r2 > /tmp/r2.log 2>&1 < /dev/null &
#   bash benchmarks/poll.sh /tmp/r2 540 DONE
set -uo pipefail
OUT=${1:-/tmp/r2}; mkdir -p "$OUT"
bash benchmarks/gpu_setup.sh  # papermill for notebook 03; gpu_speed.sh records the versions
export KIT_HOME=${KIT_HOME:-/tmp/kit_home} TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
start=$(date +%s)
if [ -z "${SKIP_NB03:-}" ]; then
  python3 -m papermill notebooks/03-lora-adapters.ipynb "$OUT/nb03.ipynb" --cwd notebooks > "$OUT/nb03.log" 2>&1
  echo "nb03 rc=$? $(( $(date +%s) - start ))s"
else
  echo "nb03 skipped (SKIP_NB03)"
fi
[ -z "${SKIP_NB03:-}" ] && python3 - "$OUT/nb03.ipynb" <<'PY' > "$OUT/nb03-stderr.txt"
import json, sys
for c in json.load(open(sys.argv[1]))["cells"]:
    for o in c.get("outputs", []):
        if o.get("name") == "stderr":
            print(f"--- cell {c['id']}: {''.join(c['source']).splitlines()[0][:80]}")
            print("".join(o["text"]))
PY
# The benchmark itself: gpu_speed.sh with this matrix, nothing after it (it writes $OUT/bench and
# touches $OUT/DONE).
MATRIX=${MATRIX:-benchmarks/matrices/bench-8b-round2.yaml} SKIP_EXTRAS=1 bash benchmarks/gpu_speed.sh "$OUT"
