"""The load-only run behind kit.lab.loading_report (rank side): load as model.loading says, add LoRA,
shard with the config's engine, run one forward, and write what it cost and what each rank holds.

    torchrun --nproc_per_node=2 -m kit.lab.loading_rank CONFIG DIR [MODE ...] [key=value ...]

The modes (model.loading values; by default the config's) run one after the other in this process
(the digests compare; memory peaks then do not). DIR/<mode>/rank<R>.json: load + shard seconds; peak host memory until sharded (VmHWM, and the
sampled split into anonymous and file-backed pages, kit.recipe.meters.HostMemory); device memory after
sharding and its peak while loading (on a CPU both are host memory); the most bytes the model
itself held on the rank while loading (full, rank0: all of it before sharding; stream: its shards
so far and one unit) and after sharding; and two digests: of every byte this rank holds after
sharding (its shards of every parameter and the 4-bit layers' quantization constants) and of the
logits of a fixed batch. Equal digests across modes: the modes load the same model, bit for bit.
"""

from __future__ import annotations

import hashlib
import time

import torch
import torch.distributed as dist

from kit.bench import experiment
from kit.config import Config
from kit.recipe import dist as kdist
from kit.recipe import engines, loading, meters, model


def shard_digest(wrapped: torch.nn.Module) -> str:
    """sha256 of this rank's share of every parameter (FSDP2: its local shards; FSDP1: its part
    of each flat buffer) and buffer, and of each 4-bit layer's quantization constants, in module
    order."""
    import bitsandbytes as bnb

    digest = hashlib.sha256()

    def add(name: str, t: torch.Tensor) -> None:
        t = t.to_local() if hasattr(t, "to_local") else t
        digest.update(name.encode())
        digest.update(t.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())

    for name, t in [*wrapped.named_parameters(), *wrapped.named_buffers()]:
        add(name, t)
    for name, m in wrapped.named_modules():
        if isinstance(m, bnb.nn.Linear4bit):
            for key, v in sorted(m.quant_state.as_dict(packed=True).items()):
                add(f"{name}.{key}", v)
    return digest.hexdigest()


def state_digest(model: torch.nn.Module) -> str:
    """sha256 of every tensor a rank holds (packed 4-bit bytes and their quantization constants
    included), in module order: equal digests are bit-identical models."""
    digest = hashlib.sha256()
    for _, _, name, t in loading.slots(model):
        tensors = [t.data]
        state = getattr(t, "quant_state", None)
        if state is not None:
            tensors += [v for _, v in sorted(state.as_dict(packed=True).items())]
        for x in tensors:
            digest.update(name.encode())
            digest.update(x.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def report(cfg: Config, env) -> dict:
    """Load, add LoRA and shard as the recipe does; what it cost, what this rank holds."""
    import bitsandbytes  # noqa: F401  (the libraries' own memory is not the load's)
    import transformers  # noqa: F401

    before = meters.peak_rss_mib()
    start = time.perf_counter()
    with meters.HostMemory() as mem:
        built = model.build(cfg, env.device)
        source = loading.streamer_of(built.model)  # stream: the model is filled while wrapped
        whole = loading.held_bytes(built.model)  # full, rank0: all of it, before sharding
        wrapped = engines.get(cfg.sharding.engine).wrap(built.model, cfg, env.device)
    seconds = time.perf_counter() - start
    load_peak = meters.peak_rss_mib()  # before the forward: what loading and sharding took
    held, peak = meters.allocated_gib(env.device), meters.peak_gib(env.device)
    wrapped.eval()
    ids = (torch.arange(2 * 16, device=env.device).reshape(2, 16) * 7) % 100 + 3
    with torch.no_grad():
        logits = wrapped(input_ids=ids, use_cache=False).logits.float().cpu()
    dist.barrier()
    return {"mode": cfg.model.loading, "rank": env.rank, "world_size": env.world_size,
            "engine": cfg.sharding.engine, "seconds": round(seconds, 2),
            "rss_before_mib": round(before, 1), "peak_rss_mib": round(load_peak, 1),
            "peak_anon_mib": round(mem.peak["RssAnon"], 1),
            "peak_file_mib": round(mem.peak["RssFile"], 1),
            "held_after_sharding_gib": round(held, 4), "device_peak_gib": round(peak, 4),
            "model_most_mib": round((source.most_held if source else whole) / 2**20, 2),
            "model_sharded_mib": round(loading.held_bytes(wrapped) / 2**20, 2),
            "read_checkpoint": cfg.model.loading != "rank0" or env.rank == 0,
            "device": env.device.type, "digest": shard_digest(wrapped),
            "logits_digest": hashlib.sha256(logits.numpy().tobytes()).hexdigest()}  # fmt: skip


# One case per model.loading mode, in turn in one process group (by default the config's own
# mode); every rank writes DIR/<mode>/rank<R>.json (kit.bench.experiment).
EXPERIMENT = experiment.Experiment(
    prog="kit.lab.loading_rank", doc=__doc__,
    cases={mode: (lambda case: report(case.cfg, case.env))
           for mode in ("auto", "full", "rank0", "stream")},
    row_path=lambda out, mode, rank: out / mode / f"rank{rank}.json",
    row=lambda case, got, error, trace: got,
    default=lambda cfg: [cfg.model.loading],
    overrides=lambda mode: [f"model.loading={mode}"],
)

if __name__ == "__main__":
    kdist.leave(experiment.main(EXPERIMENT))
