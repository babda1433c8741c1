"""kit.bench.worker's bookkeeping that runs without a GPU: the tokens every recipe sees, and how a
profile sorts kernels (the profile itself runs on GPUs only; the worker runs in tests/test_bench.py)."""

from __future__ import annotations

import torch

from kit.bench import worker as bench_worker


def test_synthetic_batches_are_the_same_for_every_recipe_and_differ_by_rank_and_step():
    one = bench_worker.synthetic_batch(3, 0, 2, 64, 1024, "cpu")
    assert torch.equal(one["input_ids"], bench_worker.synthetic_batch(3, 0, 2, 64, 1024, "cpu")["input_ids"])
    assert not torch.equal(one["input_ids"], bench_worker.synthetic_batch(3, 1, 2, 64, 1024, "cpu")["input_ids"])
    assert not torch.equal(one["input_ids"], bench_worker.synthetic_batch(4, 0, 2, 64, 1024, "cpu")["input_ids"])
    ids = one["input_ids"]
    assert ids.shape == (2, 64) and torch.equal(ids[:, :17], ids[:, 17:34])  # a phrase, repeated
    assert ids.min() >= 3 and len(ids.unique()) <= (1024 - 3) // 8  # no special tokens, a subset
    assert torch.equal(one["labels"], ids) and bool(one["attention_mask"].all())


def test_profile_sorts_kernels_into_families_and_skips_annotations():
    """profile_step's bookkeeping: kernel names to families, and the ranges modules mark on the
    GPU timeline are not counted as kernels."""
    family = bench_worker.kernel_family
    assert family("nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_NNT") == "matmul"
    assert family("cudnn_generated_fort_native_sdpa_sm90_flash_bprop") == "attention"
    assert family("void kDequantizeBlockwise<__nv_bfloat16, 512>") == "4-bit dequantize"
    assert family("triton_poi_fused_add_mul_native_dropout_silu_6") == "compiled (triton)"
    assert family("ncclDevKernel_AllGather_RING_LL") == "nccl"
    assert family("void at::native::vectorized_elementwise_kernel") == "other eager kernels"
    for span in ("FSDP::pre_backward (layers.22)", "Optimizer.step#AdamW.step",
                 "FullyShardedDataParallel.forward"):
        assert bench_worker._is_annotation(span)
    assert not bench_worker._is_annotation("nvjet_sm90_tst_16x64_64x16_1x2_h_bz_TNN")
