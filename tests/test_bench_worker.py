"""kit.bench.worker's bookkeeping that runs without a GPU: the tokens every recipe sees, and how a
profile sorts kernels (the profile itself runs on GPUs only; the worker runs in tests/test_bench.py)."""

from __future__ import annotations

import torch

from kit.bench import profiling
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
    family = profiling.kernel_family
    assert family("nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_NNT") == "matmul"
    assert family("cudnn_generated_fort_native_sdpa_sm90_flash_bprop") == "attention"
    assert family("void kDequantizeBlockwise<__nv_bfloat16, 512>") == "4-bit dequantize"
    assert family("_nf4_dequant_kernel") == "4-bit dequantize"  # unsloth's, a Triton kernel
    for name in ("down", "dx", "da", "up_add"):  # kit.recipe.lora_down_kernels', by exact name
        assert family(name) == "LoRA (kit, Triton)"
    for name in ("gather_sum", "combine_grad"):  # kit.recipe.experts_kernels'
        assert family(name) == "experts' rows (kit, Triton)"
    assert family("triton_poi_fused_add_index_23") == "compiled (triton)"
    assert family("triton_poi_fused_add_mul_native_dropout_silu_6") == "compiled (triton)"
    assert family("ncclDevKernel_AllGather_RING_LL") == "nccl"
    assert family("void at::native::vectorized_elementwise_kernel") == "other eager kernels"
    for span in ("FSDP::pre_backward (layers.22)", "Optimizer.step#AdamW.step",
                 "FullyShardedDataParallel.forward"):
        assert profiling._is_annotation(span)
    assert not profiling._is_annotation("nvjet_sm90_tst_16x64_64x16_1x2_h_bz_TNN")


def test_profile_tells_launches_and_waits_on_the_gpu_from_the_ops():
    """host_side: CUDA runtime calls apart from the ops (launches counted, synchronizing calls
    summed as waits), the ops' own CPU time, the costliest ops first."""
    from types import SimpleNamespace as A

    got = profiling.host_side([
        A(key="cudaLaunchKernel", count=900, self_cpu_time_total=4500.0),
        A(key="cudaLaunchKernelExC", count=100, self_cpu_time_total=800.0),
        A(key="cudaStreamSynchronize", count=3, self_cpu_time_total=250000.0),
        A(key="cudaMemcpyAsync", count=4, self_cpu_time_total=100.0),
        A(key="aten::index", count=96, self_cpu_time_total=9000.0),
        A(key="aten::mm", count=200, self_cpu_time_total=3000.0),
        A(key="cutlass::grouped_gemm", count=10, self_cpu_time_total=50.0)])
    assert got["launches"] == 1000 and got["waits_ms"] == 250.0
    assert list(got["runtime_ms"])[0] == "cudaStreamSynchronize"
    assert got["ops_self_ms"] == 12.1 and got["top_ops_ms"][0] == ["aten::index", 96, 9.0]


def test_idle_names_what_the_host_did_while_the_gpu_waited():
    """idle: the GPU's lead-in, tail and gaps between kernels (any stream, overlaps merged), each
    gap named by the ops holding the CPU at its middle (outer > inner, on the thread of the
    longest), "python" where none did; gaps under the threshold are not counted."""
    spans = [(1000, 5000), (4000, 10000), (30000, 40000), (40010, 50000), (90000, 95000)]  # us
    host = [(0, 100000, "step", 1),
            (12000, 29000, "aten::item", 1), (13000, 28000, "cudaStreamSynchronize", 1),
            (60000, 70000, "autograd::engine::evaluate_function: MmBackward0", 2),
            (61000, 69000, "aten::mm", 2)]
    got = profiling.idle(spans, host, 0.0, 100000.0)
    assert got["lead_ms"] == 1.0 and got["tail_ms"] == 5.0
    assert got["gaps_ms"] == 60.0  # 10-30 and 50-90 ms; the 10 us at 40 ms is under 20 us
    # 10-30 ms: middle 20, thread 1 holds step > aten::item > sync; 50-90: middle 70 is the
    # backward op's end, so thread 1's step (the longest) names it
    assert got["by_host_ms"] == [["step", 40.0, 1], ["step > cudaStreamSynchronize", 20.0, 1]]
    assert [g[0] for g in got["longest"]] == ["step", "step > cudaStreamSynchronize"]
    assert got["longest"][0][1:] == [50.0, 40.0]
    bare = profiling.idle(spans, [], 0.0, 100000.0)
    assert bare["by_host_ms"] == [["python", 60.0, 2]]
