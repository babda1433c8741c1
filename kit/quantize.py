"""Loading the base model: 4-bit NF4 through bitsandbytes, or unquantized for comparison.

The packed 4-bit weights are stored in a float dtype equal to the model's dtype
(`bnb_4bit_quant_storage`): FSDP flattens and shards all parameters of a unit together and cannot
do that with integer storage or mixed dtypes.
"""

from __future__ import annotations

import torch

from kit import builtin
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


def params4bit_kwargs(cfg: Config) -> dict:
    """How bitsandbytes' Params4bit quantizes a weight for cfg (what BitsAndBytesConfig sets)."""
    q = cfg.quantization
    return dict(blocksize=64, compress_statistics=q.double_quant, quant_type=q.method,
                quant_storage=storage_dtype(cfg))


def attention_implementation(requested: str) -> tuple[str, str | None]:
    """(implementation to use, warning or None), through kit.attention.resolve: flash_attention_2
    falls back to sdpa without the flash-attn package (sdpa carries a FlashAttention-2 kernel of
    its own); sdpa_<backend> is registered with transformers under its kit_sdpa_* name."""
    from kit import attention

    return attention.resolve(requested)


def load_model(cfg: Config, device: torch.device, attn: str | None = None,
               weights: bool = True):  # fmt: skip
    """from_pretrained the base model onto `device`, quantized per cfg; returns (model, tokenizer).
    weights=False: the same model on the meta device from the folder's config alone (a folder
    without weights: kit.builtin.AT_LOAD), for kit.loading to fill."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    path = builtin.resolve(cfg.model.name)
    kwargs = dict(
        dtype=DTYPES[cfg.model.dtype],
        attn_implementation=attn or attention_implementation(cfg.attention.implementation)[0],
        trust_remote_code=cfg.model.trust_remote_code,
        quantization_config=bnb_config(cfg),
    )
    # Each rank loads (and quantizes) onto its own device; never device_map="auto" under FSDP.
    # Named on CPU too: without a device_map, transformers puts a 4-bit model on the current GPU
    # whenever there is one, even for a CPU run (or a notebook kernel looking at a layer).
    # On "meta" (kit.loading: rank0's other ranks, stream): the same modules, nothing read.
    cuda = device.index if device.index is not None else torch.cuda.current_device() \
        if device.type == "cuda" else None  # fmt: skip
    kwargs["device_map"] = {"": cuda if device.type == "cuda" else device.type}
    if weights:
        model = AutoModelForCausalLM.from_pretrained(path, **kwargs)
    else:  # the model class's from_pretrained with an empty state dict: every weight on meta
        from transformers.utils import logging

        config = AutoConfig.from_pretrained(path, trust_remote_code=cfg.model.trust_remote_code)
        kwargs.update(config=config, state_dict={}, device_map={"": "meta"})
        kwargs.pop("trust_remote_code")
        before = logging.get_verbosity()
        logging.set_verbosity_error()  # its report lists every weight as missing: all are
        try:
            cls = AutoModelForCausalLM._model_mapping[type(config)]
            model = cls.from_pretrained(None, **kwargs)
        finally:
            logging.set_verbosity(before)
        if cfg.quantization.method != "none":  # 4-bit weights as from_pretrained leaves them
            import bitsandbytes as bnb  # on meta: Params4bit, not yet quantized (PEFT reads it)

            for m in model.modules():
                if isinstance(m, bnb.nn.Linear4bit) and not isinstance(m.weight, bnb.nn.Params4bit):
                    m.weight = bnb.nn.Params4bit(m.weight.data, requires_grad=False, module=m,
                                                 **params4bit_kwargs(cfg))
    keep_packing(model)
    tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=cfg.model.trust_remote_code)
    return model, tokenizer


def keep_packing(model) -> int:
    """Switch off bitsandbytes' CPU inference repacking; returns the 4-bit layers it covered.

    On a CPU with AVX512-BF16, an eval-mode forward without gradients rewrites each 4-bit weight
    in place into a CPU-only layout (`packing_format_for_cpu`). Under FSDP1 those weights are views
    into a flat parameter in the model dtype, and saving then fails in bitsandbytes
    (`assert packed_weight.dtype == torch.uint8`); under any engine the weights would no longer be
    what the GPUs hold. The layout is only an inference speed-up: training keeps the plain one."""
    import bitsandbytes as bnb

    layers = [m for m in model.modules() if isinstance(m, bnb.nn.Linear4bit)]
    for m in layers:
        m.support_avx512bf16_for_cpu = False
    return len(layers)


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


# --------------------------------------------------------------------------- looking inside (02)


def quantize_weight(weight: torch.Tensor, method: str = "nf4", double_quant: bool = True,
                    storage: torch.dtype = torch.uint8):  # fmt: skip
    """(packed, quant_state) for one weight, exactly as bitsandbytes' Linear4bit stores it."""
    import bitsandbytes.functional as F

    return F.quantize_4bit(weight, blocksize=64, compress_statistics=double_quant,
                           quant_type=method, quant_storage=storage)  # fmt: skip


