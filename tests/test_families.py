"""The family matrix: a tiny random model of each family the kit names (kit.inputs.families), brought
in as a user brings one (a local folder written by save_pretrained), trains under FSDP2 with NF4
and LoRA all-linear on 2 CPU processes and its adapter reloads with plain PEFT, or the check step
refuses the config in one line before any process starts. Plus what each family allows, read from
transformers without weights: the attention implementation "auto" picks, the ones refused.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from conftest import ROOT, TINY, read_run, reload_in_process, torchrun

from kit.config import ConfigError, load_config
from kit.inputs import builtin, families, sources

BF16_TOLERANCE = 0.02  # relative to the largest logit: a few bf16 ulps (as tests/test_train.py)
# The second lever set of the issue: the fused loss with the matmuls kept.
LEVERS = ["training.loss=fused", "training.recompute.keeps=matmuls"]
# model_type -> the check's refusal of LEVERS (None: allowed, and the run uses them)
LEVERS_REFUSED = {
    "gemma2": "training.loss: 'fused' is not allowed for this model; its logits pass through "
              "final_logit_softcapping after the head; allowed: hf, chunked",
    "cohere2": "training.loss: 'fused' is not allowed for this model; its logits pass through "
               "logit_scale after the head; allowed: hf, chunked",
}


def folder(family: str) -> str:
    """The family's tiny model as a plain local folder (what a user's model.name=<folder> is)."""
    return str(builtin.build(families.kit_key(family)))


def check(family: str, *overrides: str):
    from kit.run.check import check as run_check

    return run_check(load_config(TINY, [f"model.name={folder(family)}", *overrides]))


# llama and qwen2 train under FSDP2 / FSDP1 with NF4 and reload with plain PEFT in
# tests/test_train.py (the fused loss and kept matmuls are checked on llama in-process, in
# tests/test_loss.py and tests/test_model.py): one torchrun each for the other families (CI time).
TRAINED_ELSEWHERE = ("llama", "qwen2")


# In the default run (CI time): Gemma 2 (softcapping: eager attention, the fused loss refused in
# one line, the default path trained); the others with `pytest -m matrix`.
DEFAULT_RUN = ("gemma2",)


@pytest.mark.slow
@pytest.mark.parametrize("family", [
    f if f in DEFAULT_RUN else pytest.param(f, marks=pytest.mark.matrix)
    for f in families.FAMILIES if f not in TRAINED_ELSEWHERE])
def test_family_trains_or_is_refused_before_start(tmp_path, family):
    refusal = LEVERS_REFUSED.get(family)
    if refusal:  # the check says it in one line, before any process; the run takes the default path
        with pytest.raises(ConfigError) as e:
            check(family, *LEVERS)
        assert str(e.value) == refusal
        levers = []
    else:
        levers = LEVERS
    out = tmp_path / "run"
    run = torchrun(out, f"model.name={folder(family)}", "training.steps=6", "training.eval_every=0",
                   "training.warmup_steps=1", *levers)
    result, metrics = read_run(out)
    train = [m["loss"] for m in metrics if m["split"] == "train"]
    assert len(train) == 6 and train[-1] < train[0], train  # it learns
    # Attention "auto": what the model class supports on a CPU, said in the plan line.
    picked = families.pick_attention(sources.model_facts(folder(family)), "cpu", "bfloat16")[0]
    assert f"attention {picked}" in run.stdout
    sums = result["lora_checksums"]
    assert len(sums) == 2 and sums[0] == sums[1]  # the ranks hold the same adapter
    assert result["adapter"]["tensors"] >= 2 * 2 * 3  # all-linear: >= 3 linears per layer
    cmp = reload_in_process("reload_adapter.py", out)  # plain PEFT on the base: the trained logits
    assert cmp["max_diff"] < BF16_TOLERANCE * cmp["scale"], cmp
    assert cmp["max_diff_without_adapter"] > 10 * cmp["max_diff"], cmp  # the adapter matters


def test_check_refuses_attention_the_class_does_not_support():
    with pytest.raises(ConfigError) as e:
        check("gemma2", "attention.implementation=sdpa")
    assert str(e.value) == (
        "attention.implementation: 'sdpa' is not allowed for this model: Gemma2ForCausalLM does "
        "not support SDPA; allowed: auto, eager, flex_attention, flash_attention_2")
    check("gemma2", "attention.implementation=eager")  # what it supports passes


def test_kit_check_refuses_before_any_process(tmp_path):
    """`kit check` (run.sh's step before torchrun): exit 2, one line, for a local folder whose
    config.json leaves the logit scale out (a hand-written or trimmed config): the config class's
    default (Cohere2Config: 0.0625) counts, as it does in the ranks."""
    config = json.loads((builtin.Path(folder("cohere2")) / "config.json").read_text())
    del config["logit_scale"]
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text(json.dumps(config))
    proc = subprocess.run([sys.executable, "-m", "kit.run.check", str(TINY),
                           f"model.name={tmp_path / 'model'}", "training.loss=fused",
                           f"run.output_dir={tmp_path / 'run'}"],
                          capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == ["ConfigError: " + LEVERS_REFUSED["cohere2"]]


def _config_only(tmp_path, model_type: str, **extra) -> str:
    """A folder with a family's tiny config.json alone: enough for what the class allows."""
    from transformers import AutoConfig

    AutoConfig.for_model(model_type, **{**families.TINY, **extra}).save_pretrained(tmp_path)
    return str(tmp_path)


def test_attention_sinks_get_flex_or_eager_never_sdpa(tmp_path):
    facts = sources.model_facts(_config_only(tmp_path, "gpt_oss", num_local_experts=4))
    assert facts["sinks"] and facts["class"] == "GptOssForCausalLM"
    assert families.pick_attention(facts, "cuda", "bfloat16", flash_attn=True)[0] == "flex_attention"
    assert families.pick_attention(facts, "cpu", "bfloat16")[0] == "eager"
    allowed = families.allowed_attention(facts)
    assert [n for n, ok in allowed.items() if ok is True] == ["eager", "flex_attention"]
    assert "(attention sinks)" in allowed["sdpa"]
    assert "not flash_attention_2" in families.attention_refusal("flash_attention_2", facts)


def test_softcapped_attention_is_not_given_sdpa_even_where_the_class_has_it(tmp_path):
    """Gemma 3's class declares SDPA; a config that softcaps attention logits cannot use it."""
    plain = sources.model_facts(_config_only(tmp_path / "a", "gemma3_text"))
    capped = sources.model_facts(_config_only(tmp_path / "b", "gemma3_text",
                                              attn_logit_softcapping=30.0))
    assert families.pick_attention(plain, "cuda", "bfloat16")[0] == "sdpa"
    assert families.pick_attention(capped, "cuda", "bfloat16")[0] == "flex_attention"
    assert families.pick_attention(capped, "cpu", "bfloat16")[0] == "eager"
    assert "softcapped (30.0)" in families.attention_refusal("sdpa_math", capped)


def test_the_recipe_page_lists_every_family_as_the_kit_sees_it():
    from kit.budget.plan import GROUPED_FAMILIES

    facts = {f: sources.model_facts(families.model_name(f)) for f in families.ALL}
    table = families.readme_table(facts, GROUPED_FAMILIES)
    page = ROOT / "docs" / "recipe.md"
    assert table in page.read_text(), "docs/recipe.md's family table:\n" + table


def _moe_families() -> dict[str, object]:
    """Every causal-LM family of the installed transformers whose default config has experts (more
    than one), built with 2 layers on the meta device (no memory, no weights): model_type -> the
    model. A wrapper whose text model is its own family (qwen4_exp: qwen4_exp_text) is that family;
    a default config without its layer types (lfm2_moe) gets plain attention layers."""
    import warnings

    import torch
    from transformers import CONFIG_MAPPING, AutoModelForCausalLM
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    from transformers.utils import logging

    counts = ("num_experts", "n_routed_experts", "num_local_experts", "moe_num_experts")
    found, before = {}, logging.get_verbosity()
    logging.set_verbosity_error()
    try:
        for model_type in sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES):
            try:
                text = CONFIG_MAPPING[model_type]().get_text_config()
            except Exception:  # noqa: BLE001 - a family whose default config cannot be made
                continue
            if not any((getattr(text, k, None) or 0) > 1 for k in counts):
                continue
            if text.model_type != model_type and text.model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
                continue  # its text model is a family of its own, built on its own
            config = CONFIG_MAPPING[model_type](num_hidden_layers=2)
            if getattr(config, "layer_types", False) is None:
                config.layer_types = ["full_attention"] * 2
            with warnings.catch_warnings(), torch.device("meta"):
                warnings.simplefilter("ignore")
                found[model_type] = AutoModelForCausalLM.from_config(config)
    finally:
        logging.set_verbosity(before)
    return found


