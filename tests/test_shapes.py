"""kit.budget.shapes: a model's shape from its name, dict or folder, and what counting gives from it."""

from __future__ import annotations

import json

import pytest

from kit.bench import records
from kit.budget import shapes
from kit.inputs.builtin import SPECS

LLAMA3_70B = dict(vocab_size=128256, hidden_size=8192, intermediate_size=28672,
                  num_hidden_layers=80, num_attention_heads=64, num_key_value_heads=8)  # fmt: skip


def test_shape_from_kit_name_dict_and_folder_agree(tmp_path):
    by_name = shapes.shape_of("kit:llama-8b")
    assert by_name == shapes.shape_of(SPECS["llama-8b"])
    (tmp_path / "config.json").write_text(json.dumps(SPECS["llama-8b"]))
    assert shapes.shape_of(tmp_path) == by_name
    # Llama-3-8B has 8.03B parameters; 70B 70.55B (public figures).
    assert by_name.params == pytest.approx(8.03e9, rel=1e-3)
    assert shapes.shape_of(LLAMA3_70B).params == pytest.approx(70.55e9, rel=1e-3)
    assert by_name.head_dim == 128 and by_name.kv_heads == 8


def test_unknown_kit_model_names_the_allowed_ones():
    with pytest.raises(ValueError, match="kit:tiny-llama"):
        shapes.shape_of("kit:nope")


def test_lora_params_follow_rank_and_targets():
    shape = shapes.shape_of("kit:llama-8b")
    assert shapes.lora_params(shape, 16) == 2 * shapes.lora_params(shape, 8)
    qv = shapes.lora_params(shape, 8, ["q_proj", "v_proj"])
    assert qv == 32 * 8 * ((4096 + 4096) + (4096 + 1024))
    with pytest.raises(ValueError, match="nope_proj"):
        shapes.lora_params(shape, 8, ["nope_proj"])


def test_lora_formula_matches_peft_on_the_real_tiny_model():
    from kit.config import load_config
    from kit.lab import quantize_nf4
    from kit.recipe import lora

    cfg = load_config(None, ["lora.r=4", "lora.target_modules=[q_proj, v_proj, down_proj]"])
    peft_model = lora.apply_lora(quantize_nf4.load_on_cpu("kit:tiny-llama"), cfg)
    expected = shapes.lora_params(shapes.shape_of("kit:tiny-llama"), 4,
                                  ["q_proj", "v_proj", "down_proj"])  # fmt: skip
    assert lora.trainable_summary(peft_model)["trainable"] == expected


def test_flops_per_token_of_the_8b_shape_is_what_the_benchmark_recorded():
    flops = shapes.flops_per_token(shapes.shape_of("kit:llama-8b"), 2048)
    # 4 x 7.50e9 linear params (with the output head) + attention: ~31.6 GFLOP per token.
    assert 31.0e9 < flops < 32.2e9
    # Every row of the recorded 2x H200 run carries the number its MFU was computed with.
    recorded = records.rows("2026-11-23-speed-8b-2xh200")
    assert {r["flops_per_token"] for r in recorded if "flops_per_token" in r} == {flops}


@pytest.mark.parametrize("model_type, total, active", [
    ("deepseek_v3", 671e9, 37e9),  # DeepSeek-V3: n_routed_experts, 3 dense layers, MLA
    ("glm4_moe", 106e9, 12e9),  # GLM-4.5-Air's shape: n_routed_experts, a shared expert
    ("ernie4_5_moe", 21e9, 3e9),  # ERNIE-4.5-21B-A3B: moe_num_experts, moe_k
    ("qwen2_moe", 14.3e9, 2.7e9),  # Qwen1.5-MoE-A2.7B's shape: num_experts, 4 shared experts
])
def test_a_config_counts_its_experts_under_any_of_their_names(model_type, total, active):
    """config.json names the experts' count as its family does (transformers aliases the names
    in its config classes, which this module does not import): the shape counts them under every
    name, where it counted DeepSeek-V3, GLM-4.5-Air and ERNIE-4.5 as dense models (40B, 9B and 3B
    parameters). Within 10% of the published totals; the active count within 20%, shared experts
    and dense first layers counted (Qwen1.5-MoE's shared MLP: 0.69 of its active parameters
    without it, 1.00 with; DeepSeek-V3's latent attention counts as plain attention: 1.09)."""
    from transformers import CONFIG_MAPPING

    shape = shapes.shape_of(CONFIG_MAPPING[model_type]().to_dict())
    assert shape.experts > 1 and shape.active_experts > 1
    assert abs(shape.params / total - 1) < 0.1, shape.params
    assert 0.8 < shape.active_params / active < 1.2, shape.active_params
    if model_type == "qwen2_moe":  # its shared MLP: a third of what a token passes
        assert abs(shape.active_params / active - 1) < 0.02, shape.active_params
