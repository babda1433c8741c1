#!/usr/bin/env bash
# Fill .whl/gpu (ignored by git) with what the GPU machines lack, for Python 3.12 / x86_64, small
# enough to travel (64 MiB): bitsandbytes with only its CUDA 13 libraries, the notebook stack,
# kit.sft.trainer's trl + datasets (benchmarks/tools/gpu_sft_check.sh), and the peer stack's liger-kernel.
set -euo pipefail
cd "$(dirname "$0")/../.."
dest=$PWD/.whl/gpu; tmp=$(mktemp -d); mkdir -p "$dest"
plat="--only-binary=:all: --python-version 3.12 --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_24_x86_64"
pip download -q --no-deps $plat bitsandbytes==0.50.2 -d "$tmp/bnb"
pip download -q $plat papermill ipykernel ipywidgets nbformat nbclient matplotlib pytest -d "$tmp/nb"
(cd "$tmp/bnb" && mkdir x && cd x && unzip -q ../*.whl \
  && rm -f bitsandbytes/libbitsandbytes_cuda1{18,21,24,26,28}.so \
  && grep -v -E "libbitsandbytes_cuda1(18|21|24|26|28)" bitsandbytes-*.dist-info/RECORD > R && mv R bitsandbytes-*.dist-info/RECORD \
  && zip -qr "$dest/$(basename ../*.whl)" .)
# kit.sft.trainer: trl 1.16.0, the newest 1.x (requirements.txt: trl>=1.16,<2), asks transformers>=4.56.2,
# accelerate>=1.10.1, datasets>=4.7 (the image: transformers 5.17, accelerate 1.15); datasets 5.2.0
# with the two of its dependencies the image lacks, dill and multiprocess. The others (pandas,
# pyarrow, fsspec, xxhash, huggingface_hub, filelock) are the image's: install these --no-deps
# (gpu_sft_check.sh records pip check's word on them). kit.run.jobs' jsonschema (with
# jsonschema-specifications, referencing, rpds-py) comes with nbformat above.
pip download -q --no-deps $plat trl==1.16.0 datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19 -d "$dest"
# SmolLM2 (benchmarks/tools/carry_smollm2.sh): transformers reads its GGUF file with gguf (its numpy,
# pyyaml, tqdm are the image's; requests is imported only by its scripts).
pip download -q --no-deps $plat gguf==0.19.0 -d "$dest"
# The peer stack (kit.bench.peer): liger-kernel 0.8.5, pure Python (one py3-none-any wheel, 0.9 MB),
# its Triton kernels compiled on first use; its torch and triton are the image's CUDA build's, so
# --no-deps. It needs transformers>=5 (the image: 5.17).
pip download -q --no-deps $plat liger-kernel==0.8.5 -d "$dest"
# Already on the GPU image: numpy, pillow, pyyaml, packaging, tqdm, typing_extensions, psutil.
find "$tmp/nb" -name '*.whl' ! -name 'numpy-*' ! -name 'pillow-*' ! -name 'pyyaml-*' ! -name 'packaging-*' \
  ! -name 'tqdm-*' ! -name 'typing_extensions-*' ! -name 'psutil-*' -exec cp {} "$dest" \;
du -sh "$dest"
