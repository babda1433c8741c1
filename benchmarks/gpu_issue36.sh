#!/usr/bin/env bash
# Issue 36 on a machine with 2 GPUs (nvidia-h100-x2 or nvidia-h200-x2): the runs that need
# several GPUs, in one detached invocation (a device call ends at 10 minutes; poll with back-to-back
# calls, the machine stays warm ~30 s between them):
#   mkdir -p /tmp/i36; (setsid nohup bash benchmarks/gpu_issue36.sh /tmp/i36 > /tmp/i36/all.log 2>&1 < /dev/null &)
#   bash benchmarks/gpu_issue36.sh --poll /tmp/i36 540      # again until it prints ALL_DONE
# SETS (default: scale plan70 nccl resume, in this order; ~25 minutes in all):
#   scale   run 3: bench-8b-2gpu-planned.yaml, the kit's defaults on 2 GPUs beside the article
#           recipe and the peer stack at 24 and 80 GiB, and the same kit cases on 1 GPU (~8 min)
#   plan70  run 4: bench-70b-2gpu-planned.yaml, the planner's 70B configuration on 2x 24 and
#           2x 80 GiB, predicted against measured peak (~5 min)
#   nccl    run 1: kit.recipe.sft under accelerate with the generated FSDP2 and FSDP1 YAMLs on 2
#           GPUs (gpu_sft_check.sh, NPROC=2), then run.sh as two nodes beside one node x 2
#           (gpu_nodes_check.sh) (~8 min)
#   resume  run 6: stopped on 2 GPUs, resumed on 1 (gpu_resume_world.sh) (~2 min)
#   moe     run 5 and issue 33: bench-moe-planned.yaml, Qwen3-30B-A3B's shape with NF4 experts,
#           20 steps, on 1 GPU at 24 and 80 GiB (side by side, one GPU each), then 2 GPUs at 24
#   gptoss  issue 33: bench-gpt-oss-planned.yaml, gpt-oss-20b's shape on 1 GPU at 24 and 80 GiB
#           (side by side on a 2-GPU machine, one after the other on one GPU); not run yet
#   notebooks  run 2: every notebook with its GPU parameters on 2 processes (gpu_notebooks.sh);
#           waits (at most 10 minutes) for SmolLM2's two carried parts (benchmarks/carry_smollm2.sh)
#   moe4    run 5, the largest MoE: bench-moe-235b-4gpu.yaml, Qwen3-235B-A22B's shape on 4 GPUs
#   scale4  run 3 on 4 GPUs: bench-8b-4gpu-planned.yaml, the kit's defaults on 4 GPUs and on 1
#   x4c     a machine with 4 GPUs, from a copy of the tree (later calls' copies leave it alone):
#           GPUs 0,1 run notebooks 05, primer, 06, 07, 08 while GPUs 2,3 run the sft check
#           (gpu_sft_check.sh, NPROC=2) and notebooks 09, 10, 11, 12 (12 once SmolLM2's parts
#           are carried), each notebook stopped after NB_TIMEOUT (420 s); then all four run `moe4`
#   x4      a machine with 4 GPUs, in three lanes: GPUs 0,1 run `gptoss nccl` while GPUs 2,3 run
#           `resume notebooks` (each lane with its own KIT_HOME, into OUT/a and OUT/b), then all
#           four run `moe4 scale4`
# .whl/gpu carried (bash benchmarks/fetch_gpu_wheels.sh here first). Results: OUT/SET/.
set -uo pipefail
if [ "${1:-}" = --poll ]; then  # wait for ALL_DONE (at most $3 s), then copy what exists into $OUT
  DIR=$2; LIMIT=${3:-540}; start=$(date +%s)
  while [ ! -e "$DIR/ALL_DONE" ] && [ $(( $(date +%s) - start )) -lt "$LIMIT" ]; do sleep 10; done
  for log in "$DIR"/all.log "$DIR"/[ab]/all.log; do [ -e "$log" ] || continue; echo "== $log"
    grep -E "^(==|set |bench:|build:|sft |nodes |fsdp|two|one|losses|result|step-6|the 1-GPU|moe|gptoss|0|1|  )" "$log" | tail -25; done
  for t in $(find "$DIR" -name table.md -path '*bench*'); do [ -e "$t" ] && { echo "== $t"; cat "$t"; }; done
  [ -n "${OUT:-}" ] && tar czf "$OUT/i36.tgz" --exclude='*.safetensors' --exclude='*.pt' --exclude='*.bin' \
    --exclude='*.distcp' --exclude=merged --exclude='*-runs' --exclude=two-then-one \
    --exclude=two-then-two "$DIR" 2>/dev/null
  [ -e "$DIR/ALL_DONE" ] && echo ALL_DONE; exit 0
