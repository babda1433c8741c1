#!/usr/bin/env bash
# Save + resume + merge of the 1.24B Llama (NF4) under FSDP2 and FSDP1 on 2 GPUs (issue 5):
# times and sizes of each checkpoint kind.
# Run through benchmarks/run.sh (it sets the machine up, detaches and polls):
#   bash benchmarks/run.sh benchmarks/tools/gpu_checkpoints.sh OUT
# Per engine: run A stops at step 10 with a sharded (DCP) checkpoint every 5 steps; run B resumes
# from it (resume=auto) and saves `full` checkpoints at 15 and 20; then the adapter is merged into
# the dequantized base and exported; an uninterrupted run of each engine is the reference.
set -uo pipefail
OUT=${1:-/tmp/gpu_checkpoints}; mkdir -p "$OUT"
export KIT_HOME=${KIT_HOME:-/tmp/kit_home} TOKENIZERS_PARALLELISM=false PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
CFG=kit/configs/llama-1b-gpu.yaml
common="training.steps=20 training.eval_every=0"
train() { local out=$1; shift; torchrun --standalone --nproc_per_node=2 -m kit.train $CFG run.output_dir=$out $common "$@" >> "$out.log" 2>&1; echo "$(basename $out) $* rc=$?"; }
ENGINES=${ENGINES:-fsdp2 fsdp1}  # e.g. ENGINES=fsdp1 to re-check one engine
for engine in $ENGINES; do
  d=$OUT/$engine
  train $d sharding.engine=$engine checkpointing.save_every=5 checkpointing.format=sharded checkpointing.keep_last=0 training.stop_at_step=10
  train $d sharding.engine=$engine checkpointing.save_every=5 checkpointing.format=full checkpointing.keep_last=0 training.resume=auto
  start=$(date +%s.%N)
  python3 -m kit checkpoints merge $d $d/merged >> "$d.log" 2>&1; rc=$?
  echo "$engine merge rc=$rc seconds=$(python3 -c "print(round($(date +%s.%N)-$start,1))") bytes=$(du -sb $d/merged | cut -f1)" | tee -a "$OUT/merge.txt"
done
for engine in $ENGINES; do train $OUT/$engine-straight sharding.engine=$engine; done
python3 - "$OUT" <<'PY' | tee "$OUT/table.md"
import json, sys, pathlib
out = pathlib.Path(sys.argv[1])
print("| engine | checkpoint | format | bytes | seconds to write |")
print("|---|---|---|---|---|")
engines = [e for e in ("fsdp2", "fsdp1") if (out / e).is_dir()]
for engine in engines:
    for m in sorted((out / engine / "checkpoints").glob("step-*/COMPLETE.json")):
        r = json.loads(m.read_text())
        print(f"| {engine} | {m.parent.name} | {r['format']} | {r['bytes']:,} | {r['seconds']} |")
def losses(d):
    return [(x["step"], x["loss"]) for x in map(json.loads, (d / "metrics.jsonl").read_text().splitlines()) if x["split"] == "train"]
print()
for e in engines:
    a, b = losses(out / f"{e}-straight"), losses(out / e)
    print(f"{e} resumed vs uninterrupted: {len(a)} / {len(b)} steps, same steps {[s for s,_ in a] == [s for s,_ in b]}, "
          f"max |loss diff| {max(abs(x[1]-y[1]) for x, y in zip(a, b)):.4g}, before the resume {max(abs(x[1]-y[1]) for x, y in zip(a[:10], b[:10])):.4g}")
for e in engines:
    r = json.loads((out / e / "result.json").read_text())
    print(f"{e}: status {r['status']}, loss {r['first_loss']:.3f} -> {r['final_loss']:.3f}")
PY
