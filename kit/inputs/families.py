"""The model families the kit is tested on, and what each allows: attention kernels, the fused loss.

    FAMILIES["gemma2"]                       # the tiny shape's own keys (kit:tiny-gemma2)
    model_name("llama")                      # "kit:tiny-llama": one tiny random model per family
    allowed_attention(facts)                 # {implementation: True or why not} for this model
    pick_attention(facts, "cuda", "bfloat16", flash_attn=False)  # (name, why) for "auto"

`facts` is what kit.inputs.sources.model_facts reads from transformers about a model without its
weights: the config through its config class (defaults count: a saved config.json leaves out
every value equal to the class's default, e.g. Cohere2's logit_scale) and the model class's
declared support (`_supports_sdpa`, `_supports_flex_attn`, `_supports_flash_attn`,
`_compatible_flash_implementations`, `_supports_attention_backend` on PreTrainedModel). A class
that declares SDPA may still route a config's attention softcapping to it, which SDPA cannot do
(transformers' sdpa_attention_forward raises); attention sinks (gpt_oss) are declared by the class
as no SDPA. So: softcapping or a class without SDPA leaves eager, flex (softcapping and sinks are
score modifications there) and the FlashAttention kernels the class lists.

Every tiny dense model: 2 decoder layers, hidden 128, 4 query / 2 key-value heads of 32, the kit's
tokenizer (vocabulary 1,024); the family's own defaults otherwise (tied embeddings, sliding
windows, softcapping, logit scale). Adding a family is one FAMILIES entry (its shape's extra keys,
e.g. experts); tests/test_families.py trains each one or expects the check's refusal.

Importing it loads nothing: the kernel side (the check, the planner) and the ranks both use it.
"""

from __future__ import annotations

TINY = dict(vocab_size=1024, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=32,
            max_position_embeddings=512)  # fmt: skip
# model_type -> keys of its tiny shape beyond TINY (the family's defaults otherwise)
FAMILIES: dict[str, dict] = {
    "llama": {}, "qwen2": {}, "qwen3": {}, "mistral": {}, "gemma2": {}, "gemma3_text": {},
    "phi3": {}, "olmo2": {}, "granite": {}, "smollm3": {}, "glm4": {}, "cohere2": {},
}  # fmt: skip
# Mixture-of-experts families: their tiny models are in kit.inputs.moe_shapes (experts in NF4,
# kit.recipe.experts; trained by tests/test_moe.py, one torchrun each).
EXPERTS = {"mixtral": "tiny-mixtral", "qwen3_moe": "tiny-qwen3-moe", "olmoe": "tiny-olmoe",
           "gpt_oss": "tiny-gpt-oss", "phimoe": "tiny-phimoe"}  # fmt: skip
# Mixture-of-experts families whose experts are not transformers' experts modules (the kind its
# `use_experts_implementation` decorator marks, which kit.recipe.experts stores in NF4, adapts and
# runs as grouped GEMMs): model_type -> the module holding them. Refused before any process
# (`experts_refusal`, from kit.inputs.sources.check_with_model on every path);
# tests/test_families.py derives the same set from every MoE family of the installed transformers.
EXPERTS_REFUSED = {"llama4": "Llama4TextExperts", "llama4_text": "Llama4TextExperts",
                   "jetmoe": "JetMoeParallelExperts", "longcat_flash": "LongcatFlashExperts",
                   "inkling_text": "InklingSharedExperts", "inkling2_loop_text": "message_input"}
# Families whose tiny model was there before this table (kit.inputs.builtin.SPECS): same names.
EXISTING = {"llama": "tiny-llama", "qwen2": "tiny-qwen2", **EXPERTS}
ALL = [*FAMILIES, *EXPERTS]  # every family the kit is tested on (docs/recipe.md's table)
# What "auto" tries, fastest first: SDPA (PyTorch's fused kernels), FlashAttention 2 (GPU, the
# flash-attn package, not float32), flex (GPU: compiled; on a CPU the pre-flight refuses it), eager.
PREFERENCE = ("sdpa", "flash_attention_2", "flex_attention", "eager")
PINNED = ("sdpa_flash", "sdpa_efficient", "sdpa_cudnn", "sdpa_math")


def kit_key(family: str) -> str:
    """The key of the family's tiny model in kit.inputs.builtin.SPECS."""
    return EXISTING.get(family, f"tiny-{family.replace('_', '-')}")


def model_name(family: str) -> str:
    return "kit:" + kit_key(family)


def tiny_specs() -> dict[str, dict]:
    """kit.inputs.builtin.SPECS entries for the families without one."""
    return {kit_key(f): dict(TINY, model_type=f, **extra)
            for f, extra in FAMILIES.items() if f not in EXISTING}


