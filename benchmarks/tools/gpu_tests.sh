#!/usr/bin/env bash
# One GPU: the GPU-marked tests (pytest -m gpu, in the three files that hold them: the NF4
# layers, activation offload, the attention tiles' flash and cuDNN kernels), with the carried
# wheels; ~2 minutes:
#   bash benchmarks/run.sh benchmarks/tools/gpu_tests.sh /tmp/gpu-tests
set -uo pipefail
OUT=${1:-/tmp/gpu-tests}; mkdir -p "$OUT"
python3 -m pytest -q -m gpu tests/test_quantize.py tests/test_offload.py tests/test_long_context.py \
  -p no:cacheprovider -rs > "$OUT/pytest-gpu.log" 2>&1
echo "pytest -m gpu rc=$? $(tail -1 "$OUT/pytest-gpu.log")"
