"""Causal-LM loss without an fp32 copy of every logit (training.loss=chunked), or without any
logits of the whole batch (training.loss=fused).

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
    flat = logits.reshape(-1, vocab_size)
    target, denominator = _targets(labels, shift_labels, ignore_index, num_items_in_batch,
                                   flat.device)
    total = flat.new_zeros((), dtype=torch.float32)
    for start in range(0, flat.shape[0], chunk_tokens):
        part = slice(start, start + chunk_tokens)
        if flat.requires_grad:
            total = total + checkpoint(
                _chunk_sum, flat[part], target[part], ignore_index, use_reentrant=False
            )
        else:
            total = total + _chunk_sum(flat[part], target[part], ignore_index)
    return total / denominator


def _targets(labels, shift_labels, ignore_index, num_items_in_batch, device):
    """(next-token targets as one flat tensor, the count the summed loss is divided by), as
    transformers' ForCausalLMLoss makes them."""
    if shift_labels is None:
        shift_labels = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    target = shift_labels.reshape(-1).to(device)
    if num_items_in_batch is None:
        num_items_in_batch = (target != ignore_index).sum()
    return target, torch.as_tensor(num_items_in_batch, device=device, dtype=torch.float32)


# --------------------------------------------------------------------------- training.loss=fused
# Even chunked, the loss above starts from the bf16 logits of the whole batch, and backward makes
# their gradient: 2 x tokens x vocabulary x 2 bytes (1 GB per 2,048 tokens at 128k). Fused, the
# output head runs inside the loss, a chunk of tokens at a time, and each chunk's gradient with
# respect to the hidden states is taken right there, in forward: the head is frozen, so that
# gradient is all backward needs, and it is as small as the hidden states. The same arithmetic
# as transformers' path: bf16 head matmul, fp32 softmax, bf16 gradient matmul.

FUSED_CHUNK_LOGITS = 2**26  # logits per chunk: 256 MiB in fp32
# On a GPU with the kit's Triton kernels the chunk's element-wise pass is one kernel
# (kit.recipe.levers.loss_kernel) that needs no fp32 copy and writes the gradient over the logits:
# the same bytes a chunk (2a + 4 a logit, kit.budget.estimate.loss_bytes) then hold (2a + 4) / a
# times the rows, and a step launches that many times fewer chunks.


def _kernel(device: torch.device) -> bool:
    """The chunk's pass runs as the Triton kernel here (kit.recipe.lora_down.available: the
    planner's Triton rule asked of this device)."""
    from kit.recipe.lora_down import available

    return available(device)


def _chunk_eager(logits, target, ignore_index, scale, want_grad):
    """One chunk's summed loss in torch ops (the CPU's path, and what the GPU test holds the
    kernel to); with `want_grad` also d(loss x scale)/d(logits) = (softmax - one-hot) x scale per
    valid row, in the logits' dtype."""
    logits = logits.float()
    lse = torch.logsumexp(logits, dim=-1)
    valid = target != ignore_index
    index = target.masked_fill(~valid, 0).unsqueeze(1)
    loss = ((lse - logits.gather(1, index).squeeze(1)) * valid).sum()
    if not want_grad:
        return loss, None
    probs = logits.sub_(lse.unsqueeze(1)).exp_()
    probs.scatter_add_(1, index, -valid.to(probs.dtype).unsqueeze(1))
    return loss, probs.mul_((valid * scale).unsqueeze(1))


class _HeadAndLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, target, ignore_index, denominator, chunk):
        total = hidden.new_zeros((), dtype=torch.float32)
        want_grad = ctx.needs_input_grad[0]
        grad = torch.empty_like(hidden) if want_grad else None
        scale = 1 / denominator
        kernel = _kernel(hidden.device)
        if kernel:
            from kit.recipe.levers import loss_kernel

            a = hidden.element_size()
            chunk = max(1, chunk * (2 * a + 4) // a)
        for start in range(0, hidden.shape[0], chunk):
            part = slice(start, start + chunk)
            if kernel:  # the gradient over the logits, in place
                probs = F.linear(hidden[part], weight)
                total += loss_kernel.rows(probs, target[part], scale, ignore_index,
                                          want_grad).sum()
            else:
                loss, probs = _chunk_eager(F.linear(hidden[part], weight), target[part],
                                           ignore_index, scale, want_grad)
                total += loss
            if grad is not None:
                torch.matmul(probs.to(hidden.dtype), weight, out=grad[part])
        ctx.save_for_backward(grad)
        return total / denominator

    @staticmethod
    def backward(ctx, grad_output):
        (grad,) = ctx.saved_tensors
        return grad * grad_output.to(grad.dtype), None, None, None, None, None


def fused_causal_lm_loss(
    logits: torch.Tensor,
    labels: torch.Tensor,
    vocab_size: int,
    num_items_in_batch: torch.Tensor | int | None = None,
    ignore_index: int = -100,
    shift_labels: torch.Tensor | None = None,
    *,
    head: torch.nn.Linear,
    **kwargs: object,
) -> torch.Tensor:
    """transformers' ForCausalLMLoss with the output head inside: it takes the hidden states the
    head was given in training (see `install`); after a plain forward (evaluation, no gradient)
    it is the chunked loss of the real logits."""
    hidden = head.__dict__.pop("_kit_hidden", None)
    if hidden is None:
        return chunked_causal_lm_loss(logits, labels, vocab_size, num_items_in_batch,
                                      ignore_index, shift_labels, **kwargs)
    hidden = hidden.reshape(-1, hidden.shape[-1])
    target, denominator = _targets(labels, shift_labels, ignore_index, num_items_in_batch,
                                   hidden.device)
    chunk = max(1, FUSED_CHUNK_LOGITS // vocab_size)
    return _HeadAndLoss.apply(hidden, head.weight, target, ignore_index, denominator, chunk)


def _deferred_head(self, hidden: torch.Tensor) -> torch.Tensor:
    """The output head's forward under training.loss=fused: in training with gradients, keep the
    hidden states for the loss, which applies the head itself, and return no logits (an empty
    tensor: the model's output then holds none); otherwise the plain head."""
    if self.training and torch.is_grad_enabled():
        self._kit_hidden = hidden
        return hidden.new_empty(0)
    return F.linear(hidden, self.weight)


def install(model, kind: str) -> None:
    """Set the loss of a transformers model (or the one inside a PEFT model) by config name."""
    import functools
    import types

    from kit.config import ConfigError
    from kit.inputs import sources

    if kind == "hf":
        return
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    if kind == "chunked":
        inner.loss_function = chunked_causal_lm_loss
        return
    # The check step refuses this from config.json before start (kit.inputs.sources); a model
    # built another way (a notebook, a test) is refused here, in the same line.
    if transforms := sources.logit_transforms(inner.config.to_dict()):
        raise ConfigError(sources.fused_loss_refusal(transforms))
    head = inner.get_output_embeddings()
    if type(head) is not torch.nn.Linear or head.bias is not None or head.weight.requires_grad:
        raise ConfigError(
            f"training.loss: 'fused' is not allowed for this model; it needs a frozen output head "
            f"without bias (found {type(head).__name__}, trainable="
            f"{getattr(getattr(head, 'weight', None), 'requires_grad', '?')}); allowed: hf, chunked"
        )
    head.forward = types.MethodType(_deferred_head, head)
    inner.loss_function = functools.partial(fused_causal_lm_loss, head=head)
