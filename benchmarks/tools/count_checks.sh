#!/usr/bin/env bash
# How many times one notebook launch (kit.run.launch.launch, 2 CPU processes, 2 steps) checks its
# start, per process: the config's validation (config._check), the doctor's pre-flight, the run
# folder's plan, the pitfalls' machine rules, the engine's check. Any checkout:
#   bash benchmarks/tools/count_checks.sh [CHECKOUT]      (a checkout before the packages: kit.launch)
set -euo pipefail
TREE=$(cd "${1:-.}" && pwd); HERE=$(cd "$(dirname "$0")" && pwd)
OUT=$(mktemp -d); MOD=kit.run.launch; [ -f "$TREE/kit/launch.py" ] && MOD=kit.launch
(cd "$TREE" && PYTHONPATH="$HERE/trace:$TREE" TRACE_OUT="$OUT/counts" python3 -c "
from $MOD import launch
launch('tiny-cpu', ['training.steps=2', 'training.eval_every=0', 'run.output_dir=$OUT/run'], nproc=2).wait()
" > "$OUT/log.txt" 2>&1)
python3 - "$OUT/counts" <<'PY'
import glob, json, sys
total = {}
for f in sorted(glob.glob(f"{sys.argv[1]}/*.json")):
    d = json.load(open(f))
    print(d["argv"][:70], d["counts"])
    for k, v in d["counts"].items():
        total[k] = total.get(k, 0) + v
print("processes", len(glob.glob(f"{sys.argv[1]}/*.json")), "total", total, "=", sum(total.values()))
PY
