"""Sharding the PEFT model, and what each rank then holds (notebook 04).

    wrapped = shard(peft_model, cfg, device)      # kit.recipe.engines: FSDP2, FSDP1 or DDP
    report = launch_report("launch/nb04")         # per engine and rank: shapes, dtypes, bytes

The engines themselves (how each wraps, skips gradient sync, clips, and which adapter dtype and
state-dict options it needs) are objects in kit/recipe/engines.py. The wrapping unit is the model's own
decoder layer (kit.recipe.layers: the classes it names in `_no_split_modules`), so any causal LM works
without naming LlamaDecoderLayer anywhere.
"""

from __future__ import annotations

import torch
from torch import nn

from kit.bench import experiment
from kit.config import Config
from kit.recipe import dist as kdist
from kit.recipe import engines
from kit.recipe.layers import decoder_layer_classes


def shard(model: nn.Module, cfg: Config, device: torch.device) -> nn.Module:
    """Return the model wrapped for training by cfg.sharding.engine (kit.recipe.engines: FSDP2, FSDP1 or
    DDP, one object each)."""
    return engines.get(cfg.sharding.engine).wrap(model, cfg, device)


def shard_whole(model: nn.Module, cfg: Config, device: torch.device) -> nn.Module:
    """The first article's naive wrap, `FSDP(model)` with no auto-wrap policy, in FSDP2 terms: one
    unit for the whole model, with the engine's mixed precision (notebook 04 sets it beside the
    engine's unit per decoder layer)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from kit.recipe.quantize import DTYPES

    dtype = DTYPES[cfg.model.dtype]
    kwargs = {"mesh": init_device_mesh(device.type, (dist.get_world_size(),))}
    if cfg.sharding.mixed_precision and dtype != torch.float32:  # as kit.recipe.engines.FSDP2
        kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
    fully_shard(model, **kwargs)
    engines.keep_quant_state(model)
    return model


def shard_every(model: nn.Module, cfg: Config, device: torch.device) -> nn.Module:
    """FSDP2 as torch wraps it, every parameter its own (the kit's engine leaves the frozen ones
    alone on one rank: kit.recipe.engines.frozen_of)."""
    return engines.FSDP2(frozen_alone=False).wrap(model, cfg, device)


class Copies(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts the copy_ calls (and their bytes) a step makes: FSDP2's one-rank gather is one
    copy per parameter of the unit."""

    def __init__(self):
        super().__init__()
        self.calls, self.bytes = 0, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten.copy_.default:
            self.calls += 1
            self.bytes += _bytes(args[1])
        return func(*args, **(kwargs or {}))


# --------------------------------------------------------------------------- what each rank holds (04)
#
#   torchrun --nproc_per_node=2 -m kit.lab.sharding CONFIG OUT [fsdp2 fsdp1 ddp] [key=value ...]
#
# Builds the model exactly as the recipe does (kit.recipe.model.build, then shard), once per engine, runs one forward/backward, and writes OUT/<engine>/rank<R>.json: every
# parameter's full shape and the piece this rank holds, the compute dtypes seen inside forward,
# the gradients' local shapes. The notebook reads these files; it never joins the group itself.


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t  # FSDP2 parameters are DTensors


def _bytes(t) -> int:
    return t.numel() * t.element_size()


def plain_save(model: nn.Module) -> dict:
    """`torch.save(model.state_dict(), f)` on this rank, as a hand-written script does it (the first
    article says it fails under FSDP): the bytes written, and how many LoRA elements the file holds
    (FSDP1's state_dict gathers every unit whole on every rank; FSDP2's holds this rank's shards)."""
    import io

    state = model.state_dict()
    written = io.BytesIO()
    torch.save(state, written)
    lora = [v for k, v in state.items() if "lora_" in k and isinstance(v, torch.Tensor)]
    return {"keys": len(state), "bytes": written.getbuffer().nbytes, "lora_tensors": len(lora),
            "lora_elements": sum(_local(v).numel() for v in lora),
            "dtensors": sum(hasattr(v, "to_local") for v in state.values())}


def wrapped_units(model: nn.Module) -> list[str]:
    """Names of the modules an FSDP engine made into sharding units ('' is the root)."""
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    from kit.recipe.checkpoint import clean_name

    return [clean_name(n) for n, m in model.named_modules() if isinstance(m, (FSDPModule, FSDP))]


def quant_constant_bytes(model: nn.Module) -> int:
    """Bytes of bitsandbytes' quantization constants (not parameters: FSDP never shards them)."""
    import bitsandbytes as bnb

    from kit.lab.quantize_nf4 import state_bytes

    total = 0
    for m in model.modules():
        if isinstance(m, bnb.nn.Linear4bit):
            state = getattr(m.weight, "quant_state", None) or getattr(m, "quant_state", None)
            total += state_bytes(state) if state is not None else 0
    return total


