#!/usr/bin/env bash
# Wait (at most $2 seconds) for a detached GPU job writing into $1 to touch $1/$3, printing the
# progress of the benchmark as it goes; then pack what exists into $OUT (device calls end at 10 min).
DIR=$1; LIMIT=${2:-540}; FLAG=${3:-DONE}; start=$(date +%s)
while [ ! -e "$DIR/$FLAG" ] && [ $(( $(date +%s) - start )) -lt "$LIMIT" ]; do sleep 10; done
grep -h "rc=\|^build\|^bench\|^all\|nb06\|ckpt" "$DIR"/../speed.log 2>/dev/null | tail -30
cat "$DIR/bench/table.md" 2>/dev/null
# One archive per polled folder: a second poll in the same device call (gpu_estimate.sh's two
# matrices) once replaced the first's archive, and the first matrix's last rows were lost.
[ -n "${OUT:-}" ] && tar czf "$OUT/speed-$(basename "$DIR").tgz" --exclude='*.safetensors' --exclude='*.pt' \
  --exclude='*.distcp' --exclude=merged --exclude=runs "$DIR" "$DIR/../speed.log" 2>/dev/null
ls "$DIR" "$DIR/bench/cases" 2>/dev/null | tr '\n' ' '