def test_every_mixture_of_experts_family_trains_grouped_or_is_refused():
    """Each MoE family transformers ships: its 3-D weights sit in transformers' experts modules
    (which the kit stores in NF4, adapts and runs grouped: kit.recipe.experts), or its model_type
    is refused before any process (kit.inputs.families.EXPERTS_REFUSED), and `all-linear` adapts
    no router (a linear layer beside the experts with one output per expert)."""
    import torch

    from kit.recipe import experts

    models = _moe_families()
    assert {"mixtral", "qwen3_moe", "gpt_oss", "phimoe", "deepseek_v3"} <= set(models)
    kept_elsewhere = set()
    for model_type, model in models.items():
        held = {n for n, _ in experts.find(model)}
        convs = {n for n, m in model.named_modules() if isinstance(m, torch.nn.Conv1d)}
        if any(p.dim() == 3 and n.rpartition(".")[0] not in held | convs
               for n, p in model.named_parameters()):
            kept_elsewhere.add(model_type)
            continue
        targets, stacks = experts.split_targets(model, "all-linear")
        routers = experts.routers(model)
        named = {n: m for n, m in model.named_modules()}
        shared = [n for n, m in named.items() if m in routers and "shared" in n]
        assert not shared, (model_type, shared)  # Qwen3-Next's shared expert is 512 wide, as E
        adapted = [n for n, m in model.named_modules() if m in routers and (
            n in targets or n.rsplit(".", 1)[-1] in targets)]
        assert not adapted, (model_type, adapted)
        assert not held or stacks, model_type
    assert kept_elsewhere == set(families.EXPERTS_REFUSED) & set(models), kept_elsewhere
    refused = families.experts_refusal("some/folder", "llama4_text")
    assert refused.startswith("model.name: 'some/folder' is a llama4_text model, whose experts "
                              "(Llama4TextExperts) are not") and "\n" not in refused