fi
OUT=${1:-/tmp/i36}; shift; SETS=${*:-scale plan70 nccl resume}; mkdir -p "$OUT"
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True NCCL_NVLS_ENABLE=0
if [ "$SETS" = x4c ]; then
  snap=/tmp/i36-tree; rm -rf "$snap"; mkdir -p "$snap"; tar cf - --exclude=./.carry . | tar xf - -C "$snap"
  ln -s "$PWD/.carry" "$snap/.carry"; cd "$snap" || exit 1
  bash benchmarks/gpu_setup.sh; mkdir -p "$OUT/a" "$OUT/b"; export NB_TIMEOUT=${NB_TIMEOUT:-420}
  ( export CUDA_VISIBLE_DEVICES=0,1 KIT_HOME=/tmp/kit_home_a
    bash benchmarks/gpu_notebooks.sh "$OUT/a/notebooks" 2 05 primer 06 07 08 ) > "$OUT/a/all.log" 2>&1 &
  ( export CUDA_VISIBLE_DEVICES=2,3 KIT_HOME=/tmp/kit_home_b
    NPROC=2 bash benchmarks/gpu_sft_check.sh "$OUT/b/sft" /tmp/i36-sft-runs; echo "sft rc=$?"
    bash benchmarks/gpu_notebooks.sh "$OUT/b/notebooks" 2 09 10 11
    for _ in $(seq 60); do [ -e .carry/smollm2-2/part ] && break; sleep 10; done
    bash benchmarks/gpu_notebooks.sh "$OUT/b/nb12" 2 12 ) > "$OUT/b/all.log" 2>&1 &
  wait; SETS="moe4"
fi
if [ "$SETS" = x4 ]; then  # three lanes on a 4-GPU machine; the wheels installed once, first
  bash benchmarks/gpu_setup.sh; mkdir -p "$OUT/a" "$OUT/b"
  CUDA_VISIBLE_DEVICES=0,1 KIT_HOME=/tmp/kit_home_a bash "$0" "$OUT/a" gptoss nccl > "$OUT/a/all.log" 2>&1 &
  CUDA_VISIBLE_DEVICES=2,3 KIT_HOME=/tmp/kit_home_b bash "$0" "$OUT/b" resume notebooks > "$OUT/b/all.log" 2>&1 &
  wait; SETS="moe4 scale4"
