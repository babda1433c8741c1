"""Loading the base model: 4-bit NF4 through bitsandbytes, or unquantized for comparison.

The packed 4-bit weights are stored in a float dtype equal to the model's dtype
(`bnb_4bit_quant_storage`): FSDP flattens and shards all parameters of a unit together and cannot
do that with integer storage or mixed dtypes.

Notebook 02 looks inside with kit/lab/quantize_nf4.py: one weight quantized and restored, and a
trained model's weights against normal ones.
"""

from __future__ import annotations

import torch

from kit.config import Config
from kit.inputs import builtin

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


def attention_implementation(requested: str, cfg: Config | None = None,
                             device: torch.device | None = None) -> tuple[str, str | None]:  # fmt: skip
    """(implementation to use, warning or None), through kit.recipe.attention.resolve: flash_attention_2
    falls back to sdpa without the flash-attn package (sdpa carries a FlashAttention-2 kernel of
    its own); sdpa_<backend> is registered with transformers under its kit_sdpa_* name. "auto"
    (a model built outside a planned run) is what the planner would choose for cfg's model on
    `device` (kit.inputs.families.pick_attention)."""
    from kit.recipe import attention

    if requested == "auto":
        import importlib.util

        from kit.inputs import families, sources

        kind = device.type if device is not None and device.type != "meta" else (
            "cuda" if torch.cuda.is_available() else "cpu")
        facts = sources.model_facts(cfg.model.name, cfg.model.trust_remote_code)
        requested = families.pick_attention(facts, kind, cfg.model.dtype,
                                            importlib.util.find_spec("flash_attn") is not None)[0]
    return attention.resolve(requested)


def load_model(cfg: Config, device: torch.device, attn: str | None = None,
               weights: bool = True):  # fmt: skip
    """from_pretrained the base model onto `device`, quantized per cfg; returns (model, tokenizer).
    weights=False: the same model on the meta device from the folder's config alone (a folder
    without weights: kit.inputs.builtin.AT_LOAD), for kit.recipe.loading to fill."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # its bar once per rank in run.log: the kit's lines say it
    path = builtin.resolve(cfg.model.name)
    kwargs = dict(
        dtype=DTYPES[cfg.model.dtype],
        attn_implementation=attn or attention_implementation(cfg.attention.implementation,
                                                              cfg, device)[0],
        trust_remote_code=cfg.model.trust_remote_code,
        quantization_config=bnb_config(cfg),
    )
    # Each rank loads (and quantizes) onto its own device; never device_map="auto" under FSDP.
    # Named on CPU too: without a device_map, transformers puts a 4-bit model on the current GPU
    # whenever there is one, even for a CPU run (or a notebook kernel looking at a layer).
    # On "meta" (kit.recipe.loading: rank0's other ranks, stream): the same modules, nothing read.
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
