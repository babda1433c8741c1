"""Loading the base model in 4 bits (kit.quantize, notebook 02)."""

import pytest
import torch
from conftest import TINY

from kit import quantize
from kit.config import load_config


def test_eval_forward_leaves_the_4bit_weights_as_loaded():
    """On CPUs with AVX512-BF16, bitsandbytes rewrites each 4-bit weight into a CPU-only layout on
    the first eval-mode forward without gradients; under FSDP1 the next save then failed
    (`assert packed_weight.dtype == torch.uint8`). The kit keeps the layout it loaded. (On other
    CPUs bitsandbytes never repacks, and this passes either way.)"""
    import bitsandbytes as bnb

    cfg = load_config(TINY, ["training.device=cpu"])
    model, _ = quantize.load_model(cfg, torch.device("cpu"))
    layers = {n: m for n, m in model.named_modules() if isinstance(m, bnb.nn.Linear4bit)}
    before = {n: (m.weight.dtype, tuple(m.weight.shape)) for n, m in layers.items()}
    model.eval()
    with torch.no_grad():
        model(input_ids=torch.arange(3, 19).reshape(1, 16))
    assert {n: (m.weight.dtype, tuple(m.weight.shape)) for n, m in layers.items()} == before
    assert not any(getattr(m.weight.quant_state, "packing_format_for_cpu", False)
                   for m in layers.values())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_load_on_cpu_stays_on_the_cpu_where_there_is_a_gpu():
    """Without an explicit device_map transformers puts a 4-bit model on the current GPU: a
    notebook looking at a layer would touch CUDA in its kernel."""
    from kit.quantize import load_on_cpu

    model = load_on_cpu("kit:tiny-llama")
    assert {p.device.type for p in model.parameters()} == {"cpu"}
