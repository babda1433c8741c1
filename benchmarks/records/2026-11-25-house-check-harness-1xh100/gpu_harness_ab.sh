#!/usr/bin/env bash
# Issue 29's A/B on one GPU: the benchmark's 8B pair (benchmarks/matrices/bench-8b-1gpu-house.yaml)
# with the worker before the experiment harness (commit 679671a) and after it (this tree),
# alternated twice on the same machine. Prepare the old tree beside this one (untracked, so that
# it travels to the device), then run detached and poll:
#   git worktree add /tmp/old 679671a && mkdir -p _old/benchmarks && cp -r /tmp/old/kit _old/ &&
#     cp -r /tmp/old/benchmarks/matrices _old/benchmarks/ && cp benchmarks/gpu_harness_ab.sh _old/ab.sh
#   setsid nohup bash _old/ab.sh > /tmp/ab.log 2>&1 &      (results: /tmp/ab/{old,new}{1,2}/)
set -uo pipefail
bash benchmarks/gpu_setup.sh
export KIT_HOME=/tmp/kit_home TOKENIZERS_PARALLELISM=false
PYTHONPATH=$PWD python3 -c "from kit.inputs import builtin; print(builtin.resolve('kit:llama-8b'))"
for i in 1 2; do
  (cd _old && PYTHONPATH=$PWD python3 -m kit.bench benchmarks/matrices/bench-8b-1gpu-house.yaml --out /tmp/ab/old$i 2>&1 | grep -E "^\| (article|kit)")
  PYTHONPATH=$PWD python3 -m kit.bench benchmarks/matrices/bench-8b-1gpu-house.yaml --out /tmp/ab/new$i 2>&1 | grep -E "^\| (article|kit)"
done
nproc; grep -m1 "model name" /proc/cpuinfo
touch /tmp/ab/DONE
