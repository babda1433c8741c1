"""The optimizer step and gradient clipping on each rank's own shard (FSDP2's DTensors).

    optimizer = ShardAdamW(params, lr=2e-4, weight_decay=0.0)   # torch's AdamW, same state
    norm = clip_grad_norm(params, max_norm=1.0)                 # torch's clip_grad_norm_, same norm

Under FSDP2 every trainable parameter and its gradient is a DTensor. torch's AdamW and
clip_grad_norm_ accept them, but each list operation they issue (a dozen per step, over all the
adapters' tensors) goes through DTensor's dispatch, which works out the sharding of every tensor
of the list in Python. With LoRA there are many small tensors (448 at the 8B shape, r 16 on all
linear layers), so the host spends tens of milliseconds per step there while the GPU, which
finished backward, waits: measured on one H100 (benchmarks/tools/host_lead.py,
benchmarks/records/2026-11-27-step-profile-levers-8b-1xh100), clipping took 32 ms and the optimizer step 39 ms of a
907 ms step, with the GPU idle throughout.

Both functions here run the same arithmetic on each DTensor's local shard instead (the shards are
plain tensors that share the DTensors' storage): the optimizer through torch's own functional
Adam (`torch.optim.adam.adam`, decoupled weight decay: AdamW), the norm as the sum of the shards'
squared norms, all-reduced over the mesh. The optimizer's state is torch's AdamW's, key for key
and DTensor for DTensor, so checkpoints (torch.distributed.checkpoint's optimizer state dict)
save and load as before. Plain tensors (DDP, one process) take torch's own path unchanged.

Gap filled: torch has no optimizer or clipping path that skips DTensor's per-tensor dispatch
for a list of sharded parameters.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.optim.adam import adam as _adam


def _sharded(tensors) -> bool:
    """Every tensor a DTensor sharded (Shard placements only) over one 1-D device mesh."""
    from torch.distributed.tensor import DTensor, Shard

    meshes = set()
    for t in tensors:
        if not isinstance(t, DTensor) or not all(isinstance(p, Shard) for p in t.placements):
            return False
        meshes.add(id(t.device_mesh))
    return len(meshes) == 1 and tensors[0].device_mesh.ndim == 1


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard. Its attribute, not `to_local()`: that one is an autograd function,
    ~16 us of host time per call, as long as the arithmetic it saves for a small adapter."""
    return getattr(t, "_local_tensor", t)


class ShardAdamW(torch.optim.AdamW):
    """torch.optim.AdamW whose step works on each parameter's local shard when the parameters
    are FSDP2's DTensors: the same update, the same state (step, exp_avg, exp_avg_sq), the host
    time of plain tensors. Only the options the kit uses (lr, betas, eps, weight_decay)."""

    @torch.no_grad()
    def step(self, closure=None):
        groups = [(g, [p for p in g["params"] if p.grad is not None]) for g in self.param_groups]
        if not all(_sharded(ps) and not (g["amsgrad"] or g["maximize"] or g["differentiable"]
                                         or g["capturable"] or g["fused"])
                   for g, ps in groups if ps):
            return super().step(closure)  # plain tensors, or options torch's own path handles
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group, params in groups:
            if not params:
                continue
            steps, avgs, sqs = [], [], []
            for p in params:
                state = self.state[p]
                if not state:  # as torch's AdamW initialises it (a float32 step on the host)
                    state["step"] = torch.tensor(0.0, dtype=torch.float32)
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                steps.append(state["step"])
                avgs.append(_local(state["exp_avg"]))
                sqs.append(_local(state["exp_avg_sq"]))
            beta1, beta2 = group["betas"]
            _adam(
                [_local(p) for p in params], [_local(p.grad) for p in params], avgs, sqs, [], steps,
                foreach=group["foreach"], decoupled_weight_decay=True,
                amsgrad=False, beta1=beta1, beta2=beta2, lr=group["lr"],
                weight_decay=group["weight_decay"], eps=group["eps"], maximize=False)
        return loss


def clip_grad_norm(params, max_norm: float) -> torch.Tensor:
    """torch.nn.utils.clip_grad_norm_ (the 2-norm over all gradients, then each scaled by
    max_norm / (norm + 1e-6) when that is below 1); returns the norm as a plain tensor on the
    device. FSDP2's sharded gradients: from the local shards and one all-reduce."""
    grads = [p.grad for p in params if p.grad is not None]
    if not grads or not _sharded(grads):
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
        return norm.full_tensor() if hasattr(norm, "full_tensor") else norm
    local = [_local(g) for g in grads]
    squares = torch.stack(torch._foreach_norm(local, 2.0)).float().pow(2).sum()
    dist.all_reduce(squares, group=grads[0].device_mesh.get_group())
    norm = squares.sqrt()
    if max_norm != float("inf"):
        scale = (max_norm / (norm + 1e-6)).clamp(max=1.0)
        torch._foreach_mul_(local, scale.to(local[0].dtype))
    return norm


def scheduler(optimizer, t):
    """transformers' learning-rate schedule for training config `t` (warmup, then t.scheduler)."""
    from transformers import get_scheduler

    name = {"cosine": "cosine", "linear": "linear", "constant": "constant_with_warmup"}
    return get_scheduler(name[t.scheduler], optimizer, num_warmup_steps=t.warmup_steps,
                         num_training_steps=t.steps)
