"""Measured peaks the memory estimator (kit.budget.estimate) is checked against, and the comparison.

    rows = compare_with_reference(REFERENCE_70B)   # measured vs estimated GiB, error in %

Each reference is one recorded run (its file named beside it): the model, the Setup fields that
describe it, and its peaks (torch.cuda.max_memory_allocated, GiB) by (recompute, batch) or
(recompute, batch, offload_activations). Kernel side: no torch.
"""

from __future__ import annotations

from dataclasses import replace

from kit.budget.estimate import Setup, estimate
from kit.budget.shapes import shape_of

# Measured peaks (torch.cuda.max_memory_allocated, GiB) of the reference a user would write
# (FINDINGS.md, 2x H200, 2026-11-22): Llama-3-8B shape, NF4 + double quant, bf16 storage,
# LoRA r16 all-linear in bf16, FSDP1 FULL_SHARD, sdpa, seq 2048, AdamW.
REFERENCE = {
    "model": "kit:llama-8b",
    "setup": dict(engine="fsdp1", world_size=2, lora_r=16, seq_len=2048, attention="sdpa"),
    # (recompute, batch_size) -> measured peak GiB
    "peak_gib": {
        (False, 1): 25.0, (False, 2): 45.1,
        (True, 1): 8.9, (True, 2): 12.9, (True, 4): 20.8, (True, 8): 36.6,
    },  # fmt: skip
}


# The kit's recipe on the 70B shape (Llama-2-70B's, no weights on disk: kit.recipe.loading.initialise),
# one H200, FSDP2 on one process, NF4, LoRA r16 all-linear (fp32), whole-layer recompute, fused
# loss, seq 2048 (benchmarks/records/2026-11-24-train-70b-1xh200, 2026-11-24): peak allocated GiB.
REFERENCE_70B = {
    "model": "kit:llama-70b",
    "setup": dict(engine="fsdp2", world_size=1, lora_r=16, seq_len=2048, attention="sdpa"),
    "peak_gib": {(True, 1): 41.3, (True, 2): 45.0, (True, 4): 52.4},
}


# The kit's recipe on the 8B shape, one H200, FSDP2 on one process (its embeddings a unit of
# their own), LoRA r16 all-linear (fp32), fused loss, seq 2048, with and without
# training.offload_activations (benchmarks/records/2026-11-24-offload-8b-1xh200, 2026-11-24).
# (recompute, batch, offload_activations) -> peak allocated GiB.
REFERENCE_KIT_8B = {
    "model": "kit:llama-8b",
    "setup": dict(engine="fsdp2", world_size=1, lora_r=16, seq_len=2048, attention="sdpa",
                  loss="fused"),
    "peak_gib": {(True, 2, False): 9.24, (True, 2, True): 8.62, (False, 1, False): 24.23,
                 (False, 1, True): 11.43},
}  # fmt: skip


# The kit's recipe at long context on one H100
# (benchmarks/records/2026-11-24-caps-context-8b-1xh100, 2026-11-24): Llama-3-8B shape, FSDP2 on one
# process, NF4, LoRA r16 all-linear (fp32), batch 1, whole-layer recompute with the layer inputs
# offloaded, fused loss; peaks by (sequence length, training.recompute.mlp_tile_tokens).
REFERENCE_CONTEXT = {
    "model": "kit:llama-8b",
    "keys": ("seq_len", "mlp_tile_tokens"),
    "setup": dict(engine="fsdp2", world_size=1, lora_r=16, attention="sdpa", loss="fused",
                  batch_size=1, recompute=True, offload_activations=True),
    "peak_gib": {(16384, 0): 12.56, (32768, 0): 17.54, (32768, 8192): 13.23,
                 (65536, 8192): 19.38, (131072, 8192): 31.68},
}  # fmt: skip