# A tiny shape for any MoE family's config class: the keys its defaults have, set small.
MOE_TINY = dict(hidden_size=64, intermediate_size=128, moe_intermediate_size=64,
                num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                vocab_size=1024, num_experts=4, n_routed_experts=4, num_local_experts=4,
                moe_num_experts=4, num_experts_per_tok=2, num_experts_per_token=2, moe_k=2,
                max_position_embeddings=512, first_k_dense_replace=0, kv_lora_rank=16,
                q_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16, n_group=1,
                topk_group=1, num_expert_group=1, shared_expert_intermediate_size=64,
                n_shared_experts=1, index_head_dim=16, index_n_heads=2, o_groups=2, o_lora_rank=16,
                unpadded_vocab_size=1024, swa_num_attention_heads=4, swa_num_key_value_heads=2,
                swa_head_dim=16, linear_head_dim=16, linear_num_heads=4, mamba_num_heads=4,
                mamba_head_dim=16, n_groups=1, moe_shared_expert_intermediate_size=64)  # fmt: skip


def _tiny_moe_folder(model_type: str, where) -> str:
    """A tiny random model of an MoE family, saved as a user brings one (config, weights, the
    kit's tokenizer). Multi-head latent attention's rotary part is its head_dim, with as many
    key/value heads as query heads; ZAYA routes to one expert; dots.3 keeps key/value heads."""
    import torch
    from transformers import CONFIG_MAPPING, AutoModelForCausalLM, AutoTokenizer

    defaults = CONFIG_MAPPING[model_type]().to_dict()
    kw = {k: v for k, v in MOE_TINY.items() if k in defaults}
    if "kv_lora_rank" in defaults:
        kw.update(head_dim=kw["qk_rope_head_dim"], num_key_value_heads=kw["num_attention_heads"])
    if model_type == "zaya":
        kw["num_experts_per_tok"] = 1
    if model_type.startswith("dots3"):
        kw["num_key_value_heads"] = kw["num_attention_heads"]
    config = CONFIG_MAPPING[model_type](**kw, pad_token_id=0)
    if getattr(config, "layer_types", False) is None:
        config.layer_types = ["full_attention"] * 2
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(where)
    AutoTokenizer.from_pretrained(folder("llama")).save_pretrained(where)
    return str(where)


