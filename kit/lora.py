"""LoRA adapters with PEFT: which modules get them, how many parameters train, in what dtype."""

from __future__ import annotations

import torch

from kit.config import Config, ConfigError
from kit.quantize import DTYPES


def adapter_dtype(cfg: Config) -> torch.dtype:
    """float32 by default; FSDP1 flattens one dtype per unit, so there it is model.dtype."""
    if cfg.lora.dtype != "auto":
        return DTYPES[cfg.lora.dtype]
    return DTYPES[cfg.model.dtype] if cfg.sharding.engine == "fsdp1" else torch.float32


def linear_module_names(model) -> list[str]:
    """Distinct names of linear layers (the candidates for target_modules)."""
    import bitsandbytes as bnb

    kinds = (torch.nn.Linear, bnb.nn.Linear4bit)
    return sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, kinds)})


def apply_lora(model, cfg: Config):
    """Wrap `model` with PEFT LoRA per cfg.lora; adapters cast to adapter_dtype(cfg)."""
    from peft import LoraConfig, get_peft_model

    lc = cfg.lora
    targets = lc.target_modules
    config = LoraConfig(
        r=lc.r,
        lora_alpha=lc.alpha,
        lora_dropout=lc.dropout,
        target_modules=targets,
        bias="none",
        task_type="CAUSAL_LM",
    )
    try:
        peft_model = get_peft_model(model, config)
    except ValueError as e:
        if "not found in the base model" not in str(e) and "Target modules" not in str(e):
            raise
        names = ", ".join(linear_module_names(model))
        raise ConfigError(
            f"lora.target_modules: {targets!r} matches no module of the model; "
            f"allowed: 'all-linear' or names among {names}"
        ) from None
    dtype = adapter_dtype(cfg)
    for p in peft_model.parameters():
        if p.requires_grad:
            p.data = p.data.to(dtype)
    return peft_model


def trainable_summary(peft_model) -> dict[str, float]:
    """Trainable vs all parameters; PEFT counts a packed 4-bit weight as its logical size."""
    trainable, total = peft_model.get_nb_trainable_parameters()
    return {"trainable": trainable, "total": total, "percent": 100.0 * trainable / max(total, 1)}
