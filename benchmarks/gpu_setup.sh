#!/usr/bin/env bash
# GPU images here have torch/transformers/peft/accelerate but no bitsandbytes, papermill, ipykernel
# or ipywidgets, and no network. Install them from wheels carried in .whl/gpu (see README there:
# `bash benchmarks/fetch_gpu_wheels.sh` on a machine with a registry fills it).
set -euo pipefail
# The peer stack's liger-kernel (kit.bench.peer), where fetch_gpu_wheels.sh carried it: without
# it a matrix's peer cases are skipped, each in one line, and the rest runs.
python3 -c "import liger_kernel" 2>/dev/null || python3 -m pip install -q --no-index --no-deps \
  --find-links .whl/gpu liger-kernel==0.8.5 2>&1 | grep -v WARNING || true
python3 -c "import bitsandbytes, papermill, ipywidgets, pytest" 2>/dev/null && exit 0
python3 -m pip install -q --no-index --find-links .whl/gpu \
  bitsandbytes papermill ipykernel ipywidgets matplotlib nbformat nbclient pytest 2>&1 | grep -v WARNING || true
python3 -m ipykernel install --user --name python3 >/dev/null
