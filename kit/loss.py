"""Causal-LM loss without an fp32 copy of every logit (training.loss=chunked).

transformers' default loss upcasts the whole logits tensor to fp32 and keeps its log-softmax for
backward: with a 128k vocabulary that is ~2 GB per 2,048 tokens on top of the bf16 logits, alive at
the very top of the memory peak. The chunked loss computes the same sum in fp32, a few thousand
tokens at a time, and recomputes each chunk's softmax in backward (activation checkpointing at the
scale of one chunk), so only one chunk's fp32 copy ever exists.

It is installed with transformers' own switch (`model.loss_function = ...`), so the model's forward,
FSDP's hooks and the labels' shift stay exactly as the library runs them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

CHUNK_TOKENS = 4096


def _chunk_sum(logits: torch.Tensor, labels: torch.Tensor, ignore_index: int) -> torch.Tensor:
    return F.cross_entropy(logits.float(), labels, ignore_index=ignore_index, reduction="sum")


def chunked_causal_lm_loss(
    logits: torch.Tensor,
    labels: torch.Tensor,
    vocab_size: int,
    num_items_in_batch: torch.Tensor | int | None = None,
    ignore_index: int = -100,
    shift_labels: torch.Tensor | None = None,
    chunk_tokens: int = CHUNK_TOKENS,
    **_: object,
) -> torch.Tensor:
    """Drop-in for transformers' ForCausalLMLoss (same arguments, same value)."""
    if shift_labels is None:
        labels = F.pad(labels, (0, 1), value=ignore_index)
        shift_labels = labels[..., 1:]
    flat = logits.reshape(-1, vocab_size)
    target = shift_labels.reshape(-1).to(flat.device)
    total = flat.new_zeros((), dtype=torch.float32)
    for start in range(0, flat.shape[0], chunk_tokens):
        part = slice(start, start + chunk_tokens)
        if flat.requires_grad:
            total = total + checkpoint(
                _chunk_sum, flat[part], target[part], ignore_index, use_reentrant=False
            )
        else:
            total = total + _chunk_sum(flat[part], target[part], ignore_index)
    if num_items_in_batch is None:
        num_items_in_batch = (target != ignore_index).sum()
    if torch.is_tensor(num_items_in_batch):
        num_items_in_batch = num_items_in_batch.to(total.device)
    return total / num_items_in_batch


def install(model, kind: str) -> None:
    """Set the loss of a transformers model (or the one inside a PEFT model) by config name."""
    if kind == "hf":
        return
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    inner.loss_function = chunked_causal_lm_loss
