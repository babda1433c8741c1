#!/usr/bin/env bash
# Fill .whl/gpu (ignored by git) with what the GPU machines lack, for Python 3.12 / x86_64, small
# enough to travel (64 MiB): bitsandbytes with only its CUDA 13 libraries, and the notebook stack.
set -euo pipefail
cd "$(dirname "$0")/.."
dest=$PWD/.whl/gpu; tmp=$(mktemp -d); mkdir -p "$dest"
plat="--only-binary=:all: --python-version 3.12 --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_24_x86_64"
pip download -q --no-deps $plat bitsandbytes==0.50.2 -d "$tmp/bnb"
pip download -q $plat papermill ipykernel ipywidgets nbformat nbclient matplotlib pytest -d "$tmp/nb"
(cd "$tmp/bnb" && mkdir x && cd x && unzip -q ../*.whl \
  && rm -f bitsandbytes/libbitsandbytes_cuda1{18,21,24,26,28}.so \
  && grep -v -E "libbitsandbytes_cuda1(18|21|24|26|28)" bitsandbytes-*.dist-info/RECORD > R && mv R bitsandbytes-*.dist-info/RECORD \
  && zip -qr "$dest/$(basename ../*.whl)" .)
# Already on the GPU image: numpy, pillow, pyyaml, packaging, tqdm, typing_extensions, psutil.
find "$tmp/nb" -name '*.whl' ! -name 'numpy-*' ! -name 'pillow-*' ! -name 'pyyaml-*' ! -name 'packaging-*' \
  ! -name 'tqdm-*' ! -name 'typing_extensions-*' ! -name 'psutil-*' -exec cp {} "$dest" \;
du -sh "$dest"
