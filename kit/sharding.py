"""Sharding the PEFT model: FSDP2 (`fully_shard`), FSDP1 (`FullyShardedDataParallel`) or DDP.

The wrapping unit is the model's own decoder layer (kit.layers: the classes it names in
`_no_split_modules`), so any causal LM works without naming LlamaDecoderLayer anywhere.
"""

from __future__ import annotations

import contextlib
import functools

import torch
from torch import nn

from kit.config import Config
from kit.layers import decoder_layer_classes, decoder_layers
from kit.quantize import DTYPES


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
        keep_quant_state(layer)
    embeddings, head = model.get_input_embeddings(), model.get_output_embeddings()
    if head is None or head.weight is not embeddings.weight:
        # A unit of its own: gathered for the first operation only. In the root it would stay
        # gathered until the end of backward (FSDP2 never reshards the root after forward), at the
        # peak of memory: 1 GiB for a 128k x 4,096 vocabulary. Tied to the head, it stays there.
        fully_shard(embeddings, **kwargs)
    fully_shard(model, **kwargs)  # the root: final norm, output head (and tied embeddings)
    return model


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


def clip_grad_norm(wrapped: nn.Module, engine: str, max_norm: float) -> torch.Tensor:
    """Clip (max_norm > 0) and return the global gradient norm, whatever the engine, as a
    tensor on the device (reading it waits for the GPU: read it after queuing the step)."""
    limit = max_norm if max_norm > 0 else float("inf")
    if engine == "fsdp1":
        return wrapped.clip_grad_norm_(limit)
    params = [p for p in wrapped.parameters() if p.grad is not None]
    norm = torch.nn.utils.clip_grad_norm_(params, limit)
    return norm.full_tensor() if hasattr(norm, "full_tensor") else norm  # FSDP2: a DTensor


# --------------------------------------------------------------------------- what each rank holds (04)
#
#   torchrun --nproc_per_node=2 -m kit.sharding --report OUT [--engines fsdp2,fsdp1,ddp] [key=value]
#
# Builds the model exactly as the recipe does (load -> LoRA -> checkpointing -> train() -> shard),
# once per engine, runs one forward/backward, and writes OUT/<engine>/rank<R>.json: every
# parameter's full shape and the piece this rank holds, the compute dtypes seen inside forward,
# the gradients' local shapes. The notebook reads these files; it never joins the group itself.


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t  # FSDP2 parameters are DTensors


def _bytes(t) -> int:
    return t.numel() * t.element_size()


def wrapped_units(model: nn.Module) -> list[str]:
    """Names of the modules an FSDP engine made into sharding units ('' is the root)."""
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    from kit.checkpoint import clean_name

    return [clean_name(n) for n, m in model.named_modules() if isinstance(m, (FSDPModule, FSDP))]


def quant_constant_bytes(model: nn.Module) -> int:
    """Bytes of bitsandbytes' quantization constants (not parameters: FSDP never shards them)."""
    import bitsandbytes as bnb

    from kit.quantize import state_bytes

    total = 0
    for m in model.modules():
        if isinstance(m, bnb.nn.Linear4bit):
            state = getattr(m.weight, "quant_state", None) or getattr(m, "quant_state", None)
            total += state_bytes(state) if state is not None else 0
    return total


def held(model: nn.Module) -> dict[str, dict]:
    """Per parameter (clean name): the shape, dtype and bytes this rank holds, and its grad's."""
    from kit.checkpoint import clean_name

    rows = {}
    for name, p in model.named_parameters():
        local, grad = _local(p), p.grad
        rows[clean_name(name)] = {
            "shape": list(local.shape), "dtype": str(local.dtype).removeprefix("torch."),
            "bytes": _bytes(local), "trainable": p.requires_grad,
            "grad_shape": None if grad is None else list(_local(grad).shape),
            "grad_dtype": None if grad is None else str(grad.dtype).removeprefix("torch."),
        }  # fmt: skip
    return rows


def _seen_in_forward(model: nn.Module) -> tuple[dict, list]:
    """Forward pre-hooks on the first LoRA A and the first norm: the dtypes compute really uses."""
    seen: dict[str, str] = {}
    lora_a = next(m for n, m in model.named_modules() if n.endswith("lora_A.default"))
    norm = next(m for n, m in model.named_modules() if n.endswith("input_layernorm"))

    def hook(label):
        def record(module, args):
            seen.setdefault(f"{label} weight", str(module.weight.dtype).removeprefix("torch."))
            seen.setdefault(f"{label} input", str(args[0].dtype).removeprefix("torch."))

        return record

    handles = [lora_a.register_forward_pre_hook(hook("LoRA A")),
               norm.register_forward_pre_hook(hook("RMSNorm"))]  # fmt: skip
    return seen, handles


