"""The peer stack: QLoRA + FSDP the way a user who does not use this kit runs it today, with the
well-known fused kernels switched on.

The second baseline kit.bench measures the kit against, beside the article recipe
(kit.bench.article): the same plain setup plus what axolotl's Liger plugin applies. Every choice,
as such a user writes it:

- liger-kernel patches transformers' model code before the model is built, by its model type
  (llama, qwen2, ...: liger's own table of patch functions, the call axolotl's plugin makes):
  RoPE, RMSNorm and SwiGLU as Triton kernels, and the causal-LM forward replaced by liger's, whose
  fused linear cross-entropy computes the loss from the last hidden states in chunks without
  materialising the logits (used whenever the model trains and is given labels);
- transformers loads the model with bitsandbytes NF4 (double quant, bf16 compute, bf16 storage so
  that FSDP1 can flatten it), each rank onto its own device, SDPA attention;
- PEFT LoRA on every linear layer (r 16, alpha 32, dropout 0.05), adapters cast to bf16 (FSDP1
  flattens one dtype per unit);
- transformers' activation checkpointing (non-reentrant) on every decoder layer, train mode;
- FSDP1 FULL_SHARD with the decoder layer as the auto-wrap unit, bf16 MixedPrecision,
  use_orig_params — or, with `engine: fsdp2`, `fully_shard` on each decoder layer and then on the
  root (bf16 compute, fp32 gradient reduction: the PyTorch FSDP2 tutorial's policy);
- AdamW, gradient clipping at 1.0 (kit.bench.article's train_step).

Liger's kernels are Triton GPU kernels: on a machine without a CUDA GPU, or without liger-kernel,
`unavailable` says why in one line and the runner skips the case before starting a process.
No torch at import: the runner (kernel side) asks `unavailable` without loading it.
"""

from __future__ import annotations

import functools
import importlib.util

from kit.bench.matrix import no_cuda_gpu

LIGER = "liger-kernel==0.8.5"  # the version benchmarks/tools/fetch_gpu_wheels.sh fetches

# What axolotl's Liger plugin switches on for a llama- or qwen2-type model (liger_rope,
# liger_rms_norm, liger_glu_activation, liger_fused_linear_cross_entropy).
LIGER_KERNELS = {"rope": True, "rms_norm": True, "swiglu": True, "cross_entropy": False,
                 "fused_linear_cross_entropy": True}


def unavailable(device) -> str | None:
    """One line saying why the peer stack cannot run on `device` (a torch.device, or the
    matrix's training.device: "cuda", "cpu", "auto"), None when it can."""
    why = no_cuda_gpu(device, "liger-kernel's kernels are Triton GPU kernels")
    if why:
        return why
    if importlib.util.find_spec("liger_kernel") is None:
        return f"liger-kernel is not installed: pip install --no-deps {LIGER}"
    if importlib.util.find_spec("triton") is None:
        return "triton is not installed (liger-kernel's kernels need it; CUDA builds of torch bring it)"
    return None


def apply_liger(model_path: str) -> str:
    """Patch transformers' code for the model's type before it is built; returns the type.

    liger's `_apply_liger_kernel(model_type, **kwargs)` looks the type up in its table
    (MODEL_TYPE_TO_APPLY_LIGER_FN) and calls e.g. apply_liger_kernel_to_llama with the kwargs
    that function takes: the class-level patch axolotl's plugin makes in pre_model_load. An
    unknown type only logs there; here it is an error, since the stack would silently be the
    article recipe."""
    from liger_kernel.transformers.monkey_patch import (
        MODEL_TYPE_TO_APPLY_LIGER_FN,
        _apply_liger_kernel,
    )
    from transformers import AutoConfig

    model_type = AutoConfig.from_pretrained(model_path).model_type
    if model_type not in MODEL_TYPE_TO_APPLY_LIGER_FN:
        raise ValueError(f"model type {model_type!r}: liger-kernel has no kernels for it; "
                         f"expected one of {sorted(MODEL_TYPE_TO_APPLY_LIGER_FN)}")
    _apply_liger_kernel(model_type, **LIGER_KERNELS)
    return model_type


def build(model_path: str, device, *, engine: str = "fsdp1", attention: str = "sdpa",
          checkpointing: bool = True, r: int = 16, alpha: int = 32, dropout: float = 0.05,
          lr: float = 2e-4):
    """(model, optimizer) ready to train; every rank calls it after init_process_group."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    from kit.recipe import attention as kattention

    if engine not in ("fsdp1", "fsdp2"):
        raise ValueError(f"options.engine: {engine!r} is not allowed; expected 'fsdp1' or 'fsdp2'")
    why = unavailable(device)
    if why:
        raise RuntimeError(f"the peer stack cannot run here: {why}")
    apply_liger(model_path)
    bnb = BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type="nf4",
        bnb_4bit_use_double_quant=True,
        bnb_4bit_compute_dtype=torch.bfloat16,
        bnb_4bit_quant_storage=torch.bfloat16,
    )
    attn, _ = kattention.resolve(attention)
    placement = {"device_map": {"": device.index}} if device.type == "cuda" else {}
    model = AutoModelForCausalLM.from_pretrained(
        model_path, quantization_config=bnb, dtype=torch.bfloat16, attn_implementation=attn,
        **placement,
    )
    # liger replaced the causal-LM class's forward: the loss is its fused linear cross-entropy.
    if not type(model).forward.__module__.startswith("liger_kernel"):
        raise RuntimeError(f"{type(model).__name__}.forward is not liger-kernel's after patching "
                           f"({type(model).forward.__module__}); the loss would be transformers'")
    model = get_peft_model(model, LoraConfig(
        r=r, lora_alpha=alpha, lora_dropout=dropout, target_modules="all-linear",
        task_type="CAUSAL_LM",
    ))
    for p in model.parameters():
        if p.requires_grad:
            p.data = p.data.to(torch.bfloat16)
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    layer_classes = {type(m) for m in model.modules()
                     if type(m).__name__ in model.get_base_model()._no_split_modules}
    if engine == "fsdp2":
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for layer in [m for m in model.modules() if type(m) in layer_classes]:
            fully_shard(layer, mp_policy=mp)
        fully_shard(model, mp_policy=mp)
    else:
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
        from torch.distributed.fsdp import MixedPrecision, ShardingStrategy
        from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy

        model = FSDP(
            model,
            auto_wrap_policy=functools.partial(
                transformer_auto_wrap_policy, transformer_layer_cls=layer_classes
            ),
            sharding_strategy=ShardingStrategy.FULL_SHARD,
            mixed_precision=MixedPrecision(
                param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16,
                buffer_dtype=torch.bfloat16,
            ),
            use_orig_params=True,
            device_id=device,
            limit_all_gathers=True,
        )
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr)
    return model, optimizer


def train_step(model, optimizer, batch: dict) -> float:
    """One optimizer step; returns the loss (liger's, from the patched forward). The article
    recipe's step: FSDP1's own clip across shards, else clip_grad_norm_ (FSDP2's DTensors)."""
    from kit.bench import article

    return article.train_step(model, optimizer, batch)
