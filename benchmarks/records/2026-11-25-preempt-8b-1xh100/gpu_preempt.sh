#!/usr/bin/env bash
# Preemption on one GPU (issue 34): the Llama-3-8B shape (kit:llama-8b, random weights) in NF4 with
# LoRA r16 on all linear layers, FSDP2, packed rows of 2048 tokens. SIGTERM to run.sh alone (what
# Kubernetes sends a pod's first process) once step 3 is logged: seconds from the signal to the
# preemption checkpoint and to run.sh's exit (Kubernetes kills 30 s after its SIGTERM); then the
# same run.sh started as a requeued Slurm job (SLURM_RESTART_COUNT=1) resumes from it.
#   bash benchmarks/gpu_preempt.sh OUT        (from the repo root; writes OUT/preempt.md)
set -uo pipefail
OUT=${1:-/tmp/gpu_preempt}; mkdir -p "$OUT"
bash benchmarks/gpu_setup.sh
export KIT_HOME=${KIT_HOME:-/tmp/kit_home} TOKENIZERS_PARALLELISM=false
python3 - "$OUT" <<'PY' 2>&1 | tee "$OUT/preempt.log"
import json, os, signal, subprocess, sys, time
from pathlib import Path

from kit.run.launch import launch

out = Path(sys.argv[1]) / "run"
overrides = [f"run.output_dir={out}", "model.name=kit:llama-8b", "data.max_seq_len=2048",
             "data.packing=true", "training.batch_size=1", "training.steps=12",
             "training.eval_every=0", "training.lr=2.0e-4", "checkpointing.save_every=0"]
began = time.monotonic()
run = launch("llama-1b-gpu", overrides, nproc=1)
run.wait(step=3, timeout=540)
loaded = time.monotonic() - began
asked = time.monotonic()
os.kill(int((out / "pid").read_text()), signal.SIGTERM)
while run.processes():
    time.sleep(0.05)
gone = time.monotonic() - asked
result = json.loads((out / "result.json").read_text())
step = result["steps"]
ckpt = out / "checkpoints" / f"step-{step:06d}"
made = json.loads((ckpt / "COMPLETE.json").read_text())
said = next(line for line in run.output().splitlines() if "preempted (SIGTERM)" in line)
lines = [
    "# Preemption of an 8B QLoRA run on one GPU (benchmarks/gpu_preempt.sh)", "",
    f"Device: {subprocess.run(['nvidia-smi', '--query-gpu=name', '--format=csv,noheader'], capture_output=True, text=True).stdout.strip()}; "
    f"start to step 3 logged: {loaded:.0f} s (model built at load, quantized, sharded).", "",
    f"- SIGTERM to run.sh after step 3: run.sh exit code {run.exit_code}, status {run.status!r}, "
    f"result.json status {result['status']!r} at step {step}",
    f"- seconds from SIGTERM to every process gone: {gone:.1f} (Kubernetes' grace period: 30)",
    f"- the checkpoint: {made['bytes']:,} bytes, written in {made['seconds']} s ({made['format']})",
    f"- the ranks' line: `{said.split(']:', 1)[-1]}`",
]
env = {**os.environ, "SLURM_RESTART_COUNT": "1"}
began = time.monotonic()
proc = subprocess.run(["bash", str(out / "run.sh")], env=env,
                      capture_output=True, text=True)
said = [line.split("]:", 1)[-1] for line in proc.stdout.splitlines()
        if "a restart of this run" in line or "resumed from" in line or "completed at" in line]
lines += [f"- restarted as a requeued Slurm job (SLURM_RESTART_COUNT=1): exit "
          f"code {proc.returncode} after {time.monotonic() - began:.0f} s; " + "; ".join(f"`{s}`" for s in said)]
(out.parent / "preempt.md").write_text("\n".join(lines) + "\n")
print("\n".join(lines))
print(proc.stdout[-3000:], proc.stderr[-3000:])
PY
