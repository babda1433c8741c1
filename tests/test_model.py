"""The one way to build the model a rank trains (kit.recipe.model.build): load -> LoRA -> recompute ->
loss -> train(), and one definition of a decoder layer (kit.recipe.layers) for sharding and recompute."""

import pytest
import torch

from kit.config import load_config
from kit.recipe import layers, model
from kit.recipe.engines import FSDP1


def _build(*overrides, train=True):
    cfg = load_config(None, ["quantization.method=none", "model.dtype=float32", *overrides])
    return model.build(cfg, torch.device("cpu"), train=train)


def test_build_is_in_train_mode_with_the_same_adapter_every_time():
    a, b = _build(), _build()
    assert a.model.training and all(m.training for m in a.model.modules())
    lora_a = {n: p for n, p in a.model.named_parameters() if p.requires_grad}
    lora_b = dict(b.model.named_parameters())
    assert lora_a and all(torch.equal(p, lora_b[n]) for n, p in lora_a.items())


@pytest.mark.parametrize("overrides,recomputed", [
    ([], [0, 1]), (["training.recompute.every=2"], [0]),
    (["training.recompute.keeps=matmuls"], [0, 1]), (["training.recompute.enabled=false"], []),
])  # fmt: skip
def test_build_recomputes_what_the_config_asks(overrides, recomputed):
    assert _build(*overrides).recomputed == recomputed


def test_train_false_stops_after_lora():
    built = _build(train=False)
    assert not all(m.training for m in built.model.modules()) and built.recomputed == []
    assert any("lora_A" in n for n, _ in built.model.named_parameters())


def test_decoder_layers_are_one_definition_for_sharding_and_recompute():
    """What recompute switches on and what FSDP1 wraps are the same modules: kit.recipe.layers."""
    built = _build("training.recompute.every=2")
    found = layers.decoder_layers(built.model)
    assert [type(m).__name__ for m in found] == ["LlamaDecoderLayer"] * 2
    assert [i for i, m in enumerate(found) if m.gradient_checkpointing] == built.recomputed
    policy_classes = layers.decoder_layer_classes(built.model)
    assert {type(m) for m in found} == policy_classes
    assert FSDP1.wrap.__module__ == "kit.recipe.engines"  # FSDP1's wrap policy reads the same classes


def test_a_model_without_no_split_modules_is_refused_with_the_field():
    with pytest.raises(ValueError, match="model.name: Linear declares no _no_split_modules"):
        layers.decoder_layers(torch.nn.Linear(2, 2))