def report_rank(cfg: Config, env, out) -> dict:
    """One engine on this rank: before sharding, after, and after one forward/backward."""
    from kit import lora, quantize
    from kit.recompute import enable_activation_checkpointing

    model, _ = quantize.load_model(cfg, env.device)
    peft_model = lora.apply_lora(model, cfg)
    if cfg.training.recompute.enabled:
        enable_activation_checkpointing(peft_model)
    peft_model.train()
    before = held(peft_model)
    quant_bytes = quant_constant_bytes(peft_model)
    layer_classes = sorted(c.__name__ for c in decoder_layer_classes(peft_model))
    wrapped = shard(peft_model, cfg, env.device)
    after = held(wrapped)
    seen, handles = _seen_in_forward(wrapped)
    ids = torch.arange(2 * 16, device=env.device).reshape(2, 16) % 100 + 3
    wrapped(input_ids=ids, labels=ids).loss.backward()
    for h in handles:
        h.remove()
    grads = held(wrapped)
    return {
        "engine": cfg.sharding.engine, "rank": env.rank, "world_size": env.world_size,
        "units": wrapped_units(wrapped),
        "decoder_layer_classes": layer_classes,
        "quant_constant_bytes": quant_bytes,
        "params": {n: {"full_shape": before[n]["shape"], "full_bytes": before[n]["bytes"],
                       **after.get(n, {}), "grad_shape": grads.get(n, {}).get("grad_shape"),
                       "grad_dtype": grads.get(n, {}).get("grad_dtype")}
                   for n in before},
        "seen_in_forward": seen,
    }  # fmt: skip


def _report_main(argv: list[str]) -> int:
    import argparse
    import json
    import os
    from pathlib import Path

    import torch.distributed as dist

    from kit import builtin
    from kit import dist as kdist
    from kit.config import load_config

    parser = argparse.ArgumentParser(prog="python -m kit.sharding")
    parser.add_argument("--report", required=True, help="folder for <engine>/rank<R>.json")
    parser.add_argument("--engines", default="fsdp2,fsdp1,ddp")
    parser.add_argument("--config", default=str(Path(__file__).parent / "configs" / "tiny-cpu.yaml"))
    parser.add_argument("overrides", nargs="*", help="config key=value")
    args = parser.parse_args(argv)
    cfgs = [load_config(args.config, [*args.overrides, f"sharding.engine={e}"])
            for e in args.engines.split(",")]  # fmt: skip
    env = kdist.init(cfgs[0].training.device, cfgs[0].run.dist_timeout_min)
    try:
        with kdist.main_process_first(env):
            builtin.resolve(cfgs[0].model.name)
        for cfg in cfgs:
            torch.manual_seed(cfg.training.seed)
            row = report_rank(cfg, env, args.report)
            folder = Path(args.report) / cfg.sharding.engine
            os.makedirs(folder, exist_ok=True)
            (folder / f"rank{env.rank}.json").write_text(json.dumps(row, indent=1))
            dist.barrier()
    finally:
        kdist.cleanup()
    return 0


# --------------------------------------------------------------------------- kernel side (04)


def launch_report(out, engines=("fsdp2", "fsdp1", "ddp"), nproc: int = 2,
                  overrides: list[str] | None = None) -> dict:  # fmt: skip
    """Run the report under torchrun (separate processes) and read it back."""
    from pathlib import Path

    from kit.torchrun import torchrun

    out = Path(out).resolve()
    torchrun("kit.sharding", "--report", str(out), "--engines", ",".join(engines),
             *(overrides or []), nproc=nproc)  # fmt: skip
    found = read_report(out)
    return {engine: found[engine] for engine in engines}


def read_report(out) -> dict[str, list[dict]]:
    """{engine: [rank 0's report, rank 1's, ...]}"""
    import json
    from pathlib import Path

    found = {}
    for folder in sorted(Path(out).iterdir()):
        ranks = sorted(folder.glob("rank*.json"), key=lambda p: int(p.stem[4:]))
        if ranks:
            found[folder.name] = [json.loads(p.read_text()) for p in ranks]
    return found


def shard_table(ranks: list[dict], *contains: str) -> list[dict]:
    """Per parameter whose name contains any of `contains` (all if none): its full shape and the
    shape each rank holds (one engine's report)."""
    params = ranks[0]["params"]
    rows = []
    for name, p in params.items():
        if contains and not any(c in name for c in contains):
            continue
        row = {"param": name.removeprefix("base_model.model."), "dtype": p["dtype"],
               "full": tuple(p["full_shape"])}  # fmt: skip
        for r in ranks:
            row[f"rank {r['rank']}"] = tuple(r["params"][name]["shape"])
        rows.append(row)
    return rows


def bytes_per_rank(ranks: list[dict]) -> list[dict]:
    """What each rank holds, in bytes: frozen params, trainable params, quantization constants."""
    rows = []
    for r in ranks:
        ps = r["params"].values()
        rows.append({
            "rank": r["rank"],
            "frozen": sum(p["bytes"] for p in ps if not p["trainable"]),
            "trainable": sum(p["bytes"] for p in ps if p["trainable"]),
            "quant constants": r["quant_constant_bytes"],
            "full model": sum(p["full_bytes"] for p in ps),
        })  # fmt: skip
    return rows


if __name__ == "__main__":
    import sys

    sys.exit(_report_main(sys.argv[1:]))
