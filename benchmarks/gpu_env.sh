# Sourced by the one-GPU measurement scripts (gpu_70b.sh, gpu_loading.sh) with OUT set: installs
# bitsandbytes from the carried .whl/gpu (the GPU image lacks it), exports what the kit's runs
# read, and records the device and the versions in $OUT/device.txt.
python3 -m pip install -q --no-index --no-deps --no-cache-dir --find-links .whl/gpu \
  bitsandbytes 2>&1 | grep -v WARNING || true  # grep finds nothing when pip is quiet
# The peer stack's liger-kernel (kit.bench.peer), where fetch_gpu_wheels.sh carried it: without
# it a matrix's peer cases are skipped, each in one line, and the rest runs.
python3 -m pip install -q --no-index --no-deps --no-cache-dir --find-links .whl/gpu   liger-kernel==0.8.5 2>&1 | grep -v WARNING || true
export KIT_HOME=${KIT_HOME:-/tmp/kit_home} TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} HF_HUB_DISABLE_PROGRESS_BARS=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/device.txt"
python3 -c "import importlib.metadata as md; print(', '.join(f'{n} {md.version(n)}' for n in
  ['torch', 'transformers', 'peft', 'bitsandbytes']))" | tee -a "$OUT/device.txt"
