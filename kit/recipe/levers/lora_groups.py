"""lora.group_inputs: adapters that read one input run as a group (rank side; opt-in).

    enable(peft_model, recompute=False)   # q/k/v and gate/up: one dropout, one down-projection

In a decoder layer q, k and v read the same normed hidden state, and so do the MLP's gate and up
projections. PEFT adapts each linear layer on its own: each draws its own dropout mask over that
input, writes its own dropped copy, and runs its own (tokens x hidden) @ (hidden x r)
down-projection, which reads the whole input again; backward adds up the three input gradients.
Grouped, the input is dropped once and multiplied once by the members' down-projections stacked
(hidden x 3r); the result is split, and each member's up-projection and scale stay its own. The
adapters are the same parameters with the same keys: saving, loading and merging are PEFT's.

It changes what is learned, a little: the members share one dropout mask instead of drawing
three (with lora.dropout=0 the result is the same up to the order of additions). That is why it
is opt-in, with its loss difference measured: within two seeds' noise on a real model
(`benchmarks/records/2026-11-24-levers-learning-smollm2-cpu`); +4-5% speed in bf16, +7% with FP8
(`2026-11-24-grouped-adapters-8b-1xh100`).

How: a forward pre-hook on the module that owns the group (attention, MLP) computes the group's
r-wide down-projections from its input and attaches them to that input tensor; a member called
with that very tensor adds its up-projection to the base layer's output in one matmul
(kit.recipe.lora_down.add_up), and otherwise runs as before. With recompute=True
(lora.recompute) the group's down-projection runs under torch.utils.checkpoint, as
kit.recipe.lora.recompute_adapters does per adapter.

Gap filled: PEFT has no grouped LoRA forward for projections that share an input.
"""

from __future__ import annotations

import types

import torch

from kit.budget.shapes import NO_SHARED_INPUT
from kit.budget.shapes import (
    SHARED_INPUT_GROUPS as GROUPS,  # q/k/v, gate/up: as the estimate counts
)
from kit.config import ConfigError


def group_lows(x, downs, p: float, training: bool,
               fused: bool = False) -> tuple[tuple[torch.Tensor, ...], float]:
    """Each member's r-wide A(dropout(x)), with one dropout mask and one matmul for every
    member's A (fused: the mask inside that matmul's kernel, kit.recipe.lora_down), and the
    factor the up-projections take for dropout (1/(1-p) where the lows are not rescaled, else
    1): each member adds its own B part * scale * factor (kit.recipe.lora_down.add_up). Tensors
    and numbers only: torch.compile traces it once for every layer."""
    p = p if training else 0.0
    if fused:
        from kit.recipe import lora_down

        return lora_down.lows(x, downs, p), 1 / (1 - p)
    x = x.to(downs[0].dtype)
    if p > 0:
        x = torch.nn.functional.dropout(x, p, True)
    low = torch.nn.functional.linear(x, torch.cat(downs))
    return low.split([d.shape[0] for d in downs], dim=-1), 1.0


def _dropout_p(member, name: str) -> float:
    drop = member.lora_dropout[name]
    return drop.p if isinstance(drop, torch.nn.Dropout) else 0.0


def _grouped(members) -> str | None:
    """The one active adapter that every member runs plainly now, or None (then each member
    runs its own forward)."""
    first = members[0]
    names = first.active_adapters
    if len(names) != 1:
        return None
    name = names[0]
    for m in members:
        if m.disable_adapters or m.merged or name not in m.lora_A:
            return None
    return name


def _pre_hook(module, args, kwargs):
    x = args[0] if args else kwargs.get("hidden_states", kwargs.get("x"))
    if x is None or not torch.is_grad_enabled():
        return None
    pending = []
    for members in module._kit_lora_groups:
        name = _grouped(members)
        if name is None:
            continue
        downs = [m.lora_A[name].weight for m in members]
        p, training = _dropout_p(members[0], name), members[0].training
        fused = getattr(members[0], "_kit_fused_down", False)
        if module._kit_lora_recompute:
            from torch.utils.checkpoint import checkpoint

            parts, factor = checkpoint(group_lows, x, downs, p, training, fused,
                                       use_reentrant=False)
        else:
            parts, factor = group_lows(x, downs, p, training, fused)
        pending.extend((m, (part, m.lora_B[name].weight, m.scaling[name] * factor))
                       for m, part in zip(members, parts, strict=True))
    # The r-wide parts travel on the input tensor itself, which the layer's forward created: inside a
    # compiled layer under selective recompute (a higher-order op), torch.compile refuses to
    # mutate anything made outside it, such as the modules.
    x._kit_lora_pending = pending
    return None


def _member_forward(self, x, *args, **kwargs):
    pending = getattr(x, "_kit_lora_pending", None)
    branch = None
    if pending and kwargs.get("adapter_names") is None:
        for i, (member, b) in enumerate(pending):
            if member is self:
                branch = b
                pending.pop(i)  # freed once used: the input may live on until backward
                break
    if branch is None:
        return self._kit_own_forward(x, *args, **kwargs)
    from kit.recipe.lora_down import add_up

    return add_up(self.base_layer(x, *args, **kwargs), *branch)


def enable(peft_model, recompute: bool = False) -> int:
    """Group every set of adapted projections in GROUPS whose adapters have one dropout rate;
    returns how many groups. Call after kit.recipe.lora.recompute_adapters (a member's own forward
    stays the fallback). A model with no such group is refused in one line."""
    from peft.tuners.lora import LoraLayer

    count = 0
    for module in peft_model.modules():
        groups = []
        for names in GROUPS:
            members = [getattr(module, n, None) for n in names]
            if not all(isinstance(m, LoraLayer) and hasattr(m, "lora_A") for m in members):
                continue
            if any(getattr(m, "lora_variant", None) for m in members):
                raise ConfigError("lora.group_inputs: True is not allowed with DoRA or other "
                                  "LoRA variants; allowed: false")
            if len({_dropout_p(m, k) for m in members for k in m.lora_dropout}) != 1:
                continue
            for m in members:
                m._kit_own_forward = m.forward
                m.forward = types.MethodType(_member_forward, m)
            groups.append(members)
        if groups:
            module._kit_lora_groups, module._kit_lora_recompute = groups, recompute
            module.register_forward_pre_hook(_pre_hook, with_kwargs=True)
            count += len(groups)
    if count == 0:
        raise ConfigError(NO_SHARED_INPUT)
    return count
