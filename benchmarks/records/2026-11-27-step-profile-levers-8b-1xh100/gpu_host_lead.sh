#!/usr/bin/env bash
# Issue 35: where the GPU waits for the host in the kit's default step, at 24 and 80 GiB
# (benchmarks/host_lead.py on bench-8b-round4-explore.yaml's kit-24 and kit-80). ~4 minutes:
#   setsid nohup bash benchmarks/gpu_host_lead.sh /tmp/hl > /tmp/hl/speed.log 2>&1 < /dev/null &
#   bash benchmarks/poll.sh /tmp/hl/x 560 DONE
set -uo pipefail
OUT=${1:-/tmp/hl}; mkdir -p "$OUT/x"
bash benchmarks/gpu_setup.sh
export KIT_HOME=${KIT_HOME:-/tmp/kit_home} TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
M=benchmarks/matrices/bench-8b-round4-explore.yaml
python3 -c "import sys, yaml; from kit.inputs import builtin; print(builtin.resolve(yaml.safe_load(open(sys.argv[1]))['model']))" "$M"
for c in kit-24 kit-80; do
  torchrun --nproc_per_node=1 benchmarks/host_lead.py $M $c 5 "$OUT/x/$c.json" > "$OUT/x/$c.log" 2>&1
  echo "$c rc=$?"; grep -A50 "^case" "$OUT/x/$c.log"
done
touch "$OUT/x/DONE"
