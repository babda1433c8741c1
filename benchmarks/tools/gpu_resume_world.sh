#!/usr/bin/env bash
# Issue 36, run 6: resume at another GPU count, under NCCL. The 1.24B Llama (kit:llama-1b, NF4 +
# LoRA r16 all-linear, FSDP2, sharded checkpoints) stopped at step 6 on 2 GPUs, then resumed on 1
# GPU to step 12 (and the same again from a copy, 2 -> 2, as the reference). Recorded: the run's
# own line on the reshard, the losses on both sides of the resume, and the step-6 adapter that the
# 1-GPU run loaded (its DCP shards gathered on one rank) against the adapter the 2 GPUs saved.
#   bash benchmarks/run.sh benchmarks/tools/gpu_resume_world.sh OUT      (a machine with 2 GPUs)
# The same on a CPU (gloo, tiny model): CONFIG=tiny-cpu DEVICE=cpu bash benchmarks/tools/gpu_resume_world.sh OUT
set -uo pipefail
OUT=${1:-/tmp/resume-world}; mkdir -p "$OUT"
export KIT_HOME=${KIT_HOME:-/tmp/kit_home} TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
python3 - "$OUT" "${CONFIG:-llama-1b-gpu}" <<'PY' 2>&1 | tee "$OUT/resume.log"
import json, shutil, sys
from pathlib import Path

import torch
from safetensors.torch import load_file

from kit.folder import jsonl
from kit.run.launch import run_to_end

out, config = Path(sys.argv[1]), sys.argv[2]
args = ["data.max_seq_len=64", "training.batch_size=8", "training.steps=12", "training.eval_every=0",
        "checkpointing.save_every=6", "checkpointing.keep_last=0", "checkpointing.format=sharded"]

def train(folder, nproc, *more):
    run = run_to_end(config, [f"run.output_dir={folder}", *args, *more], nproc=nproc,
                     timeout=540, check=False)
    print(f"{folder.name}: {nproc} process(es), exit {run.exit_code}")
    if run.exit_code:
        print(run.output()[-4000:])
    return run

def losses(folder):
    return [round(m["loss"], 4) for m in jsonl.read(folder / "metrics.jsonl") if m["split"] == "train"]

a = out / "two-then-one"
train(a, 2, "training.stop_at_step=6")
b = out / "two-then-two"
shutil.copytree(a, b)
(b / "run.sh").unlink()  # written anew by the launch into its own folder
one = train(a, 1, "training.resume=auto")
two = train(b, 2, "training.resume=auto")
said = [l.split("]:", 1)[-1].strip() for l in one.output().splitlines()
        if "was written by" in l or "resumed from" in l]
print("the 1-GPU run said:", *said, sep="\n  ")
print("losses 2 -> 1:", losses(a)); print("losses 2 -> 2:", losses(b))
result = json.loads((a / "result.json").read_text())
print("result:", result["status"], "world size", result["world_size"], "steps", result["steps"])
step6 = a / "checkpoints" / "step-000006" / "adapter" / "adapter_model.safetensors"
saved = load_file(step6)
print(f"step-6 adapter saved by 2 GPUs: {len(saved)} tensors, "
      f"{sum(t.numel() for t in saved.values()):,} values, every one whole: "
      f"{all(t.dim() == 2 for t in saved.values())}")
# The resumed run's source: the step's DCP shards (2 ranks' files) gathered in this one process,
# as torch.distributed.checkpoint reads them at another world size, against the adapter file.
import tempfile
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
whole = Path(tempfile.mkdtemp()) / "step6.pt"
dcp_to_torch_save(step6.parents[1] / "dcp", whole)
model = torch.load(whole, weights_only=False)["model"]
dcp = {k.replace(".default.", "."): v for k, v in model.items() if "lora_" in k}
same = sorted(dcp) == sorted(saved) and all(
    torch.equal(dcp[k].to(saved[k].dtype), saved[k]) for k in saved)
print(f"step-6 DCP shards gathered on 1 process: {len(dcp)} adapter tensors, bit-identical to "
      f"the saved adapter: {same}")
PY
