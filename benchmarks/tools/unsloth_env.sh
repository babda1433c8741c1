#!/usr/bin/env bash
# Install the unsloth baseline (kit.bench.unsloth) from .whl/unsloth into a folder of its own:
#   bash benchmarks/tools/unsloth_env.sh SITE      # then KIT_UNSLOTH_PATH=SITE (benchmarks/run.sh)
# unsloth, unsloth_zoo and the trl and datasets they pin always; each other wheel only where the
# image cannot import its module (the image's own torch, transformers, peft, bitsandbytes stay the
# ones every recipe uses). Ends by importing unsloth from SITE on this machine's GPU and printing
# the versions it sees; SITE/.ready marks a folder that imported.
set -uo pipefail
cd "$(dirname "$0")/../.."
site=${1:?usage: unsloth_env.sh SITE}
wheels=.whl/unsloth
[ -d "$wheels" ] || { echo "unsloth_env.sh: no $wheels (benchmarks/tools/fetch_unsloth_wheels.sh)" >&2; exit 2; }
[ -f "$site/.ready" ] && { cat "$site/.ready"; exit 0; }
picked=()
for w in unsloth unsloth_zoo trl datasets; do picked+=("$wheels/$w"-[0-9]*.whl); done
# module:wheel for what unsloth, unsloth_zoo and datasets 4 import that an image may lack
for pair in tyro:tyro docstring_parser:docstring_parser shtab:shtab typeguard:typeguard \
    torchao:torchao cut_cross_entropy:cut_cross_entropy msgspec:msgspec hf_transfer:hf_transfer \
    sentencepiece:sentencepiece google.protobuf:protobuf einops:einops json5:json5 \
    structlog:structlog typer:typer nest_asyncio:nest_asyncio regex:regex dill:dill \
    multiprocess:multiprocess xxhash:xxhash; do
  python3 -c "import ${pair%%:*}" 2>/dev/null || picked+=("$wheels/${pair#*:}"-[0-9]*.whl)
done
python3 -m pip install -q --no-index --no-deps --target "$site" "${picked[@]}" 2>&1 | grep -v WARNING
PYTHONPATH=$site${PYTHONPATH:+:$PYTHONPATH} HF_HUB_OFFLINE=1 python3 - > "$site/.probe" 2>&1 << 'PY'
import importlib.metadata as md
import unsloth  # noqa: F401  (patches transformers: first)
print("unsloth-env:", ", ".join(f"{n} {md.version(n)}" for n in (
    "unsloth", "unsloth_zoo", "trl", "datasets", "transformers", "peft", "bitsandbytes", "torch")))
PY
if grep -q '^unsloth-env:' "$site/.probe"; then
  grep '^unsloth-env:' "$site/.probe" | tee "$site/.ready"
else
  echo "unsloth_env.sh: unsloth does not import from $site:" >&2; tail -n 15 "$site/.probe" >&2; exit 1
fi
