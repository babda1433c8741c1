"""The planner's step model: the tokens/s a plan's step runs at per GPU (`speed`), from the
model's shape, the tokens a micro-step, the recompute policy and the machine's peak; each
constant with the measured runs it was fitted to. kit.budget.plan ranks every candidate plan by it
and prints its figure; kit.bench divides by PEAK_BF16_FLOPS for MFU. Kernel side, no torch.
"""

from __future__ import annotations

from typing import Protocol

from kit.budget.shapes import Shape, flops_per_token


class Peaked(Protocol):
    """What the step model reads of the machine (kit.budget.fit.Hardware): its GPU's dense bf16
    peak, None where unknown."""

    @property
    def peak_flops(self) -> float | None: ...

# The step model (`speed`), fitted to the kit's bf16 runs on one H100 at the Llama-3-8B shape,
# sequence 2,048, grouped adapters, compiled layers, fused loss (fitted to
# benchmarks/records/2026-11-25-planned-defaults-1xh100/rows-calib.jsonl; the runs:
# 2026-11-24-grouped-adapters-8b-1xh100):
# - KNEE_TOKENS: a micro-step of n tokens runs at n^2 / (n^2 + KNEE^2) of the ideal rate (the
#   optimizer, FSDP's gathers, dequantizing each 4-bit weight and launches are spread over fewer
#   tokens): keeping every matmul, batch 4 ran at 0.93x batch 8's speed per token (12,739 against
#   13,503), which gives ~2,350.
# - RERUN_COST: the step's extra time per unit of a layer's forward matmul work run again in
#   backward: keeping attention's matmuls (gate and up, 54% of the 8B layer's matmul work, run
#   twice) cost 1.16x keeping every matmul: 0.30.
# - INPUTS_EXTRA: whole-layer recompute also reruns attention, the norms and the dequantization:
#   it cost 1.35x keeping every matmul at batch 8 and 14 alike, 0.045 beyond its matmuls.
# - PEAK_SHARE: the ideal rate, as a share of the GPU's dense bf16 peak: keeping every matmul at
#   batch 9, 13,824 tokens/s at 31.6 GFLOP per token over 0.984 of the ideal: 0.45. The 8B's
#   kernels have grown faster since: on one H200 its 24 GiB plan (batch 2, the C++ wrapper) is
#   predicted 12,599 and ran 14,852-15,281 (benchmarks/records/2026-11-30-split-gather-2xh200),
#   its 78 GiB plan 16,370 (52.3% MFU); Qwen2.5-32B's shape is predicted within 3-7% (below),
#   so one share for both no longer fits: a refit wants the 8B's and the 32B's rows of one machine.
# - MATMUL_LAYER_SHARE: a layer that keeps every matmul beside attention_matmuls' layers saves
#   this share of its rerun: 10 of 32 layers ran 1.022x faster (11,864 against 11,608 tokens/s
#   at 24 GiB, benchmarks/records/2026-11-27-layers-24gib-8b-1xh100) where the whole rerun gave
#   1.046x: 0.5.
# - ATTENTION_TILES_SPEED: attention tiles (with the MLP's, offloaded inputs and whole-layer
#   recompute) on their own kernels (kit.recipe.levers.tile_kernels: cuDNN's attention, backward from the
#   recompute's kept statistics) ran at 0.86-0.90 of the model's rate at 131,072, 163,840 and
#   524,288 tokens (2026-11-27-tile-kernels-context-512k-8b-1xh100); through SDPA with a third
#   forward they had run at 0.52-0.53 (2026-11-27-attention-tiles-context-8b-1xh100,
#   2026-11-27-lean-norms-context-24gib-8b-1xh100). MLP tiles alone ran at 0.73-0.90 of it (32k
#   to 128k), as offloading alone did (0.78-0.84): not counted. Every tiled run was offloaded,
#   so 0.88 held OFFLOAD_SPEED's share too; since that is counted on its own (below), the tiles'
#   own share is 0.88 / 0.95: 0.93 (predicted 2,196 against 2,148 tokens/s measured at 131,072
#   tokens in 24 GiB, 661 against 670 at 524,288 in 78 GiB; 0.88 beside OFFLOAD_SPEED had put
#   them 3-7% under).
# A mixture of experts on the grouped path (kit.recipe.grouped_experts: one grouped GEMM per
# projection, Hopper on, compiled layers) runs at its own share of the peak, and its knee is in the
# rows each expert gets per step, r = tokens x top-k / experts, not in the step's tokens: a step
# takes a fixed time (each layer's stacks dequantized, the optimizer, launches) plus a time per
# row, so its rate is r / (r + KNEE) of the ideal (the recompute costs as above). Fitted to the
# kit's runs of Qwen3-30B-A3B's shape on one H200 (128 experts, top-8):
# - MOE_PEAK_SHARE: keeping every matmul at batch 14 (24 layers, 1,792 rows an expert), 24.0% MFU
#   (29,982 tokens/s, benchmarks/records/2026-11-29-moe-vs-unsloth-1xh200), over its knee: 0.273.
# - MOE_KNEE_ROWS: the full depth at batch 6 (768 rows) ran 18.9% MFU
#   (benchmarks/records/2026-11-29-moe-compile-1xh200, with the dropout masks drawn and gathered,
#   which cost the 24-layer run ~8% at 24 GiB against the hash since): ~250. The full depth at
#   batch 6 is predicted 8.7% over what it measured. (The dense model's knee, quadratic in the
#   tokens, would put a 512-token MoE step at ~10 tokens/s; this one at ~1,500.)
# - MOE_RERUN_COST: a layer run again costs a mixture of experts less than a dense model
#   (RERUN_COST): its forward is a smaller share of its step. Whole-layer recompute against keeping
#   every matmul, beyond the knee, measured 1.19x the step on both models measured
#   (benchmarks/records/2026-11-29-moe-scaling-gpt-oss-2xh200: Qwen3-30B-A3B at 24 layers, batch
#   10 against 15; gpt-oss-20b, batch 5 against 12): 0.145 + INPUTS_EXTRA. Predicted against
#   measured there: Qwen3-30B-A3B 0.99 (24 and 80 GiB), 1.05 on two GPUs; gpt-oss-20b 0.85 at
#   both caps (its wider experts, 2,880 against 768, run at a larger share of the peak).
# - KNEE_TOKENS_CPP: the knee where inductor's C++ wrapper launches the compiled layers' kernels
#   (training.compile_wrapper=cpp): the host's share of a step is smaller, so small batches run
#   closer to the ideal rate. On one H200 in one invocation a cap, batch 2 keeping every matmul
#   ran 14,023 tokens/s at 24 GiB and batch 10 keeping every matmul 15,682 at 78 GiB
#   (benchmarks/records/2026-11-30-cpp-default-1xh200): n = 4,096 at 0.894 of n = 20,480, ~1,400
#   (the first fit, 1,600, took batch 10 with the Python wrapper of another session as the rate).
# - CPP_COMPILE_S: how much longer the first step takes with inductor's C++ wrapper (the host
#   compiles the generated C++ once): 66.3 against 19.6 s at 24 GiB and 75.2 against 18.4 s at
#   78 GiB, the 8B shape on one H200 (benchmarks/records/2026-11-30-cpp-default-1xh200): ~50.
#   `_cpp_pays` weighs it against what the wrapper saves over the run's steps.
# - KNEE_LAYER_PARAMS: the knees above are the 8B shape's (218M linear parameters a layer); a
#   layer of W parameters takes the GPU W / 218M as long for the same launches from the host, so
#   its knees are that much nearer zero. Qwen2.5-32B's shape (488M a layer) at 24 GiB on one H200,
#   the C++ wrapper, offloaded layer inputs: batches 1, 2, 3 ran 2,245, 2,528, 2,651 tokens/s,
#   predicted 2,295, 2,450, 2,483; the Python wrapper at batch 1 2,027 (before the offloaded
#   inputs were prefetched), predicted 1,986 (benchmarks/records/2026-11-30-dense-32b-1xh200).
#   Unscaled, the knees had predicted 1,082 at batch 1.
# - OFFLOAD_SPEED: whole layers with their inputs offloaded to host memory (prefetched on a side
#   stream) against the same plan in GPU memory: Qwen2.5-32B's shape at 24 GiB on one H200, batch
#   1, the C++ wrapper, one invocation: 2,052 against 2,155 tokens/s, 0.952; batches 2 and 3
#   offloaded ran 2,477 and 2,603 (benchmarks/records/2026-11-30-headroom-32b-1xh200). A mixture
#   of experts offloaded at batch 16 ran 0.99x its batch 12 in GPU memory
#   (2026-11-30-dense-32b-1xh200).
CPP_COMPILE_S = 50
OFFLOAD_SPEED = 0.95
KNEE_LAYER_PARAMS = 218_103_808
KNEE_TOKENS = 2350
KNEE_TOKENS_CPP = 1400
MOE_PEAK_SHARE = 0.273
MOE_KNEE_ROWS = 250
MOE_RERUN_COST = 0.145
MATMUL_LAYER_SHARE = 0.5
RERUN_COST = 0.30
INPUTS_EXTRA = 0.045
PEAK_SHARE = 0.45
ATTENTION_TILES_SPEED = 0.93
# Dense bf16 tensor-core peak from the vendors' data sheets, by device name (first match): the
# step model's scale here, MFU's denominator in kit.bench.
PEAK_BF16_FLOPS = {"H100": 989e12, "H200": 989e12, "B200": 2250e12, "A100": 312e12,
                   "L40S": 362e12, "RTX 4090": 165e12}


