#!/usr/bin/env bash
# Issue 55, item 1 (grouped experts), on one Hopper GPU, with the carried .whl/gpu (bitsandbytes,
# pytest; benchmarks/fetch_gpu_wheels.sh). Each set writes into $OUT as it goes (safe detached:
# `(setsid nohup bash benchmarks/gpu_moe_grouped.sh /tmp/g > /tmp/g.log 2>&1 < /dev/null &)`):
#   tests: the GPU-marked grouped-experts tests (torch._grouped_mm against the fallback loop)
#   layer: one Qwen3-30B-A3B-shaped MoE layer (hidden 2048, 128 experts, top-8, moe intermediate
#          768, bf16, 16,384 tokens, NF4 stacks, LoRA r16 fp32 on both stacks, dropout 0.05),
#          forward + backward: grouped, the per-expert loop, and the bf16 stack without LoRA
#   bench: kit:qwen3-30b-a3b (48 layers, initialised at load) through kit.bench, kit defaults
#          (batch planned) at an 80 GiB cap, 1 warm-up + 9 measured steps: tokens/s, MFU; the
#          weights streamed in as the earlier records did (model.loading=stream), and the
#          distributed timeout the kit asks for a 61 GB model (run.dist_timeout_min=31)
#   profile: as bench, with one profiled step after the measured ones (GPU time per kernel family)
#   policies: as profile, three cases of one matrix (issue 55's next levers): the plan's own choice
#          (recompute keeping the grouped GEMMs now), keeps=inputs at batch 24 (whole-layer
#          recompute: more GPU work, no selective policy in Python per op, a larger batch over the
#          same host time), and keeps=mlp_matmuls with the batch planned for it
#   host: the plan's own case, 1 warm-up + 3 measured steps and one profiled step, for where the
#          host's time goes (the profile row's `host`: launches, waits on the GPU, ops' CPU time)
#   bash benchmarks/gpu_moe_grouped.sh "$OUT" [tests] [layer] [bench] [profile] [policies] [host]
set -uo pipefail
OUT=${1:-/tmp/moe-grouped}; shift || true
SETS=${*:-tests layer bench}
mkdir -p "$OUT"
# shellcheck source=benchmarks/gpu_env.sh
source benchmarks/gpu_env.sh
python3 -m pip install -q --no-index --no-deps --find-links .whl/gpu pytest iniconfig pluggy \
  2>&1 | grep -v WARNING

if [[ " $SETS " == *" tests "* ]]; then
  python3 -m pytest -q -m gpu tests/test_grouped_experts.py -p no:cacheprovider -rs \
    > "$OUT/pytest-gpu.log" 2>&1
  echo "pytest -m gpu tests/test_grouped_experts.py rc=$? $(tail -1 "$OUT/pytest-gpu.log")"
fi

if [[ " $SETS " == *" layer "* ]]; then
  python3 - > "$OUT/layer.jsonl" 2> "$OUT/layer.log" <<'EOF'
import json
import torch
from transformers import AutoConfig
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts
from kit.recipe import experts

H, I, E, K, T, R = 2048, 768, 128, 8, 16384, 16
torch.manual_seed(0)
cfg = AutoConfig.for_model("qwen3_moe", hidden_size=H, moe_intermediate_size=I, num_experts=E,
                           num_experts_per_tok=K)


def module(quantized):
    ex = Qwen3MoeExperts(cfg).to("cuda", torch.bfloat16)
    for p in ex.parameters():
        torch.nn.init.normal_(p, std=0.02)
        p.requires_grad_(False)
    if quantized:
        kw = dict(blocksize=64, compress_statistics=True, quant_type="nf4",
                  quant_storage=torch.bfloat16)
        for name in experts.weight_names(ex):
            experts.quantize_weight(ex, name, ex._parameters[name].data, kw)
    return ex


def lora_for(ex):  # PEFT's ParamWrapper layout, fp32 as the kit keeps adapters; alpha 32 / r 16
    out = {}
    for name, (o, i) in {"gate_up_proj": (2 * I, H), "down_proj": (H, I)}.items():
        a = (torch.randn(E * R, i, device="cuda") * 0.01).requires_grad_()
        b = (torch.randn(o, R * E, device="cuda") * 0.01).requires_grad_()
        out[name] = [(a, b, 2.0, 0.05)]
    return out


x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16, requires_grad=True)
index = torch.rand(T, E, device="cuda").topk(K).indices
weights = torch.rand(T, K, device="cuda", dtype=torch.bfloat16).softmax(-1).requires_grad_()
grad = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)
rows = T * K
base = 2 * rows * (H * 2 * I + I * H)  # one forward of both projections
lora = 2 * rows * R * ((H + 2 * I) + (I + H))
cases = {
    "grouped, NF4 + LoRA (kit default)": (experts.forward, module(True), True, 2 * base + 3 * lora),
    "per-expert loop, NF4 + LoRA (before)": (experts.loop_forward, module(True), True,
                                            2 * base + 3 * lora),
    "grouped, bf16 stack, no LoRA (GEMM ceiling)": (experts.forward, module(False), False, 2 * base),
}
for label, (fn, ex, with_lora, flops) in cases.items():
    factors = lora_for(ex) if with_lora else {}
    def step():
        out = fn(ex, x, index, weights, lora=factors)
        out.backward(grad)
    iters = 2 if "loop" in label else 10
    for _ in range(2):
        step()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        step()
    end.record()
    torch.cuda.synchronize()
    ms = start.elapsed_time(end) / iters
    print(json.dumps({"case": label, "tokens": T, "ms": round(ms, 2), "flops": flops,
                      "tflops": round(flops / ms / 1e9, 1),
                      "convention_6N_tflops": round(3 * base / ms / 1e9, 1),
                      "peak_extra_gib": round((torch.cuda.max_memory_allocated() - before) / 2**30, 2),
                      "device": torch.cuda.get_device_name()}), flush=True)
    del ex
