"""The model a rank trains, built one way: load (quantized) -> LoRA -> recompute -> loss -> train().

    built = build(cfg, env.device)        # then kit.lab.sharding wraps built.model
    built.model, built.tokenizer, built.attention, built.recomputed

The recipe (kit.train), notebook 04's per-rank report (kit.lab.sharding), the memory measurements
(kit.lab.memory), the pitfall reproductions' fixed side and the benchmarks/ scripts all call this, so
the order of operations lives in one place. Each step is its own module: kit.recipe.loading and
kit.recipe.quantize (load), kit.recipe.lora, kit.recipe.recompute, kit.recipe.levers.loss.
Sharding comes after, and is the caller's: what it wraps depends on the engine (kit.lab.sharding).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kit.budget import plan as kplan
from kit.config import Config, ConfigError
from kit.recipe import experts, grouped_experts, loading, lora, nf4, quantize, recompute
from kit.recipe.checks import check_checkpointing_active
from kit.recipe.levers import loss as kloss


@dataclass
class Built:
    model: torch.nn.Module  # the PEFT model, in train mode, not yet sharded
    tokenizer: object
    attention: str  # the implementation transformers was given (kit.recipe.attention.resolve)
    attention_warning: str | None  # e.g. flash_attention_2 fell back to sdpa
    recomputed: list[int]  # indices of the decoder layers recomputed in backward


def build(cfg: Config, device: torch.device, *, train: bool = True) -> Built:
    """Load the base model onto `device` (quantized per cfg), add LoRA seeded with
    training.seed (the same adapter on every rank), switch on recomputation and the loss, and put
    it in train mode (from_pretrained returns eval mode, where transformers' recompute silently
    does nothing). train=False stops after LoRA: the model as loaded, for looking inside.
    A data.max_seq_len past the model's max_position_embeddings is refused (ConfigError).
    Values left at "auto" that a run has not planned (kit.budget.plan) take the recipe's plain
    ones: a notebook's model, merge and chat build it so."""
    cfg = kplan.plain(cfg)
    attn, warning = quantize.attention_implementation(cfg.attention.implementation, cfg, device)
    model, tokenizer = loading.load(cfg, device, attn)  # model.loading: full | rank0 | stream
    most = getattr(model.config, "max_position_embeddings", None)
    if isinstance(most, int) and isinstance(cfg.data.max_seq_len, int) and cfg.data.max_seq_len > most:  # the doctor's pre-flight says it too
        raise ConfigError(f"data.max_seq_len: {cfg.data.max_seq_len} is not allowed; "
                          f"{cfg.model.name} has max_position_embeddings={most}")
    if cfg.data.packing:  # with a KV cache, transformers ignores packing (kit.recipe.data)
        model.config.use_cache = False
    torch.manual_seed(cfg.training.seed)  # the same LoRA init on every rank
    with loading.adapters_stay_put(model):  # stream: the base is on meta until FSDP2 shards it
        peft_model = lora.apply_lora(model, cfg)
    experts.choose(peft_model, cfg.model.experts)  # a mixture of experts: grouped, or the loop
    if not train:
        return Built(peft_model, tokenizer, attn, warning, [])
    if device.type == "cuda" and nf4.available(device):  # bitsandbytes' values, one kernel
        nf4.enable(peft_model)
        grouped_experts.kernels()  # the experts' token layout (loaded before layers compile)
    if cfg.quantization.fp8_matmul:
        from kit.recipe.levers import fp8

        fp8.enable(peft_model)
    if cfg.lora.recompute:
        lora.recompute_adapters(peft_model)
    if cfg.lora.fused_down:  # before the groups: a member's own forward is their fallback
        from kit.recipe import lora_down

        if device.type == "cuda" and not lora_down.available(device):  # as the pre-flight says
            raise ConfigError(f"lora.fused_down: True is not allowed on "
                              f"{torch.cuda.get_device_name(device)} (its Triton kernels need "
                              "compute capability 8.0+ and triton); allowed: false, or auto")
        if device.type == "cuda":
            lora_down.kernels()  # loaded before any layer compiles (and the policies know them)
        lora_down.enable(peft_model)
    if cfg.lora.group_inputs:
        from kit.recipe.levers import lora_groups

        lora_groups.enable(peft_model, recompute=cfg.lora.recompute)
    recomputed = recompute.apply(peft_model, cfg)
    kloss.install(peft_model, cfg.training.loss)
    peft_model.train()
    for finding in check_checkpointing_active(peft_model):
        raise RuntimeError(str(finding))
    return Built(peft_model, tokenizer, attn, warning, recomputed)


def import_libraries(cfg: Config) -> None:
    """Import transformers, PEFT and (for a 4-bit base) bitsandbytes. kit.train calls it on every
    rank as soon as the group exists, so that the ranks import them side by side: left to first
    use, rank 0 imported them alone in its check and plan (kdist.on_main) while the others waited,
    and the others alone after it (4 of the 23 s of a two-step tiny run on a 2-core CPU)."""
    import peft  # noqa: F401
    from transformers import AutoConfig, AutoModelForCausalLM  # noqa: F401

    if cfg.quantization.method != "none":
        import bitsandbytes  # noqa: F401
