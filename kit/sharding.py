"""Sharding the PEFT model: FSDP2 (`fully_shard`), FSDP1 (`FullyShardedDataParallel`) or DDP.

The wrapping unit is the model's own decoder-layer class, read from `_no_split_modules` (what
transformers itself refuses to split across devices), so any causal LM works without naming
LlamaDecoderLayer anywhere.
"""

from __future__ import annotations

import contextlib
import functools

import torch
from torch import nn

from kit.config import Config
from kit.quantize import DTYPES


def decoder_layer_classes(model: nn.Module) -> set[type]:
    names: set[str] = set()
    for m in model.modules():
        names.update(getattr(m, "_no_split_modules", None) or [])
    classes = {type(m) for m in model.modules() if type(m).__name__ in names}
    if not classes:
        raise ValueError(
            f"model.name: {type(model).__name__} declares no _no_split_modules found in it; "
            "the kit cannot tell its decoder layers apart"
        )
    return classes


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    classes = tuple(decoder_layer_classes(model))
    return [m for m in model.modules() if isinstance(m, classes)]


def shard(model: nn.Module, cfg: Config, device: torch.device) -> nn.Module:
    """Return the model wrapped for training by cfg.sharding.engine."""
    engine = cfg.sharding.engine
    if engine == "fsdp2":
        return _fsdp2(model, cfg, device)
    if engine == "fsdp1":
        return _fsdp1(model, cfg, device)
    from torch.nn.parallel import DistributedDataParallel as DDP

    return DDP(model, device_ids=[device.index] if device.type == "cuda" else None)


def _fsdp2(model, cfg, device):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    s = cfg.sharding
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    dtype = DTYPES[cfg.model.dtype]
    kwargs = dict(mesh=mesh, reshard_after_forward=s.reshard_after_forward)
    if s.mixed_precision and dtype != torch.float32:
        # Gather and compute in the model dtype; reduce (and keep the optimizer's copy) in fp32.
        kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
    if s.cpu_offload:
        kwargs["offload_policy"] = CPUOffloadPolicy()
    for layer in decoder_layers(model):
        fully_shard(layer, **kwargs)
    fully_shard(model, **kwargs)  # the root: embeddings, final norm, output head
    return model


def _fsdp1(model, cfg, device):
    from torch.distributed.fsdp import (
        BackwardPrefetch,
        CPUOffload,
        MixedPrecision,
        ShardingStrategy,
    )
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy

    s = cfg.sharding
    dtype = DTYPES[cfg.model.dtype]
    mp = None
    if s.mixed_precision and dtype != torch.float32:
        mp = MixedPrecision(param_dtype=dtype, reduce_dtype=dtype, buffer_dtype=dtype)
    return FSDP(
        model,
        auto_wrap_policy=functools.partial(
            transformer_auto_wrap_policy, transformer_layer_cls=decoder_layer_classes(model)
        ),
        sharding_strategy=ShardingStrategy[s.strategy],
        mixed_precision=mp,
        cpu_offload=CPUOffload(offload_params=s.cpu_offload),
        backward_prefetch=None
        if s.backward_prefetch == "none"
        else BackwardPrefetch[s.backward_prefetch],
        forward_prefetch=s.forward_prefetch,
        use_orig_params=s.use_orig_params,
        sync_module_states=s.sync_module_states,
        limit_all_gathers=s.limit_all_gathers,
        # On CPU FSDP1 needs the device named, else "FSDP needs a non-CPU accelerator device".
        device_id=device,
    )


@contextlib.contextmanager
def no_grad_sync(wrapped: nn.Module, engine: str, active: bool):
    """Skip the gradient reduction on accumulation micro-steps (all but the last)."""
    if not active:
        yield
    elif engine == "fsdp2":
        wrapped.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            wrapped.set_requires_gradient_sync(True)
    else:
        with wrapped.no_sync():
            yield


def clip_grad_norm(wrapped: nn.Module, engine: str, max_norm: float) -> float:
    """Clip (max_norm > 0) and return the global gradient norm, whatever the engine."""
    limit = max_norm if max_norm > 0 else float("inf")
    if engine == "fsdp1":
        norm = wrapped.clip_grad_norm_(limit)
    else:
        params = [p for p in wrapped.parameters() if p.grad is not None]
        norm = torch.nn.utils.clip_grad_norm_(params, limit)
        if hasattr(norm, "full_tensor"):  # FSDP2: a DTensor
            norm = norm.full_tensor()
    return float(norm)
