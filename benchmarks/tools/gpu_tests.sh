#!/usr/bin/env bash
# One GPU: the GPU-marked tests (pytest -m gpu: every test file that holds one), with the carried
# wheels; a few minutes:
#   bash benchmarks/run.sh benchmarks/tools/gpu_tests.sh /tmp/gpu-tests
set -uo pipefail
OUT=${1:-/tmp/gpu-tests}; mkdir -p "$OUT"
python3 -m pytest -q -m gpu $(grep -l "mark.gpu" tests/test_*.py) -p no:cacheprovider -rs > "$OUT/pytest-gpu.log" 2>&1
echo "pytest -m gpu rc=$? $(tail -1 "$OUT/pytest-gpu.log")"
