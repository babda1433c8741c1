#!/usr/bin/env bash
# The generated run.sh as two "nodes" on one 2-GPU machine, under NCCL (issue 19, run 2): two
# torchrun agents of one process each meet in the c10d rendezvous on 127.0.0.1, each node seeing
# its own GPU (CUDA_VISIBLE_DEVICES, what separate machines give for free); then the same config
# as one node x 2 processes (torchrun standalone), twice (the launch's own run-to-run spread).
# The losses of every logged step side by side, and what NCCL says it used between the ranks.
# Each folder is written by `python -m kit jobs` (a new folder); nodes are started exactly as the
# README's by-hand lines say: NNODES=2 NODE_RANK=<n> MASTER_ADDR=<node 0> bash <folder>/run.sh.
#   bash benchmarks/run.sh benchmarks/tools/gpu_nodes_check.sh /tmp/nodes /tmp/nodes-runs   # 2 GPUs
# The same on a CPU (gloo; how the script itself was checked):
#   CONFIG=kit/configs/tiny-cpu.yaml OVERRIDES="training.steps=6 training.eval_every=3" \
#     bash benchmarks/tools/gpu_nodes_check.sh /tmp/nodes-check /tmp/nodes-runs
set -uo pipefail
OUT=${1:-/tmp/nodes-check}; RUNS=${2:-/tmp/nodes-runs}; mkdir -p "$OUT"
if [ -e "$RUNS" ]; then echo "$RUNS exists: the run folders must be new"; exit 2; fi
export KIT_HOME=${KIT_HOME:-/tmp/kit_home} TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
CONFIG=${CONFIG:-kit/configs/llama-1b-gpu.yaml}
# shellcheck disable=SC2206
OVR=(${OVERRIDES:-training.steps=20 training.eval_every=10 data.max_seq_len=512 data.packing=true
     data.val_fraction=0.25 training.batch_size=4})
start=$(date +%s)
jobs_for() {  # folder nnodes nproc
  python3 -m kit jobs "$CONFIG" "${OVR[@]}" --nnodes "$2" --nproc-per-node "$3" --out "$1" \
    > "$1.jobs.log" 2>&1 || { echo "kit jobs $1: rc=$? $(tail -2 "$1.jobs.log")"; exit 1; }
}
mkdir -p "$RUNS"
jobs_for "$RUNS/two-nodes" 2 1
PORT=$(python3 -c "from kit.run.nodes import free_port; print(free_port())")
t=$(date +%s)
for node in 0 1; do
  CUDA_VISIBLE_DEVICES=$node NNODES=2 NODE_RANK=$node MASTER_ADDR=127.0.0.1 MASTER_PORT=$PORT \
    NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=INIT,P2P,SHM,NET \
    timeout 300 bash "$RUNS/two-nodes/run.sh" > "$OUT/two-nodes-node$node.log" 2>&1 &
done
wait
echo "two-nodes: node exit codes $(cat "$RUNS/two-nodes/exit_code" 2>/dev/null) $(cat "$RUNS/two-nodes/logs/node-1/exit_code" 2>/dev/null) in $(( $(date +%s) - t ))s"
for run in one-node one-node-again; do
  jobs_for "$RUNS/$run" 1 2
  t=$(date +%s)
  timeout 300 bash "$RUNS/$run/run.sh" > "$OUT/$run.log" 2>&1
  echo "$run: rc=$? in $(( $(date +%s) - t ))s"
done
python3 - "$RUNS" "$OUT" <<'PY'
import json, re, sys
from pathlib import Path
runs, out = Path(sys.argv[1]), Path(sys.argv[2])
def losses(name):
    p = runs / name / "metrics.jsonl"
    rows = [json.loads(x) for x in p.read_text().splitlines()] if p.exists() else []
    return {(r["split"], r["step"]): r["loss"] for r in rows}
two, one, again = (losses(n) for n in ("two-nodes", "one-node", "one-node-again"))
keys = sorted(set(two) | set(one), key=lambda k: (k[1], k[0]))
fmt = lambda v: "-" if v is None else f"{v:.4f}"  # noqa: E731
lines = ["| split | step | 2 nodes x 1 GPU | 1 node x 2 GPUs | 1 node x 2 GPUs, again |",
         "|---|---|---|---|---|"]
lines += [f"| {s} | {n} | {fmt(two.get((s, n)))} | {fmt(one.get((s, n)))} | "
          f"{fmt(again.get((s, n)))} |" for s, n in keys]
both = [k for k in keys if k in two and k in one]
diff = lambda a, b: max((abs(a[k] - b[k]) for k in both if k in a and k in b), default=None)  # noqa: E731
lines += ["", f"Logged losses: {len(two)} (two nodes), {len(one)} (one node); identical at every "
          f"step: {bool(both) and all(two[k] == one[k] for k in both)}; largest difference "
          f"two nodes vs one node {fmt(diff(two, one))}, one node vs itself {fmt(diff(one, again))}."]
# NCCL's own words on the channels between the two ranks (P2P/CUMEM, SHM, NET/Socket, NET/IB).
for name in ("two-nodes-node0", "two-nodes-node1"):
    log = (out / f"{name}.log").read_text(errors="replace") if (out / f"{name}.log").exists() else ""
    via = sorted({m.group(1) for m in re.finditer(r"via (\S+)", log)})
    lines.append(f"{name}: NCCL channels via {', '.join(via) or '-'}")
for name in ("two-nodes", "one-node"):
    r = runs / name / "result.json"
    if r.exists():
        j = json.loads(r.read_text())
        lines.append(f"{name}: {j.get('status')} at step {j.get('steps')}, world "
                     f"{j.get('world_size')}, adapter {j.get('adapter', {}).get('bytes', '-')} bytes")
(out / "table.md").write_text("\n".join(lines) + "\n")
print("\n".join(lines))
PY
echo "total: $(( $(date +%s) - start ))s"