def allowed_attention(facts: dict | None) -> dict:
    """{implementation name of attention.implementation: True, or why this model cannot use it};
    every name allowed when the model's class could not be read (facts None or without it)."""
    names = ("eager", "sdpa", *PINNED, "flex_attention", "flash_attention_2")
    support = (facts or {}).get("attention")
    if not support:
        return dict.fromkeys(names, True)
    cls, softcap = facts.get("class", "the model class"), facts.get("attn_logit_softcapping")
    out: dict = {"eager": True}
    sdpa = (True if support["sdpa"] and not softcap else
            f"{cls} does not support SDPA" + (" (attention sinks)" if facts.get("sinks") else "")
            if not support["sdpa"] else
            f"its attention logits are softcapped ({softcap}), which SDPA cannot do")
    out["sdpa"] = sdpa
    for name in PINNED:  # registered with transformers by name (kit.recipe.attention)
        out[name] = sdpa if sdpa is not True or support["backend"] else (
            f"{cls} does not take registered attention functions")
    out["flex_attention"] = True if support["flex"] else f"{cls} does not support flex_attention"
    flash = support["flash"]
    out["flash_attention_2"] = (True if flash is True else f"{cls} does not support "
                                "FlashAttention" if not flash else f"{cls} supports only "
                                f"{', '.join(flash)} (not flash_attention_2)")
    return out


def pick_attention(facts: dict | None, device: str, dtype: str,
                   flash_attn: bool = False) -> tuple[str, str]:  # fmt: skip
    """("auto"'s implementation, why): the first of PREFERENCE this model allows and this
    device runs."""
    allowed = allowed_attention(facts)
    known = bool((facts or {}).get("attention"))
    for name in PREFERENCE:
        if allowed[name] is not True:
            continue
        if name == "flash_attention_2" and not (device == "cuda" and flash_attn
                                                 and dtype != "float32"):
            continue
        if name == "flex_attention" and device != "cuda":
            continue
        if name == "sdpa":
            return name, ("PyTorch's fused kernels; the model class supports them" if known
                          else "the model class could not be read; transformers' default")
        skipped = "; ".join(f"not {n}: {allowed[n]}" for n in PREFERENCE[:PREFERENCE.index(name)]
                            if allowed[n] is not True)
        return name, (skipped or "the fastest this device runs for it") + (
            "; flex_attention runs on GPUs only" if name == "eager" and allowed[
                "flex_attention"] is True else "")
    return "eager", "nothing else runs it"


def experts_refusal(name: str, model_type: str | None) -> str | None:
    """One line refusing model.name where its family keeps experts the kit cannot train (3-D
    weights outside transformers' experts modules), else None."""
    held = EXPERTS_REFUSED.get(model_type or "")
    if held is None:
        return None
    return (f"model.name: {name!r} is a {model_type} model, whose experts ({held}) are not "
            "transformers' experts modules (use_experts_implementation): the kit can neither "
            "store them in 4 bits nor adapt them; allowed: dense models and mixtures of experts "
            "whose experts are such modules (Mixtral, Qwen2/3-MoE, DeepSeek-V2/V3, GLM-4.5, "
            "gpt-oss, PhiMoE, OLMoE, ...: docs/recipe.md)")


def attention_refusal(requested: str, facts: dict | None) -> str | None:
    """One line refusing an attention.implementation the model does not support, else None."""
    allowed = allowed_attention(facts)
    why = allowed.get(requested, True)
    if why is True:
        return None
    ok = ", ".join(["auto", *(n for n, v in allowed.items() if v is True)])
    return f"attention.implementation: {requested!r} is not allowed for this model: {why}; allowed: {ok}"


def levers(facts: dict, grouped: tuple[str, ...]) -> dict:
    """What the planner turns on for this family on a GPU under FSDP2, and what "auto" attention
    is on a CPU (docs/recipe.md's table; `grouped`: kit.budget.plan.GROUPED_FAMILIES)."""
    transforms = facts.get("logit_transforms") or []
    moe = facts["model_type"] in EXPERTS
    return {"attention (GPU)": pick_attention(facts, "cuda", "bfloat16")[0],
            "attention (CPU)": pick_attention(facts, "cpu", "float32")[0],
            "fused loss": "no: " + ", ".join(transforms) if transforms else "yes",
            "grouped adapters": "yes" if facts["model_type"] in grouped else "no (not measured)",
            "compile (GPU plan)": "where grouped (Hopper, bf16)" if moe else "yes",
            "experts": "NF4, LoRA per expert" if moe else "-"}


def readme_table(facts: dict[str, dict], grouped: tuple[str, ...]) -> str:
    """docs/recipe.md's family table: family -> its tiny model's facts (kit.inputs.sources.model_facts)."""
    rows = [{"family": f"`{family}`", **levers(f, grouped)} for family, f in facts.items()]
    head = list(rows[0])
    return "\n".join(["| " + " | ".join(head) + " |", "|" + "---|" * len(head),
                      *("| " + " | ".join(r[h] for h in head) + " |" for r in rows)])
