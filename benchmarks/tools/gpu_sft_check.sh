#!/usr/bin/env bash
# kit.sft.trainer (TRL's SFTTrainer under `accelerate launch`) on ONE GPU with FSDP, for real: a 1.24B
# Llama (kit:llama-1b, random weights the kit builds on the GPU), NF4 + LoRA r16, packed rows of
# up to 512 tokens, batch 4, 40 steps. Each launcher is written by `python -m kit jobs` into a
# new run folder; each saved adapter is verified as the kit does (kit checkpoints
# verify) and reloaded with plain peft.PeftModel.from_pretrained on the base (its logits and its
# loss on the sample must change). FSDP2 first; then FSDP1 on one process, which kit.run.jobs
# refuses, launched anyway through accelerate (its FSDP1 config for 2 processes,
# --num_processes 1): kit.sft.trainer refuses it too, in one line (before, it trained step 1 and then
# failed gathering the adapter: benchmarks/records/2026-11-23-sft-fsdp-1xh100).
# With NPROC=2 (two GPUs; issue 19, run 2) both engines train on 2 processes through the
# generated FSDP2 and FSDP1 accelerate YAMLs, loading on rank 0 (model.loading=auto under
# accelerate); the saved adapter must be whole: plain PEFT refuses a rank's slice (size mismatch).
# Fits one device call (about 5 minutes with the machine's start), .whl/gpu carried:
#   bash benchmarks/tools/fetch_gpu_wheels.sh                     # here, once: fills .whl/gpu
#   bash benchmarks/run.sh benchmarks/tools/gpu_sft_check.sh /tmp/sft /tmp/sft-runs  # there: /tmp/sft gets table.md, logs
#   NPROC=2 bash benchmarks/run.sh benchmarks/tools/gpu_sft_check.sh /tmp/sft /tmp/sft-runs   # on 2 GPUs
set -uo pipefail
OUT=${1:-/tmp/sft-check}; RUNS=${2:-/tmp/sft-runs}; NPROC=${NPROC:-1}; mkdir -p "$OUT"
if [ -e "$RUNS" ]; then echo "$RUNS exists: the run folders must be new"; exit 2; fi
# bitsandbytes (NF4), trl, datasets and what datasets needs that the image lacks (dill,
# multiprocess; pandas, pyarrow, fsspec, xxhash, huggingface_hub are the image's), and kit.run.jobs'
# jsonschema (it checks the Kubernetes manifests it writes) with its own three.
python3 -m pip install -q --no-index --no-deps --no-cache-dir --find-links .whl/gpu \
  bitsandbytes trl datasets dill multiprocess jsonschema jsonschema-specifications referencing \
  rpds-py 2>&1 | grep -v WARNING
export KIT_HOME=${KIT_HOME:-/tmp/kit_home} TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
python3 - <<'PY' | tee "$OUT/versions.txt"
import importlib.metadata as md, torch
names = ["torch", "transformers", "peft", "accelerate", "trl", "datasets", "bitsandbytes",
         "pyarrow", "fsspec", "pandas", "huggingface_hub", "dill", "multiprocess"]
print(", ".join(f"{n} {md.version(n)}" for n in names))
print(f"gpus {torch.cuda.device_count()}: {torch.cuda.get_device_name(0)}")
PY
# What pip says of the two carried without their dependencies (nothing printed: consistent).
python3 -m pip check 2>&1 | grep -i -E "^(trl|datasets|multiprocess|dill|jsonschema|referencing) " | tee -a "$OUT/versions.txt"
ACC=(accelerate); command -v accelerate >/dev/null || ACC=(python3 -m accelerate.commands.accelerate_cli)
CONFIG=kit/configs/llama-1b-gpu.yaml
# Batch 4 per process on one GPU, 2 on two: the sample packs into 4 validation rows of 512 tokens,
# which must fill every rank's batch (on 2x H200 with batch 4 both engines were refused so, in
# one line from each rank: benchmarks/records/2026-11-26-plan-resume-nodes-2xh200).
OVR=(data.max_seq_len=512 data.packing=true data.val_fraction=0.25 training.batch_size=$(( 4 / NPROC ))
     training.steps=40 training.eval_every=10)
start=$(date +%s)

