"""Loading the base model: 4-bit NF4 through bitsandbytes, or unquantized for comparison.

The packed 4-bit weights are stored in a float dtype equal to the model's dtype
(`bnb_4bit_quant_storage`): FSDP flattens and shards all parameters of a unit together and cannot
do that with integer storage or mixed dtypes.
"""

from __future__ import annotations

import importlib.util

import torch

from kit import tiny
from kit.config import Config

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def storage_dtype(cfg: Config) -> torch.dtype:
    q = cfg.quantization
    return (
        torch.uint8
        if q.storage == "uint8"
        else DTYPES[cfg.model.dtype if q.storage == "auto" else q.storage]
    )


def bnb_config(cfg: Config):
    """The BitsAndBytesConfig for cfg, or None when quantization.method is none."""
    from transformers import BitsAndBytesConfig

    q = cfg.quantization
    if q.method == "none":
        return None
    return BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type=q.method,
        bnb_4bit_use_double_quant=q.double_quant,
        bnb_4bit_compute_dtype=DTYPES[cfg.model.dtype],
        bnb_4bit_quant_storage=storage_dtype(cfg),
    )


def attention_implementation(requested: str) -> tuple[str, str | None]:
    """(implementation to use, warning or None): flash_attention_2 falls back to sdpa without
    the flash-attn package (sdpa carries a FlashAttention-2 kernel of its own)."""
    if requested == "flash_attention_2" and importlib.util.find_spec("flash_attn") is None:
        return "sdpa", (
            "attention.implementation: 'flash_attention_2' needs the flash-attn package, which is "
            "not installed; using 'sdpa' (its flash backend is the same algorithm)"
        )
    return requested, None


def load_model(cfg: Config, device: torch.device, attn: str | None = None):
    """from_pretrained the base model onto `device`, quantized per cfg; returns (model, tokenizer)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = tiny.resolve(cfg.model.name)
    kwargs = dict(
        dtype=DTYPES[cfg.model.dtype],
        attn_implementation=attn or attention_implementation(cfg.attention.implementation)[0],
        trust_remote_code=cfg.model.trust_remote_code,
        quantization_config=bnb_config(cfg),
    )
    if device.type == "cuda":
        # Each rank loads (and quantizes) onto its own GPU; never device_map="auto" under FSDP.
        kwargs["device_map"] = {"": device.index}
    model = AutoModelForCausalLM.from_pretrained(path, **kwargs)
    tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=cfg.model.trust_remote_code)
    return model, tokenizer


def quantized_bytes(model) -> dict[str, int]:
    """Bytes held by 4-bit packed weights vs everything else (parameters and buffers)."""
    import bitsandbytes as bnb

    packed = sum(
        m.weight.numel() * m.weight.element_size()
        for m in model.modules()
        if isinstance(m, bnb.nn.Linear4bit)
    )
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    return {"packed_4bit": packed, "other": total - packed, "total": total}