fi
for SET in $SETS; do
  start=$(date +%s); echo "== set $SET"
  case $SET in
    scale) MATRIX=benchmarks/matrices/bench-8b-2gpu-planned.yaml SKIP_EXTRAS=1 \
             bash benchmarks/gpu_speed.sh "$OUT/scale" ;;
    plan70) MATRIX=benchmarks/matrices/bench-70b-2gpu-planned.yaml SKIP_EXTRAS=1 \
             bash benchmarks/gpu_speed.sh "$OUT/plan70" ;;
    nccl) NPROC=2 bash benchmarks/gpu_sft_check.sh "$OUT/nccl/sft" /tmp/i36-sft-runs; echo "sft rc=$?"
          bash benchmarks/gpu_nodes_check.sh "$OUT/nccl/nodes" /tmp/i36-nodes-runs; echo "nodes rc=$?" ;;
    resume) bash benchmarks/gpu_resume_world.sh "$OUT/resume"; echo "resume rc=$?" ;;
    moe) bash benchmarks/gpu_setup.sh; M=benchmarks/matrices/bench-moe-planned.yaml
         export KIT_HOME=${KIT_HOME:-/tmp/kit_home} TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
         mkdir -p "$OUT/moe"; torchrun --standalone --nproc_per_node=2 -m kit.train kit/configs/tiny-cpu.yaml \
           model.name=kit:tiny-qwen3-moe training.device=cuda training.steps=4 run.name=moe-smoke \
           > "$OUT/moe/smoke.log" 2>&1; echo "moe smoke rc=$?"
         for a in "1 24 lora.r=4" "1 80 lora.r=16" "2 24 lora.r=16"; do set -- $a
           python3 -m kit plan kit/configs/llama-1b-gpu.yaml model.name=kit:qwen3-30b-a3b data.max_seq_len=2048 \
             training.batch_size=auto $3 --gpus $1 --gpu-mem $2 --gpu H100 > "$OUT/moe/plan-$1x$2.txt" 2>&1; done
         # the two one-GPU cases side by side, one GPU each; then the two-GPU case
         CUDA_VISIBLE_DEVICES=0 python3 -m kit.bench $M --out "$OUT/moe/b24" --only moe-24-1gpu > "$OUT/moe/b24.log" 2>&1 &
         CUDA_VISIBLE_DEVICES=1 python3 -m kit.bench $M --out "$OUT/moe/b80" --only moe-80-1gpu > "$OUT/moe/b80.log" 2>&1
         wait; python3 -m kit.bench $M --out "$OUT/moe/b2" --only moe-24-2gpu > "$OUT/moe/b2.log" 2>&1
         echo "moe rc=$?"; tail -n 4 "$OUT"/moe/b*.log ;;
    gptoss) bash benchmarks/gpu_setup.sh; M=benchmarks/matrices/bench-gpt-oss-planned.yaml  # issue 33
         export KIT_HOME=${KIT_HOME:-/tmp/kit_home} TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
         mkdir -p "$OUT/gptoss"; torchrun --standalone --nproc_per_node=1 -m kit.train kit/configs/tiny-cpu.yaml \
           model.name=kit:tiny-gpt-oss training.device=cuda training.steps=4 run.name=gptoss-smoke \
           > "$OUT/gptoss/smoke.log" 2>&1; echo "gptoss smoke rc=$?"
         two=$(( $(nvidia-smi -L | wc -l) >= 2 ))  # side by side on two GPUs, else one after the other
         CUDA_VISIBLE_DEVICES=0 python3 -m kit.bench $M --out "$OUT/gptoss/b24" --only gptoss-24 > "$OUT/gptoss/b24.log" 2>&1 &
         [ $two = 1 ] || wait
         CUDA_VISIBLE_DEVICES=$two python3 -m kit.bench $M --out "$OUT/gptoss/b80" --only gptoss-80 > "$OUT/gptoss/b80.log" 2>&1
         wait; echo "gptoss done"; tail -n 4 "$OUT"/gptoss/b*.log ;;
    moe4) export KIT_HOME=${KIT_HOME:-/tmp/kit_home} TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
         M=benchmarks/matrices/bench-moe-235b-4gpu.yaml; mkdir -p "$OUT/moe4"
         python3 -m kit plan kit/configs/llama-1b-gpu.yaml model.name=kit:qwen3-235b-a22b data.max_seq_len=1024 \
           training.batch_size=2 --gpus 4 --gpu-mem 80 --gpu H100 > "$OUT/moe4/plan.txt" 2>&1
         python3 -m kit.bench $M --out "$OUT/moe4/b" > "$OUT/moe4/b.log" 2>&1; echo "moe4 rc=$?"; tail -n 4 "$OUT/moe4/b.log" ;;
    scale4) MATRIX=benchmarks/matrices/bench-8b-4gpu-planned.yaml SKIP_EXTRAS=1 \
             bash benchmarks/gpu_speed.sh "$OUT/scale4" ;;
    notebooks) for _ in $(seq 60); do [ -e .carry/smollm2-2/part ] && break; sleep 10; done
               bash benchmarks/gpu_notebooks.sh "$OUT/notebooks" 2 00 01 02 03 04 05 06 07 08 09 10 11 12 ;;
    *) echo "SET: $SET is not allowed; expected scale, plan70, nccl, resume, moe, gptoss, notebooks, moe4, scale4, x4 or x4c"; exit 2 ;;
  esac
  echo "set $SET: $(( $(date +%s) - start ))s"; touch "$OUT/$SET.DONE"
done
touch "$OUT/ALL_DONE"