# name, extra overrides, --nproc-per-node for kit.run.jobs, extra accelerate arguments, timeout
launch() {
  local name=$1 over=$2 nproc=$3 accargs=$4 limit=$5 dir=$RUNS/$1
  # shellcheck disable=SC2086
  python3 -m kit jobs "$CONFIG" "${OVR[@]}" $over --nnodes 1 --nproc-per-node "$nproc" \
    --out "$dir" > "$OUT/$name.log" 2>&1 || { echo "$name: kit jobs rc=$?"; return; }
  local cmd="${ACC[*]} launch --config_file $dir/accelerate.yaml $accargs -m kit.sft.trainer $dir/config.yaml"
  echo "$cmd" > "$RUNS/$name.cmd"; echo "+ $cmd" | tee -a "$OUT/$name.log"
  local t; t=$(date +%s)
  # shellcheck disable=SC2086
  timeout "$limit" "${ACC[@]}" launch --config_file "$dir/accelerate.yaml" $accargs \
    -m kit.sft.trainer "$dir/config.yaml" >> "$OUT/$name.log" 2>&1
  local rc=$?
  echo "$rc $(( $(date +%s) - t ))" > "$RUNS/$name.rc"
  echo "$name: rc=$rc in $(( $(date +%s) - t ))s (at $(( $(date +%s) - start ))s)"
  grep -E "trainable of|^adapter:|^completed|Error|error:" "$OUT/$name.log" | grep -v Warning | head -8
  if [ -d "$dir/adapter" ]; then
    python3 -m kit checkpoints verify "$dir/adapter" > "$RUNS/$name.verify" 2>&1
    echo "verify rc=$? $(cat "$RUNS/$name.verify")" | tee -a "$OUT/$name.log"
    python3 - "$dir" > "$RUNS/$name.reload" 2>> "$OUT/$name.log" <<'PY'
# Plain PEFT: the base as the kit loads it (NF4 onto the GPU), then from_pretrained the adapter.
import json, sys, torch
from peft import PeftModel
from kit.recipe import data, quantize
from kit.config import load_config
run = sys.argv[1]
cfg = load_config(f"{run}/config.yaml")
dev = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
base, tok = quantize.load_model(cfg, dev)
tok.pad_token = tok.pad_token or tok.eos_token
texts, _ = data._chats(data.read_checked(cfg.data.path, cfg.data)[:32], cfg.data, tok, cfg.data.path)
enc = tok(texts, return_tensors="pt", padding=True).to(dev)
labels = enc.input_ids.masked_fill(enc.attention_mask == 0, -100)
def forward(m):
    with torch.no_grad():
        out = m(**enc, labels=labels)
    return out.logits.float(), out.loss.item()
before, loss_base = forward(base.eval())
model = PeftModel.from_pretrained(base, f"{run}/adapter").eval()
after, loss_adapter = forward(model)
mask = enc.attention_mask.bool()
print(json.dumps({"max_logit_change": (after - before)[mask].abs().max().item(),
                  "loss_base": loss_base, "loss_with_adapter": loss_adapter}))
PY
    echo "reload rc=$? $(cat "$RUNS/$name.reload")" | tee -a "$OUT/$name.log"
  fi
}

launch fsdp2 "" "$NPROC" "" 300
# FSDP1 on one process: kit.run.jobs' refusal (pitfall fsdp1_no_shard), then the launch anyway.
python3 -m kit jobs "$CONFIG" "${OVR[@]}" sharding.engine=fsdp1 --nnodes 1 --nproc-per-node 1 \
  --out "$RUNS/fsdp1-refused" > "$RUNS/fsdp1.refused" 2>&1; echo "kit jobs fsdp1 x1: rc=$? $(cat "$RUNS/fsdp1.refused")"
if [ "$NPROC" = 1 ]; then
  launch fsdp1 sharding.engine=fsdp1 2 "--num_processes 1" 180
else
  launch fsdp1 sharding.engine=fsdp1 "$NPROC" "" 300
fi
cp "$RUNS/fsdp2/metrics.jsonl" "$OUT/fsdp2-metrics.jsonl" 2>/dev/null
cp "$RUNS/fsdp2/result.json" "$OUT/fsdp2-result.json" 2>/dev/null

python3 - "$RUNS" "$OUT" <<'PY'
import json, sys
from pathlib import Path
runs, out = Path(sys.argv[1]), Path(sys.argv[2])
read = lambda p: p.read_text().strip() if p.exists() else ""  # noqa: E731
fmt = lambda v: "-" if v is None else f"{v:.3f}"  # noqa: E731
lines = [f"Versions: {read(out / 'versions.txt')}", "",
         "| run | accelerate | status | steps | train loss first -> final | val loss (final) | "
         "tokens/s (median) | peak GiB | adapter | verify | plain PEFT reload | wall |",
         "|---|---|---|---|---|---|---|---|---|---|---|---|"]
cmds = []
for name in ("fsdp2", "fsdp1"):
    d = runs / name
    rc, wall = (read(runs / f"{name}.rc").split() + ["-", "-"])[:2]
    r = json.loads(read(d / "result.json") or "{}")
    rows = [json.loads(x) for x in read(d / "metrics.jsonl").splitlines()]
    train = [x for x in rows if x["split"] == "train"]
    tps = sorted(x["tokens_per_s"] for x in train[3:] or train)
    peak = max((x["peak_mem_gib"] for x in rows), default=None)
    errors = [x.strip() for x in read(out / f"{name}.log").splitlines()  # kit.sft.trainer's own lines
              if x.startswith("[rank") and "Error" in x and "Warning" not in x]
    status = r.get("status") or f"failed (rc {rc})" + (f": `{errors[-1][:160]}`" if errors else "")
    a = r.get("adapter") or {}
    adapter = f"{a['tensors']} tensors, {a['bytes']:,} bytes, {r['adapter_dtype']}" if a else "-"
    verify = read(runs / f"{name}.verify").splitlines()[-1:] or ["-"]
    reload = read(runs / f"{name}.reload").splitlines()[-1:] or ["-"]
    lines.append(
        f"| {name} | {r.get('distributed_type', '-')}, world {r.get('world_size', '-')}, "
        f"loading {r.get('loading', '-')} | {status} "
        f"| {r.get('steps', len(train))} | {fmt(r.get('first_loss'))} -> {fmt(r.get('final_loss'))} "
        f"| {fmt(r.get('final_val_loss'))} | {f'{tps[len(tps) // 2]:,.0f}' if tps else '-'} "
        f"| {fmt(peak)} | {adapter} | {verify[0].split(': ', 1)[-1]} | {reload[0]} | {wall} s |")
    if read(runs / f"{name}.cmd"):
        cmds.append(f"{name}: {read(runs / f'{name}.cmd')}")
lines += ["", "Commands:", *cmds, "",
          f"kit jobs, FSDP1 on 1 process: {read(runs / 'fsdp1.refused') or '-'}"]
(out / "table.md").write_text("\n".join(lines) + "\n")
print("\n".join(lines))
PY
echo "total: $(( $(date +%s) - start ))s"