def held(model: nn.Module) -> dict[str, dict]:
    """Per parameter (clean name): the shape, dtype and bytes this rank holds, and its grad's."""
    from kit.recipe.checkpoint import clean_name

    rows = {}
    for name, p in model.named_parameters():
        local, grad = _local(p), p.grad
        rows[clean_name(name)] = {
            "shape": list(local.shape), "dtype": str(local.dtype).removeprefix("torch."),
            "bytes": _bytes(local), "trainable": p.requires_grad, "dtensor": hasattr(p, "to_local"),
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


def _nested_bytes(arg) -> int:
    if isinstance(arg, list | tuple):
        return sum(_nested_bytes(a) for a in arg)
    return _bytes(arg) if isinstance(arg, torch.Tensor) else 0


class Collectives:
    """Count the collectives a block issues on this rank, by torch.distributed's op name: calls
    and bytes of the largest argument of each call (an all-gather: what it assembles; a
    reduce-scatter: the whole gradient it reduces; an all-reduce: the tensor). Gap filled: torch's
    CommDebugMode counts calls, not bytes. A dispatch mode: it sees FSDP2's, FSDP1's and DDP's
    collectives alike."""

    def __init__(self):
        from torch.utils._python_dispatch import TorchDispatchMode

        counts: dict[str, dict] = {}

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                name = str(func.overloadpacket)
                if name.startswith("c10d."):
                    row = counts.setdefault(name.removeprefix("c10d.").strip("_"),
                                            {"calls": 0, "bytes": 0})
                    row["calls"] += 1
                    row["bytes"] += max((_nested_bytes(a) for a in args), default=0)
                return func(*args, **(kwargs or {}))

        self.counts, self.mode = counts, Mode()

    def __enter__(self):
        self.mode.__enter__()
        return self.counts

    def __exit__(self, *exc):
        return self.mode.__exit__(*exc)


def _gathered(unit: nn.Module) -> list[torch.Tensor]:
    """The buffers an FSDP unit all-gathers into (empty storage while resharded): FSDP2's
    all_gather_outputs per parameter, FSDP1's padded full flat parameter."""
    if hasattr(unit, "_get_fsdp_state"):  # FSDP2
        group = unit._get_fsdp_state()._fsdp_param_group
        if group is None:
            return []
        # Issued (a prefetch) but not yet waited on: one flat buffer for the whole unit, copied
        # out into each parameter's own buffer at the wait.
        issued = getattr(group._all_gather_result, "all_gather_output", None)
        return [t for p in group.fsdp_params for t in p.all_gather_outputs] + (
            [issued] if issued is not None else [])
    flat = getattr(getattr(unit, "_handle", None), "flat_param", None)  # FSDP1
    return [flat._full_param_padded] if flat is not None and hasattr(flat, "_full_param_padded") else []


class Timeline:
    """Per operation of a step, in order: the bytes each FSDP unit holds gathered, and the unit
    whose gathered parameters the operation reads (it computes). Gap filled: torch's memory
    snapshots are CUDA-only and know allocations, not FSDP units. A dispatch mode, like
    Collectives; `mark(label)` records where forward ends and backward starts. Reads FSDP's
    private buffers (kit.lab.sharding._gathered), so it is a teaching probe, not part of a run."""

    def __init__(self, model: nn.Module):
        from torch.distributed.fsdp import FSDPModule
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
        from torch.utils._python_dispatch import TorchDispatchMode

        from kit.recipe.checkpoint import clean_name

        units = [(clean_name(n) or "root", m) for n, m in model.named_modules()
                 if isinstance(m, (FSDPModule, FSDP))]  # fmt: skip
        self.units, self.rows, self.marks = [n for n, _ in units], [], {}
        rows = self.rows

        def storage(t) -> tuple[int, int]:
            try:
                s = t.untyped_storage()
                return s.data_ptr(), s.nbytes()
            except (RuntimeError, NotImplementedError):  # a wrapper subclass (DTensor)
                return 0, 0

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                held = [[storage(t) for t in _gathered(m)] for _, m in units]
                ptrs = {ptr for a in torch.utils._pytree.tree_leaves((args, kwargs))
                        if isinstance(a, torch.Tensor) for ptr in [storage(a)[0]] if ptr}
                computing = next((i for i, h in enumerate(held)
                                  if any(p in ptrs for p, n in h if n)), -1)  # fmt: skip
                rows.append(([sum(n for _, n in h) for h in held], computing))
                return func(*args, **(kwargs or {}))

        self.mode = Mode()

    def mark(self, label: str):
        self.marks[label] = len(self.rows)

    def __enter__(self):
        self.mode.__enter__()
        return self

    def __exit__(self, *exc):
        return self.mode.__exit__(*exc)

    def segments(self) -> dict:
        """Compact form for the report: per unit, [start, end) op ranges gathered and computing,
        the gathered bytes at the widest point, and the marks."""
        out = {"units": self.units, "ops": len(self.rows), "marks": self.marks,
               "gathered": [[] for _ in self.units], "computing": [[] for _ in self.units],
               "gathered_bytes": [0 for _ in self.units], "peak_gathered_bytes": 0}  # fmt: skip
        for i in range(len(self.units)):
            for kind in ("gathered", "computing"):
                start = None
                for t, row in enumerate([*self.rows, ([0] * len(self.units), -1)]):
                    on = row[0][i] > 0 if kind == "gathered" else row[1] == i
                    if on and start is None:
                        start = t
                    elif not on and start is not None:
                        out[kind][i].append([start, t])
                        start = None
            out["gathered_bytes"][i] = max((r[0][i] for r in self.rows), default=0)
        totals = [sum(r[0]) for r in self.rows]
        out["peak_gathered_bytes"] = max(totals, default=0)
        out["total"] = [[t, b] for t, b in enumerate(totals) if t == 0 or b != totals[t - 1]]
        return out


def report_rank(cfg: Config, env, out, wrap=shard, label: str = "") -> dict:
    """One engine on this rank (`wrap`: how it shards; `label`: the report's name for it, default
    the engine): before sharding, after, and after one forward/backward."""
    from kit.config import apply_overrides, config_from_dict
    from kit.recipe import model

    if cfg.model.loading == "auto":  # whole, to compare before with after (stream: nothing before)
        cfg = config_from_dict(apply_overrides(cfg.to_dict(), ["model.loading=full"]))
    peft_model = model.build(cfg, env.device).model
    before = held(peft_model)
    quant_bytes = quant_constant_bytes(peft_model)
    layer_classes = sorted(c.__name__ for c in decoder_layer_classes(peft_model))
    wrapped = wrap(peft_model, cfg, env.device)
    after = held(wrapped)
    seen, handles = _seen_in_forward(wrapped)
    ids = torch.arange(2 * 16, device=env.device).reshape(2, 16) % 100 + 3
    timeline = Timeline(wrapped)
    with Collectives() as collectives, timeline, Copies() as copies:  # one step's forward, backward
        loss = wrapped(input_ids=ids, labels=ids).loss
        timeline.mark("backward")
        loss.backward()
    for h in handles:
        h.remove()
    grads = held(wrapped)
    saved = plain_save(wrapped)  # after the step, on every rank (FSDP1's gathers are collectives)
    return {
        "engine": label or cfg.sharding.engine, "rank": env.rank, "world_size": env.world_size,
        "units": wrapped_units(wrapped),
        "decoder_layer_classes": layer_classes,
        "quant_constant_bytes": quant_bytes,
        "params": {n: {"full_shape": before[n]["shape"], "full_bytes": before[n]["bytes"],
                       **after.get(n, {}), "grad_shape": grads.get(n, {}).get("grad_shape"),
                       "grad_dtype": grads.get(n, {}).get("grad_dtype")}
                   for n in before},
        "seen_in_forward": seen,
        "collectives": collectives,
        "timeline": timeline.segments() if timeline.units else None,
        "plain_save": saved,
        "copies": {"calls": copies.calls, "bytes": copies.bytes},
    }  # fmt: skip


# The report as a case table on the experiment harness (kit.bench.experiment): one case per
# engine, its config the launch's with sharding.engine set, and fsdp2-whole (FSDP2 with one unit
# for the whole model); every rank writes OUT/<case>/rank<R>.json.
EXPERIMENT = experiment.Experiment(
    prog="kit.lab.sharding", doc="What each rank holds, per engine (notebook 04).",
    cases={**{e: (lambda case: report_rank(case.cfg, case.env, case.out))
              for e in ("fsdp2", "fsdp1", "ddp")},
           "fsdp2-whole": lambda case: report_rank(case.cfg, case.env, case.out, shard_whole,
                                                   "fsdp2-whole"),
           "fsdp2-every": lambda case: report_rank(case.cfg, case.env, case.out, shard_every,
                                                   "fsdp2-every")},
    row_path=lambda out, engine, rank: out / engine / f"rank{rank}.json",
    row=lambda case, got, error, trace: got,
    overrides=lambda engine: [f"sharding.engine={engine.split('-')[0]}"],
)

if __name__ == "__main__":
    kdist.leave(experiment.main(EXPERIMENT))
