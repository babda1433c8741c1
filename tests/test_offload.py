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


def test_offload_with_compile_is_refused_in_one_line():
    with pytest.raises(ConfigError, match="^training.offload_activations: True is not allowed; "
                                          "only without training.compile"):
        load_config(None, ["training.offload_activations=true", "training.compile=true"])