# The same with each attention block 8,192 queries at a time too (training.recompute.
# attention_tile_tokens), the MLP in 8k tiles, adapters ungrouped, within a 24 GiB cap, by (sequence
# length, attention tiles, training.recompute.lean_norms): the eager norms' rows
# (benchmarks/records/2026-11-27-attention-tiles-context-8b-1xh100, 2026-11-27) ran out of memory at
# 131,072; the lean norms' (2026-11-27-lean-norms-context-24gib-8b-1xh100) trained 131,072 and
# 163,840, and measured the same peaks to 0.01 GiB with the tiles' own kernels
# (kit.recipe.levers.tile_kernels, 2026-11-27-tile-kernels-context-512k-8b-1xh100), which trained 524,288
# within a 78 GiB cap (planned, no lever set).
REFERENCE_CONTEXT_TILES = {
    "model": "kit:llama-8b",
    "keys": ("seq_len", "attention_tile_tokens", "lean_norms"),
    "setup": dict(REFERENCE_CONTEXT["setup"], mlp_tile_tokens=8192),
    "peak_gib": {(98304, 8192, False): 19.88, (114688, 8192, False): 22.01,
                 (131072, 8192, True): 19.89, (163840, 8192, True): 23.15,
                 (524288, 8192, True): 58.74},
}  # fmt: skip

# The kit's fastest cases on one H100 (benchmarks/records/2026-11-24-grouped-adapters-8b-1xh100,
# 2026-11-24): Llama-3-8B shape, FSDP2 on one process, compiled layers, fused loss, LoRA r16
# all-linear with dropout; peaks by (training.recompute.keeps, batch, lora.group_inputs). FP8 base
# matmuls (not a Setup field) measured 0.7 GiB above these with attention's matmuls and 0.5 with
# every one. The rows with a fourth key are 2026-11-26's
# (benchmarks/records/2026-11-27-layers-24gib-8b-1xh100): training.recompute.matmul_layers, the
# first N layers keeping every matmul; batch 10 is the planned run at 80 GiB
# (2026-11-25-planned-defaults-1xh100).
REFERENCE_SELECTIVE = {
    "model": "kit:llama-8b",
    "keys": ("recompute_keeps", "batch_size", "lora_groups", "matmul_layers"),
    "setup": dict(engine="fsdp2", world_size=1, lora_r=16, seq_len=2048, attention="sdpa",
                  loss="fused", recompute=True),
    "peak_gib": {("attention_matmuls", 5, False): 21.53, ("attention_matmuls", 5, True): 21.53,
                 ("matmuls", 4, False): 32.04, ("matmuls", 4, True): 32.04,
                 ("matmuls", 8, False): 57.16, ("matmuls", 8, True): 57.16,
                 ("matmuls", 10, True): 69.72,
                 ("attention_matmuls", 4, True, 0): 18.61, ("attention_matmuls", 4, True, 8): 22.11,
                 ("attention_matmuls", 4, True, 10): 22.98},
}  # fmt: skip

# The kit's plans on one H200 since FSDP2 on one rank leaves the frozen weights alone
# (kit.recipe.engines.frozen_of; Setup.frozen_gathered False, as Setup.from_config says for one
# rank): Llama-3-8B shape, compiled layers (the C++ wrapper), fused loss, grouped adapters with
# dropout; peaks by (training.recompute.keeps, batch, training.recompute.matmul_layers).
# benchmarks/records/2026-11-30-cpp-default-1xh200 (the plans at 24 and 78 GiB, call 1; the rows
# with layers keeping every matmul and batch 6, call 2, ran with the fused loss's chunks compiled,
# which moved batch 2's peak by +0.16 GiB) and 2026-11-30-host-overhead-1xh200 (batch 5).
REFERENCE_ONE_RANK = {
    "model": "kit:llama-8b",
    "keys": ("recompute_keeps", "batch_size", "matmul_layers"),
    "setup": dict(engine="fsdp2", world_size=1, lora_r=16, seq_len=2048, attention="sdpa",
                  loss="fused", recompute=True, lora_groups=True, frozen_gathered=False),
    "peak_gib": {("matmuls", 2, 0): 18.26, ("attention_matmuls", 5, 0): 19.28,
                 ("matmuls", 10, 0): 67.26, ("attention_matmuls", 3, 24): 21.78,
                 ("attention_matmuls", 3, 28): 23.09, ("attention_matmuls", 4, 12): 21.84,
                 ("attention_matmuls", 6, 0): 21.96},
}  # fmt: skip