def rerun_share(shape: Shape, keeps: str) -> float:
    """The share of a decoder layer's forward matmul work that `keeps` runs again in backward."""
    lin = {n: a * b for n, (a, b) in shape.linears().items()}
    lin.update({n: shape.active_experts * a * b for n, (a, b) in shape.expert_stacks().items()})
    total = sum(lin.values())
    widest = sum(lin.get(n, 0) for n in ("gate_proj", "up_proj", "gate_up_proj"))  # MLP's inputs
    again = {"matmuls": 0, "inputs": total, "mlp_matmuls": total - widest,
             "attention_matmuls": widest}[keeps]
    return again / total


def speed(shape: Shape, seq_len: int, batch: int, keeps: str | None, hw: Peaked,
          matmul_layers: int = 0, attention_tiles: bool = False, wrapper: str = "python",
          offloaded: bool = False) -> float:
    """Tokens/s per GPU the step model predicts (relative when the GPU's peak is unknown): a
    micro-step of n tokens runs at n^2 / (n^2 + KNEE_TOKENS^2) of the ideal rate (a mixture of
    experts: r / (r + MOE_KNEE_ROWS) for the r rows each expert gets, at MOE_PEAK_SHARE), slowed
    by what the recompute policy runs twice (in all layers but the `matmul_layers` that keep every
    matmul), and by attention tiles (ATTENTION_TILES_SPEED). A dense model's layers launched by
    inductor's C++ wrapper (`wrapper`, training.compile_wrapper) have the knee KNEE_TOKENS_CPP;
    layers whose inputs wait in host memory (`offloaded`) run at OFFLOAD_SPEED."""
    n = batch * seq_len
    cost = 1.0
    if keeps is not None:  # recompute on
        lean = 1 - MATMUL_LAYER_SHARE * min(matmul_layers, shape.layers) / shape.layers
        rerun = MOE_RERUN_COST if shape.experts else RERUN_COST
        cost += (rerun * rerun_share(shape, keeps) * lean
                 + (INPUTS_EXTRA if keeps == "inputs" else 0))
    if shape.experts:  # grouped experts: the rows each expert gets, their own share of the peak
        rows = n * shape.active_experts / shape.experts
        knee, share = rows / (rows + MOE_KNEE_ROWS), MOE_PEAK_SHARE
    else:  # the host's time per layer is the 8B shape's; the GPU's grows with the layer
        k = ((KNEE_TOKENS_CPP if wrapper == "cpp" else KNEE_TOKENS)
             * KNEE_LAYER_PARAMS * shape.layers / shape.active_linear_params)
        knee, share = n * n / (n * n + k**2), PEAK_SHARE
    rate = (knee / cost * (ATTENTION_TILES_SPEED if attention_tiles else 1)
            * (OFFLOAD_SPEED if offloaded else 1))
    peak = hw.peak_flops
    return rate * share * peak / flops_per_token(shape, seq_len) if peak else rate
