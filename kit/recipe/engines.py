"""One object per sharding engine: FSDP2 (`fully_shard`), FSDP1 (`FullyShardedDataParallel`), DDP.

    engine = engines.get(cfg.sharding.engine)
    wrapped = engine.wrap(peft_model, cfg, device)
    with engine.no_sync(wrapped, active=micro < accum - 1): ...
    norm = engine.clip_grad_norm(wrapped, max_norm)

Everything that differs between the engines is asked of this object: how it wraps the model, how it
skips the gradient reduction on accumulation steps, how it clips, what dtype the adapters need
(`adapter_dtype`), and the state-dict options that gather or save the trainable weights
(`state_dict_options`). The recipe, kit.recipe.lora and kit.recipe.checkpoint never switch on the engine's name.
Rank side.
"""

from __future__ import annotations

import contextlib
import functools

import torch
from torch import nn

from kit.config import Config
from kit.recipe import loading
from kit.recipe.layers import decoder_layer_classes, decoder_layers
from kit.recipe.quantize import DTYPES


class Engine:
    name = ""

    def check(self, cfg: Config, world_size: int) -> None:
        """Raise ConfigError (one line) for what this engine cannot run with `world_size`
        processes: the recipe asks right after joining the process group, before loading."""

    def wrap(self, model: nn.Module, cfg: Config, device: torch.device) -> nn.Module:
        raise NotImplementedError

    @contextlib.contextmanager
    def no_sync(self, wrapped: nn.Module, active: bool):
        """Skip the gradient reduction on accumulation micro-steps (all but the last)."""
        if not active:
            yield
        else:
            with wrapped.no_sync():
                yield

    def clip_grad_norm(self, wrapped: nn.Module, max_norm: float) -> torch.Tensor:
        """Clip (max_norm > 0) and return the global gradient norm as a tensor on the device
        (reading it waits for the GPU: read it after queuing the optimizer step)."""
        from kit.recipe import optim  # FSDP2's DTensors: from the local shards (the host time)

        params = [p for p in wrapped.parameters() if p.grad is not None]
        return optim.clip_grad_norm(params, max_norm if max_norm > 0 else float("inf"))

    def adapter_dtype(self, cfg: Config) -> torch.dtype:
        """The LoRA weights' dtype: lora.dtype, or with "auto" float32 (exact optimizer updates)."""
        return torch.float32 if cfg.lora.dtype == "auto" else DTYPES[cfg.lora.dtype]

    def state_dict_options(self, *, full: bool, device: torch.device):
        """torch.distributed.checkpoint's options for saving the trainable weights and their
        optimizer state: `full` gathers them whole (to the CPU on GPUs), else each rank keeps
        its shard."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions

        return StateDictOptions(full_state_dict=full, ignore_frozen_params=True,
                                cpu_offload=full and device.type == "cuda")


class FSDP2(Engine):
    """Per-parameter sharding: each decoder layer, the input embeddings, then the root."""

    name = "fsdp2"

    def __init__(self, frozen_alone: bool = True):
        self.frozen_alone = frozen_alone  # on one rank (frozen_of); False: as torch wraps it

    def wrap(self, model, cfg, device):
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

        s = cfg.sharding
        mesh = init_device_mesh(device.type, (dist.get_world_size(),))
        dtype = DTYPES[cfg.model.dtype]
        kwargs = dict(mesh=mesh, reshard_after_forward=s.reshard_after_forward)
        alone = self.frozen_alone and dist.get_world_size() == 1 and not s.cpu_offload
        frozen = frozen_of if alone else lambda m: None
        if s.mixed_precision and dtype != torch.float32:
            # Gather and compute in the model dtype; reduce (and keep the optimizer's copy) in fp32.
            kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
        if s.cpu_offload:
            kwargs["offload_policy"] = CPUOffloadPolicy()
        # model.loading=stream: the model is still on the meta device; each unit is read (or
        # initialised) just before it is sharded, so a rank holds its shards plus one unit.
        fill = getattr(loading.streamer_of(model), "fill", lambda unit: None)
        for layer in decoder_layers(model):
            fill(layer)
            fully_shard(layer, **kwargs, ignored_params=frozen(layer))
            keep_quant_state(layer)
        embeddings, head = model.get_input_embeddings(), model.get_output_embeddings()
        if head is None or head.weight is not embeddings.weight:
            # A unit of its own: gathered for the first operation only. In the root it would stay
            # gathered until the end of backward (FSDP2 never reshards the root after forward),
            # at the peak of memory: 1 GiB for a 128k x 4,096 vocabulary. Tied to the head, it
            # stays there.
            fill(embeddings)
            fully_shard(embeddings, **kwargs, ignored_params=frozen(embeddings))
        fill(model)
        # The root (final norm, output head, tied embeddings) stays gathered from the end of
        # forward into backward: its first use there is the head's, right after the loss, which
        # needs it gathered anyway; resharding it in between would gather it twice per step.
        fully_shard(model, **{**kwargs, "reshard_after_forward": False},
                    ignored_params=frozen(model))
        # Backward ends at the first layer. Left implicit, FSDP2 prefetches there the unit that
        # ran before it in forward, the embeddings, which backward never reaches (they are
        # frozen; kit.recipe.recompute drops transformers' hook that made their output need a
        # gradient): a whole table gathered each step for nothing (notebook 04 counts the
        # gathers). An explicit list replaces the implicit choice; an empty one does not, so
        # the first layer names itself, already gathered there.
        first = decoder_layers(model)[0]
        first.set_modules_to_backward_prefetch([first])
        return model

    @contextlib.contextmanager
    def no_sync(self, wrapped, active):
        if not active:
            yield
            return
        wrapped.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            wrapped.set_requires_gradient_sync(True)


class FSDP1(Engine):
    """FlatParameter FSDP, as the well-known articles use it: one flat buffer per decoder layer."""

    name = "fsdp1"

    def wrap(self, model, cfg, device):
        import torch.distributed as dist
        from torch.distributed.fsdp import (
            BackwardPrefetch,
            CPUOffload,
            MixedPrecision,
            ShardingStrategy,
        )
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
        from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy

        self.check(cfg, dist.get_world_size())
        s = cfg.sharding
        # model.loading=stream: the model is still on the meta device; FSDP1 calls param_init_fn
        # on each unit's modules (decoder layers first, then the root's rest) just before it
        # flattens and shards them, so a rank holds its shards plus one unit.
        source = loading.streamer_of(model)
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
            param_init_fn=source.fill if source is not None else None,
            # On CPU FSDP1 needs the device named, else "FSDP needs a non-CPU accelerator device".
            device_id=device,
        )

    def check(self, cfg, world_size):
        # The config cannot know the world size; the check step and a rank can (kit.pitfalls).
        from kit.config import ConfigError
        from kit.pitfalls import get

        violation = get("fsdp1_no_shard").machine(cfg, {"ranks": world_size})
        if violation:
            raise ConfigError(str(violation))

    def clip_grad_norm(self, wrapped, max_norm):
        return wrapped.clip_grad_norm_(max_norm if max_norm > 0 else float("inf"))

    def adapter_dtype(self, cfg):
        """FSDP1 flattens one dtype per unit: "auto" adapters take model.dtype."""
        return DTYPES[cfg.model.dtype if cfg.lora.dtype == "auto" else cfg.lora.dtype]

    def state_dict_options(self, *, full, device):
        # cpu_offload makes FSDP1 gather to rank 0 only, and get_model_state_dict then fails on
        # the other ranks while dropping frozen keys (KeyError, torch 2.11, 2x H200): FSDP1
        # gathers the (small, trainable-only) state on every device instead, and rank 0 moves it
        # to the CPU.
        from torch.distributed.checkpoint.state_dict import StateDictOptions

        return StateDictOptions(full_state_dict=full, ignore_frozen_params=True, cpu_offload=False)


class DDP(Engine):
    """Every rank holds the whole model; gradients are all-reduced (for models that fit one
    device)."""

    name = "ddp"

    def wrap(self, model, cfg, device):
        from torch.nn.parallel import DistributedDataParallel

        return DistributedDataParallel(
            model, device_ids=[device.index] if device.type == "cuda" else None
        )


ENGINES: dict[str, Engine] = {e.name: e for e in (FSDP2(), FSDP1(), DDP())}


def frozen_of(module: nn.Module) -> set[nn.Parameter]:
    """The parameters of `module` that take no gradient: what FSDP2 leaves alone (ignored_params)
    on a group of one. There it has nothing to shard, yet each gather copies every parameter of
    the unit, one copy call each (torch's one-rank path), in forward and again in backward:
    2 x 23 copies a Llama layer a step, on the host's critical path where the host queues the
    GPU's work (the 4-bit weights, norms and router: no gradient, no cast; they stay as loaded).
    The adapters keep FSDP2's mixed precision (their bf16 copy is that cast) and reduction.
    Not with cpu_offload, which keeps every parameter in host memory."""
    return {p for p in module.parameters() if not p.requires_grad}


def get(name: str) -> Engine:
    """The engine object for sharding.engine `name`."""
    return ENGINES[name]


def keep_quant_state(layer: nn.Module) -> int:
    """Give FSDP2's gathered 4-bit weights their quantization state before each forward.

    FSDP2 gathers a plain Parameter in place of bitsandbytes' Params4bit, so every Linear4bit
    forward finds no `quant_state` on its weight and wraps it in a new Params4bit (bitsandbytes'
    FSDP fix-up, which sets `.data`). That is cheap in eager mode, but torch.compile cannot trace
    it: each 4-bit linear layer breaks the compiled decoder layer into pieces (no fusion across
    them, no recompute choices across them). This pre-forward hook, which runs after FSDP2's
    gather, puts the module's state on the gathered weight, so the fix-up returns at once.
    Returns the number of 4-bit layers covered."""
    try:
        from bitsandbytes.nn import Linear4bit
    except ImportError:
        return 0
    quantized = [m for m in layer.modules() if isinstance(m, Linear4bit)]
    if not quantized:
        return 0

    def attach(module, args):
        for m in quantized:
            if getattr(m.weight, "quant_state", None) is None:
                m.weight.quant_state = m.quant_state

    layer.register_forward_pre_hook(attach)
    return len(quantized)