def state_bytes(state, tables: bool = True) -> int:
    """Bytes of a QuantState's constants: per-block scales (absmax; with double quantization the
    8-bit scales, their fp32 scales and offset) and, if `tables`, the fixed lookup tables (16
    values of the 4-bit code; 256 of the 8-bit code for the scales) that cost the same per layer."""
    tensors = [state.absmax] + ([state.code] if tables else [])
    if state.nested:
        tensors += [state.state2.absmax, state.offset] + ([state.state2.code] if tables else [])
    return sum(t.numel() * t.element_size() for t in tensors)


def quantization_report(weight: torch.Tensor, method: str = "nf4", double_quant: bool = True,
                        storage: torch.dtype = torch.uint8) -> dict:  # fmt: skip
    """What quantizing `weight` costs and keeps: storage layout, bytes, bits/param, error."""
    import bitsandbytes.functional as F

    packed, state = quantize_weight(weight, method, double_quant, storage)
    restored = F.dequantize_4bit(packed, state)
    w, r = weight.float(), restored.float()
    scales = state_bytes(state, tables=False)
    packed_bytes = packed.numel() * packed.element_size()
    return {
        "method": method,
        "double_quant": double_quant,
        "storage": str(storage).removeprefix("torch."),
        "packed_shape": tuple(packed.shape),
        "packed_bytes": packed_bytes,
        "scale_bytes": scales,
        "table_bytes": state_bytes(state) - scales,
        "original_bytes": weight.numel() * weight.element_size(),
        # Packed 4 bits + scales; the fixed tables are left out (a few bytes per layer).
        "bits_per_param": 8 * (packed_bytes + scales) / weight.numel(),
        "relative_error": ((r - w).norm() / w.norm()).item(),
        "max_abs_error": (r - w).abs().max().item(),
        "dequantized_dtype": str(restored.dtype).removeprefix("torch."),
    }


def linear4bit_layout(module) -> dict:
    """How a bitsandbytes Linear4bit in a loaded model holds its weight."""
    w = module.weight
    state = w.quant_state
    return {
        "logical_shape": tuple(state.shape),
        "stored_shape": tuple(w.shape),
        "stored_dtype": str(w.dtype).removeprefix("torch."),
        "stored_bytes": w.numel() * w.element_size(),
        "constant_bytes": state_bytes(state),
        "quant_type": state.quant_type,
        "double_quant": bool(state.nested),
        "compute_dtype": str(module.compute_dtype).removeprefix("torch."),
    }


def load_on_cpu(name: str = "kit:tiny-llama", method: str = "nf4", storage: str = "auto",
                dtype: str = "bfloat16"):  # fmt: skip
    """A model loaded the recipe's way (from_pretrained + BitsAndBytesConfig), to look at: on the
    CPU even where there is a GPU (a notebook kernel never touches CUDA)."""
    from kit.config import load_config

    cfg = load_config(None, [f"model.name={name}", f"model.dtype={dtype}",
                             f"quantization.method={method}", f"quantization.storage={storage}",
                             "sharding.engine=fsdp2"])  # fmt: skip
    return load_model(cfg, torch.device("cpu"))[0]


def code_values(method: str = "nf4") -> list[float]:
    """The 16 values a 4-bit code can take, as fractions of the block's absmax, sorted."""
    _, state = quantize_weight(torch.zeros(64, dtype=torch.float32) + 1, method, False)
    return sorted(state.code.tolist())


def plot_levels(weight: torch.Tensor, blocksize: int = 64, ax=None):
    """Histogram of the weights divided by their block's absmax, with the NF4 (solid) and FP4
    (dotted) levels they are rounded to."""
    import matplotlib.pyplot as plt

    ax = ax or plt.subplots(figsize=(8, 3))[1]
    blocks = weight.detach().float().reshape(-1, blocksize)
    normalized = (blocks / blocks.abs().amax(dim=1, keepdim=True)).flatten()
    ax.hist(normalized.numpy(), bins=120, density=True, color="0.7")
    for method, style, color in (("nf4", "-", "C0"), ("fp4", ":", "C3")):
        for i, v in enumerate(code_values(method)):
            ax.axvline(v, ls=style, color=color, lw=1, label=method.upper() if i == 0 else None)
    ax.set_xlabel(f"weight / absmax of its block of {blocksize}")
    ax.legend()
    return ax