def test_every_mixture_of_experts_family_takes_a_training_step(tmp_path):
    """Every MoE family of the installed transformers that the check does not refuse: a tiny
    random model built as the recipe builds it (experts in NF4, LoRA all-linear with dropout)
    takes a step on the CPU: a finite loss, gradients on the experts' adapters wherever the
    model has routed experts, and a gradient on every adapter all-linear made: none sits where
    backward never reaches (a sparse-attention indexer's top-k: kit.recipe.experts.
    undifferentiated), but for DeepSeek-V4's compressor, which runs on longer rows than these."""
    import math
    import warnings

    import torch
    from transformers.utils import logging

    from kit.recipe import model as recipe

    done, before = {}, logging.get_verbosity()
    logging.set_verbosity_error()
    try:
        for model_type in sorted(set(_moe_families()) - set(families.EXPERTS_REFUSED)):
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                where = _tiny_moe_folder(model_type, tmp_path / model_type)
                cfg = load_config(TINY, [f"model.name={where}", "model.loading=full", "lora.r=4"])
                model = recipe.build(cfg, torch.device("cpu"), train=True).model
                ids = torch.randint(0, 1000, (2, 16))
                loss = model(input_ids=ids, labels=ids).loss
                loss.backward()
            experts_lora = [p for n, p in model.named_parameters() if "lora_" in n and "experts" in n]
            assert math.isfinite(loss.item()) and all(p.grad is not None for p in experts_lora), model_type
            unreached = [n for n, p in model.named_parameters() if "lora_B" in n and p.grad is None
                         and not (model_type == "deepseek_v4" and ".compressor." in n)]
            assert not unreached, (model_type, unreached[:3])
            done[model_type] = len(experts_lora)
    finally:
        logging.set_verbosity(before)
    assert sum(1 for n in done.values() if n) >= 45, done  # routed experts in the tiny shape


# Whose checkpoint names transformers' conversion mapping does not all place (stream says so in one
# line; auto loads them in full); whose two full loads differ from each other (nothing to compare).
STREAM_REFUSED = {"lara_mini", "sarvam_moe"}
UNSTABLE_FULL_LOAD = {"inkling2_text"}


def test_every_mixture_of_experts_family_streams_its_checkpoint_as_a_full_load(tmp_path,
                                                                               group_of_one):
    """Each family's tiny checkpoint as transformers' save_pretrained writes it (one tensor per
    expert for most, fused for some) loaded with model.loading=stream, a chunk of experts at a
    time, holds bit for bit what a full load holds (kit.recipe.expert_source); or stream is
    refused in one line naming model.loading."""
    import warnings

    import torch
    from transformers.utils import logging

    from kit.lab import loading_rank
    from kit.recipe import loading

    streamed, before = [], logging.get_verbosity()
    logging.set_verbosity_error()
    try:
        for model_type in sorted(set(_moe_families()) - set(families.EXPERTS_REFUSED)
                                 - UNSTABLE_FULL_LOAD):
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                where = _tiny_moe_folder(model_type, tmp_path / model_type)
                cfg = {m: load_config(TINY, [f"model.name={where}", f"model.loading={m}"])
                       for m in ("full", "stream")}
                if model_type in STREAM_REFUSED:
                    with pytest.raises(ConfigError, match=r"^model\.loading: stream is not allowed"):
                        loading.load(cfg["stream"], torch.device("cpu"))
                    continue
                model, _ = loading.load(cfg["stream"], torch.device("cpu"))
                assert loading.loaded_as(model) == "stream", model_type
                loading.streamer_of(model).fill(model)
                full, _ = loading.load(cfg["full"], torch.device("cpu"))
            assert loading_rank.state_digest(model) == loading_rank.state_digest(full), model_type
            streamed.append(model_type)
    finally:
        logging.set_verbosity(before)
    assert len(streamed) >= 45, streamed


def test_kit_check_refuses_a_family_whose_experts_it_cannot_train(tmp_path):
    """The check step (run.sh's, before torchrun): exit 2 and the one line, for a local folder of
    a family that keeps its experts outside transformers' experts modules."""
    folder = _config_only(tmp_path / "model", "llama4_text", num_local_experts=4,
                          intermediate_size_mlp=128)
    proc = subprocess.run([sys.executable, "-m", "kit.run.check", str(TINY), f"model.name={folder}",
                           f"run.output_dir={tmp_path / 'run'}"],
                          capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "ConfigError: " + families.experts_refusal(folder, "llama4_text")]


def test_a_router_that_is_a_linear_layer_is_never_adapted():
    """PhiMoE's router is an nn.Linear subclass that returns a tuple: PEFT's all-linear wrapped it
    (and the step failed: 'tuple' object has no attribute 'dtype'). Built as the recipe builds
    it, the router stays itself and frozen, the experts get their adapters, and a step runs."""
    import torch

    from kit.recipe import experts
    from kit.recipe import model as recipe

    cfg = load_config(TINY, [f"model.name={families.model_name('phimoe')}", "model.loading=full"])
    model = recipe.build(cfg, torch.device("cpu"), train=True).model
    routers = experts.routers(model)
    assert routers and all(type(r).__name__ == "PhimoeTopKRouter" for r in routers)
    assert not any(p.requires_grad for r in routers for p in r.parameters())
    ids = torch.randint(0, 1000, (2, 16))
    out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    lora = [p for n, p in model.named_parameters() if "lora_" in n and "experts" in n]
    assert lora and all(p.grad is not None for p in lora)