EOF
  echo "layer rc=$?"; cat "$OUT/layer.jsonl"; tail -3 "$OUT/layer.log"
fi

for set in bench profile policies host; do
  [[ " $SETS " == *" $set "* ]] || continue
  if [[ $set == host ]]; then cat > "$OUT/matrix.yaml" <<'EOF'
# Qwen3-30B-A3B's shape, the plan's own choice at 80 GiB, a short run and one profiled step.
model: kit:qwen3-30b-a3b
seq_len: 2048
nproc: 1
device: cuda
lr: 1.0e-3
warmup_steps: 1
measure_steps: 3
cases:
  - {name: moe-80-host, recipe: kit, role: kit, cap_gib: 80, batches: [auto], timeout_s: 150,
     profile: true, label: "kit, planned, host profile",
     overrides: [run.dist_timeout_min=31, model.loading=stream]}
EOF
  elif [[ $set == policies ]]; then cat > "$OUT/matrix.yaml" <<'EOF'
# Qwen3-30B-A3B's shape at an 80 GiB cap: what the recompute policy keeps against the batch it
# leaves room for, each case with one profiled step (GPU busy against the step's wall time).
model: kit:qwen3-30b-a3b
seq_len: 2048
nproc: 1
device: cuda
lr: 1.0e-3
warmup_steps: 1
measure_steps: 9
cases:
  - {name: moe-80-planned, recipe: kit, role: kit, cap_gib: 80, batches: [auto], timeout_s: 200,
     profile: true, label: "kit, planned, grouped GEMMs kept by the recompute policy",
     overrides: [run.dist_timeout_min=31, model.loading=stream]}
  - {name: moe-80-inputs-b24, recipe: kit, role: kit, cap_gib: 80, batches: [24], timeout_s: 240,
     profile: true, label: "kit, whole-layer recompute (keeps=inputs), batch 24",
     overrides: [run.dist_timeout_min=31, model.loading=stream, training.recompute.keeps=inputs]}
  - {name: moe-80-mlp, recipe: kit, role: kit, cap_gib: 80, batches: [auto], timeout_s: 200,
     profile: true, label: "kit, keeps=mlp_matmuls, planned batch",
     overrides: [run.dist_timeout_min=31, model.loading=stream,
                 training.recompute.keeps=mlp_matmuls]}
EOF
  elif [[ $set == bench ]]; then cat > "$OUT/matrix.yaml" <<'EOF'
# Qwen3-30B-A3B's shape, grouped experts (issue 55 item 1), kit defaults, planned batch.
model: kit:qwen3-30b-a3b
seq_len: 2048
nproc: 1
device: cuda
lr: 1.0e-3
warmup_steps: 1
measure_steps: 9
cases:
  - {name: moe-80-grouped, recipe: kit, role: kit, cap_gib: 80, batches: [auto], timeout_s: 280,
     label: "kit, planned, one GPU, grouped experts",
     overrides: [run.dist_timeout_min=31, model.loading=stream]}
EOF
  else cat > "$OUT/matrix.yaml" <<'EOF'
# As bench, one profiled step after the measured ones. (Recompute off is refused by today's
# planner at batch 5: it predicts 143 GiB, issue 55 item 3.)
model: kit:qwen3-30b-a3b
seq_len: 2048
nproc: 1
device: cuda
lr: 1.0e-3
warmup_steps: 1
measure_steps: 9
cases:
  - {name: moe-80-profile, recipe: kit, role: kit, cap_gib: 80, batches: [auto], timeout_s: 240,
     profile: true, label: "kit, planned, one GPU, grouped experts, profiled",
     overrides: [run.dist_timeout_min=31, model.loading=stream]}
EOF
  fi
  b=/tmp/moe-grouped-$set; rm -rf "$b"
  timeout "$([[ $set == policies ]] && echo 560 || echo 480)" \
    python3 -m kit.bench "$OUT/matrix.yaml" --out "$b" > "$OUT/$set.log" 2>&1
  echo "$set rc=$?"
  cp "$b/results.jsonl" "$OUT/$set-results.jsonl" 2>/dev/null
  tail -c 3000 "$b"/logs/*.log > "$OUT/$set-case-tail.log" 2>/dev/null
  python3 -c "
import json
for r in map(json.loads, open('$OUT/$set-results.jsonl')):
    if r.get('kind') in ('batch', 'setup'):
        print(r['case'], {k: r.get(k) for k in ('kind', 'batch', 'status', 'step_s',
              'tokens_per_s_gpu', 'mfu', 'peak_alloc_gib', 'loss_first', 'loss_last',
              'auto_batch')}, (r.get('plan') or {}).get('line'))
    if r.get('kind') == 'profile':
        print(r['case'], json.dumps({k: v for k, v in r.items() if k not in ('case', 'label')})[:3000])
" 2>&1 | tail -12
done
