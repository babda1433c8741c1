#!/usr/bin/env bash
# Issue 19's runs 2-4 on a machine with 2 GPUs (nvidia-h200-x2), one set per device call, each
# detached and polled (a call ends at 10 minutes; the machine stays warm ~30 s between calls):
#   mkdir -p /tmp/i19; (setsid nohup bash benchmarks/gpu_issue19.sh SET /tmp/i19 > /tmp/i19/speed.log 2>&1 < /dev/null &)
#   OUT=$OUT bash benchmarks/poll.sh /tmp/i19/SET 560 DONE          # again until DONE
# SET:
#   run2  kit.recipe.sft under accelerate with the generated FSDP2 and FSDP1 YAMLs on 2 processes
#         (gpu_sft_check.sh, NPROC=2), then run.sh as two nodes beside one node x 2
#         (gpu_nodes_check.sh); ~8 minutes; .whl carried
#   run3  notebooks 12 03 08 09 10 11 with GPU parameters on 2 processes (gpu_notebooks.sh);
#         ~15 minutes; SmolLM2 carried first (benchmarks/carry_smollm2.sh: two calls), then .whl
#   run4  benchmarks/matrices/bench-8b-2gpu-round3.yaml (gpu_speed.sh, the bench only); ~16
#         minutes; BENCH_NPROC=4 for the 4-GPU variant
#   run1x4  run 1 again with 4 shards (nvidia-h200-x4): bench-70b-2x24.yaml on 4 GPUs; ~8 minutes
# Results: /tmp/i19/SET/ (tables, logs, executed notebooks); poll.sh packs them into $OUT.
set -uo pipefail
SET=${1:?run2, run3, run4 or run1x4}; OUT=${2:-/tmp/i19}/$SET; mkdir -p "$OUT"
start=$(date +%s)
case $SET in
  run2) NPROC=2 bash benchmarks/gpu_sft_check.sh "$OUT/sft" /tmp/i19-sft-runs; echo "sft rc=$?"
        bash benchmarks/gpu_nodes_check.sh "$OUT/nodes" /tmp/i19-nodes-runs; echo "nodes rc=$?" ;;
  run3) bash benchmarks/gpu_notebooks.sh "$OUT" 2 12 03 08 09 10 11; echo "notebooks rc=$?" ;;
  run4) MATRIX=benchmarks/matrices/bench-8b-2gpu-round3.yaml SKIP_EXTRAS=1 \
          bash benchmarks/gpu_speed.sh "$OUT"; echo "bench rc=$?" ;;
  run1x4) MATRIX=benchmarks/matrices/bench-70b-2x24.yaml BENCH_NPROC=4 SKIP_EXTRAS=1 \
          bash benchmarks/gpu_speed.sh "$OUT"; echo "bench rc=$?" ;;
  *) echo "SET: $SET is not allowed; expected run2, run3, run4 or run1x4"; exit 2 ;;
esac
echo "$SET: $(( $(date +%s) - start ))s"
touch "$OUT/DONE"
