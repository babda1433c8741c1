#!/usr/bin/env bash
# Fill .whl/unsloth (ignored by git) with unsloth, the baseline kit.bench.unsloth measures, for
# Python 3.12 / x86_64: what benchmarks/run.sh installs into a folder of its own on the GPU machine
# (unsloth pins trl <= 1.15 and datasets < 5; the kit's own trl is 1.16: never one environment).
# unsloth's wheel carries its web studio (26 of its 28 MB), which a training run never imports:
# it is left out so that the wheels travel (64 MiB in all). flash-attn and xformers are too large
# to travel: unsloth runs its SDPA path without them. The image has torch, triton, transformers
# (5.17: unsloth's pin is <= 5.17.0), peft, accelerate, numpy, pandas, pyarrow, requests, pillow.
set -euo pipefail
cd "$(dirname "$0")/../.."
dest=$PWD/.whl/unsloth; tmp=$(mktemp -d); mkdir -p "$dest"
plat="--only-binary=:all: --python-version 3.12 --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_5_x86_64 --platform manylinux1_x86_64"
pip download -q --no-deps $plat unsloth==2026.10.9 -d "$tmp/u"
(cd "$tmp/u" && mkdir x && cd x && unzip -q ../*.whl && rm -rf studio \
  && grep -v '^studio/' unsloth-*.dist-info/RECORD > R && mv R unsloth-*.dist-info/RECORD \
  && zip -qr "$dest/$(basename ../*.whl)" .)
# Its pins, installed --no-deps beside it: unsloth_zoo (its kernels and patches), trl 1.15.0, the
# newest datasets below 5 and the dill and multiprocess versions that datasets allows.
pip download -q --no-deps $plat unsloth_zoo==2026.10.9 trl==1.15.0 datasets==4.8.5 dill==0.4.1 \
  multiprocess==0.70.19 -d "$dest"
# What unsloth and unsloth_zoo import that the image may lack (run.sh installs each only when the
# image cannot import it).
pip download -q --no-deps $plat tyro docstring_parser shtab typeguard torchao cut_cross_entropy \
  msgspec hf_transfer sentencepiece protobuf einops json5 structlog typer nest_asyncio regex \
  xxhash -d "$dest"
rm -rf "$tmp"
du -sh "$dest"