# Qwen2.5-7B's shape at 24 GiB on one H100 (benchmarks/records/2026-11-27-layers-24gib-8b-1xh100):
# the one shape the estimate counts below its measured peak (6-7%), by ~0.3 GiB per added sequence;
# the planner's headroom (5% and OUTSIDE_GIB) still covers it.
REFERENCE_QWEN2_SELECTIVE = {
    "model": "kit:qwen2-7b",
    "keys": ("batch_size",),
    "setup": dict(engine="fsdp2", world_size=1, lora_r=16, seq_len=2048, attention="sdpa",
                  loss="fused", recompute=True, recompute_keeps="attention_matmuls",
                  lora_groups=True),
    "peak_gib": {(5,): 19.28, (6,): 21.78},
}  # fmt: skip

# Qwen3-30B-A3B's shape at 24 of its 48 layers from a folder of one tensor per expert
# (benchmarks/tools/moe_checkpoint.py), the kit's plans at 24 GiB on one H200: grouped experts on
# the grouped GEMM, whole layers recomputed, fused loss and adapters' kernels; peaks (allocated,
# and reserved: what a cap must hold) by (batch, dropout on).
# benchmarks/records/2026-12-01-host-step-moe-batch-1xh200.
REFERENCE_MOE_RECOMPUTED = {
    "model": "kit:qwen3-30b-a3b",
    "layers": 24,
    "keys": ("batch_size", "lora_dropout"),
    "setup": dict(engine="fsdp2", world_size=1, lora_r=16, seq_len=2048, attention="sdpa",
                  loss="fused", recompute=True, recompute_keeps="inputs", frozen_gathered=False,
                  grouped_gemm=True),
    "peak_gib": {(13, True): 20.84, (14, True): 21.43, (15, False): 22.02},
    "reserved_gib": {(13, True): 22.84, (14, True): 23.56, (15, False): 23.62},
}  # fmt: skip

# A reference's keys name Setup fields; the table calls the first two as notebook 01 shows them.
KEYS = ("recompute", "batch_size", "offload_activations")
COLUMNS = {"recompute": "checkpointing", "batch_size": "batch"}


def compare_with_reference(reference: dict = REFERENCE) -> list[dict]:
    """Estimate vs measured for every row of a reference (REFERENCE, REFERENCE_70B,
    REFERENCE_KIT_8B, REFERENCE_CONTEXT, REFERENCE_SELECTIVE, REFERENCE_ONE_RANK,
    REFERENCE_QWEN2_SELECTIVE, REFERENCE_MOE_RECOMPUTED): each key gives the Setup fields its
    reference's `keys` name (by default recompute, batch, offload_activations; a shorter key
    leaves the rest); `layers`, where a reference has it, cuts the model's shape to that many."""
    rows, model = [], reference["model"]
    if "layers" in reference:  # the shape at fewer layers (a model cut for one GPU)
        model = replace(shape_of(model), layers=reference["layers"])
    for key, measured in reference["peak_gib"].items():
        changes = dict(zip(reference.get("keys", KEYS), key, strict=False))
        est = estimate(model, Setup(**{**reference["setup"], **changes}))
        rows.append(
            dict(**{COLUMNS.get(k, k): v for k, v in changes.items()}, measured_gib=measured,
                 estimated_gib=round(est.total_gib, 1),
                 error_pct=round(100 * (est.total_gib - measured) / measured, 1))
        )  # fmt: skip
    return rows
