"""The article recipe: QLoRA + FSDP1 the way a user writes it by hand from the well-known articles.

This is the baseline kit.bench measures the kit against (notebook 09). It is deliberately plain,
with every choice the articles make and nothing the kit adds:

- transformers loads the model with bitsandbytes NF4 (double quant, bf16 compute, bf16 storage so
  that FSDP1 can flatten it), each rank onto its own device;
- PEFT LoRA on every linear layer (r 16, alpha 32, dropout 0.05), adapters cast to bf16 (FSDP1
  flattens one dtype per unit);
- transformers' activation checkpointing (non-reentrant) on every decoder layer, train mode;
- FSDP1 FULL_SHARD with the decoder layer as the auto-wrap unit, bf16 MixedPrecision,
  use_orig_params (frozen and trainable parameters share a unit) — or DDP for the article's first
  row;
- AdamW, transformers' loss (fp32 logits), gradient clipping at 1.0.

Everything the kit does differently (FSDP2, compiled layers, the chunked loss, selective
checkpointing, larger batches) is a lever measured on top of this, never hidden inside it.
"""

from __future__ import annotations

import functools

import torch


def build(model_path: str, device: torch.device, *, engine: str = "fsdp1",
          attention: str = "sdpa", checkpointing: bool = True, r: int = 16, alpha: int = 32,
          dropout: float = 0.05, lr: float = 2e-4):
    """(model, optimizer) ready to train; every rank calls it after init_process_group."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    from kit.recipe import attention as kattention

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
    if engine == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP

        model = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
    else:
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
        from torch.distributed.fsdp import MixedPrecision, ShardingStrategy
        from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy

        layer_classes = {type(m) for m in model.modules()
                         if type(m).__name__ in model.get_base_model()._no_split_modules}
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
    """One optimizer step; returns the loss."""
    loss = model(**batch).loss
    loss.backward()
    if hasattr(model, "clip_grad_norm_"):  # FSDP1 computes the norm across shards
        model.clip_grad_norm_(1.0)
    else:
        torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.requires_grad], 1.0)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss.item()
