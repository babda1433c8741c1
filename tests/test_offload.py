"""kit.recipe.levers.offload: training.offload_activations. The hooks run for real: on this CPU they keep every
tensor where it is (there is nothing to move to), on a GPU they move the large ones to pinned host
memory and back (the GPU test, run on the device: benchmarks/records/2026-11-24-offload-8b-1xh200/gpu_offload.sh)."""

from __future__ import annotations

import pytest
import torch

from kit.config import ConfigError, load_config
from kit.recipe import model
from kit.recipe.levers import offload


def _loss_and_grads(built, device, enabled):
    torch.manual_seed(0)
    ids = torch.randint(3, 1000, (2, 64), device=device)
    with offload.activations(enabled, device, min_bytes=0) as offloader:
        loss = built.model(input_ids=ids, labels=ids, use_cache=False).loss
    loss.backward()
    grads = {n: p.grad.clone() for n, p in built.model.named_parameters() if p.grad is not None}
    built.model.zero_grad(set_to_none=True)
    return loss.item(), grads, offloader


def _same(device):
    cfg = load_config(None, ["training.device=" + device.type, "lora.dropout=0"])
    built = model.build(cfg, device)
    plain = _loss_and_grads(built, device, False)
    moved = _loss_and_grads(built, device, True)
    assert plain[0] == moved[0]
    assert plain[1].keys() == moved[1].keys()
    assert all(torch.equal(plain[1][n], moved[1][n]) for n in plain[1])
    return moved[2]


def test_on_a_cpu_the_hooks_see_what_autograd_saves_and_change_nothing():
    offloader = _same(torch.device("cpu"))
    assert offloader.kept > 0 and offloader.moved == 0  # nothing to move to on a CPU


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_a_gpu_the_layers_inputs_go_to_host_memory_and_come_back_exact():
    offloader = _same(torch.device("cuda"))
    # Whole-layer recompute: each decoder layer's input (2 x 64 tokens x 128 hidden, bf16) at
    # least, moved out and back; the result is bit-identical.
    assert offloader.moved >= 2 and offloader.moved_bytes >= 2 * 2 * 64 * 128 * 2
    # Each came back (the next one prefetched on the side stream), none kept past its use.
    assert len(offloader.order) == offloader.moved and all(m is None for m in offloader.order)


def test_offload_with_compiled_selective_layers_is_refused_in_one_line():
    with pytest.raises(ConfigError, match="^training.offload_activations: True is not allowed; "
                                          "with training.compile=true only under whole-layer"):
        load_config(None, ["training.offload_activations=true", "training.compile=true",
                           "training.recompute.keeps=matmuls"])
    with pytest.raises(ConfigError, match="^training.offload_activations: True"):
        load_config(None, ["training.offload_activations=true", "training.compile=true",
                           "training.recompute.enabled=false"])
    load_config(None, ["training.offload_activations=true", "training.compile=true",
                       "training.recompute.keeps=inputs"])


@pytest.mark.slow  # compiles
@pytest.mark.parametrize("kind", ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU")])])
def test_compiled_layers_hand_the_hooks_their_inputs_as_eager_ones_do(kind):
    """Whole-layer recompute around compiled layers: the hooks choose each decoder layer's input
    (and what the head keeps), as in eager; the 4-bit layers' quantization state the compiled
    graphs also hand them stays put; loss and gradients match the eager model's."""
    from kit.recipe.recompute import compile_layers

    device = torch.device(kind)
    cfg = load_config(None, [f"training.device={kind}", "lora.dropout=0",
                             "training.recompute.keeps=inputs"])
    built = model.build(cfg, device)
    held = offload.persistent(built.model)
    assert len(held) > 4 * cfg_layers(built)  # absmax, code, nested absmax, offset per 4-bit layer

    def run():
        torch.manual_seed(0)
        ids = torch.randint(3, 1000, (2, 64), device=device)
        with offload.activations(True, device, min_bytes=0, held=held) as offloader:
            loss = built.model(input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()
        grads = {n: p.grad.clone() for n, p in built.model.named_parameters() if p.grad is not None}
        built.model.zero_grad(set_to_none=True)
        assert offloader.moved == (len(offloader.chosen) if kind == "cuda" else 0)
        # Each moved tensor came back once and none is left on the GPU past its use.
        assert all(m is None for m in offloader.order)
        return loss.item(), grads, offloader.chosen

    eager = run()
    torch._dynamo.reset()
    try:
        compile_layers(built.model)
        compiled = run()
    finally:
        torch._dynamo.reset()
    layer_input = (2, 64, built.model.config.hidden_size)
    assert eager[2].count(layer_input) >= cfg_layers(built)
    # Beside eager's: only the rotary tables the compiled layers take as inputs (64 x head_dim).
    extra = [s for s in compiled[2] if s not in eager[2]]
    assert all(len(s) == 3 and s[:2] == (1, 64) for s in extra), extra
    assert compiled[2].count(layer_input) == eager[2].count(layer_input)
    assert compiled[0] == pytest.approx(eager[0], rel=1e-4)
    for name, g in eager[1].items():
        assert torch.allclose(compiled[1][name], g, rtol=1e-2, atol=1e-3), name


def cfg_layers(built) -> int:
    return built.model.config.num_hidden_layers
