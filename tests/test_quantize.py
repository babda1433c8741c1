"""Loading the base model in 4 bits (kit.recipe.quantize, notebook 02)."""

import pytest
import torch
from conftest import TINY

from kit.config import load_config
from kit.lab import quantize_nf4
from kit.recipe import quantize


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
    from kit.lab.quantize_nf4 import load_on_cpu

    model = load_on_cpu("kit:tiny-llama")
    assert {p.device.type for p in model.parameters()} == {"cpu"}


# ------------------------------------------------------------------- a model's own weights (02)


def test_read_weight_reads_the_tensor_from_pretrained_loads():
    from transformers import AutoModelForCausalLM

    from kit.inputs import builtin

    name = "model.layers.1.mlp.down_proj.weight"
    model = AutoModelForCausalLM.from_pretrained(builtin.resolve("kit:tiny-llama"))
    assert torch.equal(quantize_nf4.read_weight("kit:tiny-llama", name), model.get_parameter(name))
    assert len(quantize_nf4.tensor_files("kit:tiny-llama")) == len(model.state_dict())


def test_normality_tells_heavy_tails_from_a_normal_sample():
    g = torch.Generator().manual_seed(0)
    normal = torch.randn(256, 512, generator=g)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        laplace = torch.distributions.Laplace(0.0, 1.0).sample((256, 512))  # excess kurtosis 3
    twin = quantize_nf4.normal_twin(laplace)
    assert twin.shape == laplace.shape
    assert twin.std().item() == pytest.approx(laplace.std().item(), rel=0.01)
    assert abs(quantize_nf4.excess_kurtosis(normal).item()) < 0.1
    assert quantize_nf4.excess_kurtosis(laplace).item() == pytest.approx(3.0, abs=0.3)
    heavy, plain = quantize_nf4.normality(laplace), quantize_nf4.normality(normal)
    assert plain["beyond_3_std_%"] == pytest.approx(0.27, abs=0.05)
    assert heavy["beyond_3_std_%"] > 4 * plain["beyond_3_std_%"]
    assert heavy["block_absmax_in_stds"] > plain["block_absmax_in_stds"]
    # NF4 is made for the normal: it loses more on heavy tails, and less than FP4 on either.
    assert plain["nf4_error"] < heavy["nf4_error"] < heavy["fp4_error"]
    assert plain["nf4_error"] < plain["fp4_error"]


def test_a_4bit_round_trip_leaves_at_most_16_values_per_block():
    import bitsandbytes.functional as F

    w = torch.randn(64, 128, generator=torch.Generator().manual_seed(1))

    restored = F.dequantize_4bit(*quantize_nf4.quantize_weight(w, "nf4", double_quant=False))
    assert quantize_nf4.values_per_block(restored, 64)[0] <= 16
    assert quantize_nf4.values_per_block(w, 64) == (64, 64.0)


def test_linear_kurtosis_covers_every_decoder_weight_on_one_thread():
    before = torch.get_num_threads()
    found = quantize_nf4.linear_kurtosis("kit:tiny-llama")  # 2 layers x 7 linears, normal init
    assert len(found) == 14 and all(abs(k) < 0.5 for k in found), found
    assert torch.get_num_threads() == before
