"""How each rank gets the base model: `model.loading` = full | rank0 (rank side).

- full: every rank runs from_pretrained (kit.quantize.load_model): each reads the whole checkpoint
  into host memory and quantizes it. What both articles do; N ranks on a node hold N copies.
- rank0: rank 0 runs from_pretrained; every other rank builds the same model on the meta device
  (from_pretrained with device_map "meta": the same modules, 4-bit layers and quantizer, no weight
  read) and receives each tensor from rank 0 by broadcast, the 4-bit ones already packed with
  their quantization constants. What accelerate's `fsdp_cpu_ram_efficient_loading` +
  `fsdp_sync_module_states` intend; done here before LoRA and wrapping, so it is the same for
  FSDP2, FSDP1 and DDP and works with 4-bit weights, which FSDP1's own sync_module_states would
  broadcast as bare bytes without their quantization state.

Both give every rank the same bytes (tests/test_loading.py: bit-exact, and the same logits under
FSDP2 and FSDP1). `python -m kit.loading CONFIG --report FILE` loads only and writes each rank's
load time and peak host memory (kit.loading_report starts it from a notebook).

Gap filled by hand: transformers loads a 4-bit model on meta and materialises a full checkpoint,
but has no "receive a quantized model from rank 0" path (accelerate's is for FSDP1 wrapping and
skips 4-bit layers' quantization state), and torch.distributed has no broadcast of a module tree.
"""

from __future__ import annotations

import resource
import time

import torch
import torch.distributed as dist

from kit import builtin, quantize
from kit.config import Config


def load(cfg: Config, device: torch.device, attn: str | None = None):
    """(model, tokenizer) on `device`, by cfg.model.loading; a group of one always loads fully.
    A model whose folder holds no weights (kit.builtin.AT_LOAD, e.g. kit:llama-70b) is
    initialised where it would be read (kit.loading.initialise)."""
    single = not dist.is_initialized() or dist.get_world_size() == 1
    reads = cfg.model.loading == "full" or single or dist.get_rank() == 0
    init = builtin.init_at_load(builtin.resolve(cfg.model.name))
    if init is not None:
        model, tokenizer = quantize.load_model(cfg, torch.device("meta"), attn, weights=False)
        if reads:
            initialise(model, device, **init, quant=quantize.params4bit_kwargs(cfg))
    else:
        model, tokenizer = quantize.load_model(cfg, device if reads else torch.device("meta"),
                                               attn)
    if not (cfg.model.loading == "full" or single):
        receive_from_rank0(model, device)
    return model, tokenizer


def initialise(model: torch.nn.Module, device: torch.device, seed: int, std: float,
               quant: dict) -> None:  # fmt: skip
    """Random weights for a model built on the meta device, one tensor at a time on `device`:
    matrices N(0, std) (4-bit ones quantized right away, as from_pretrained quantizes what it
    reads), vectors of norms 1, biases 0, buffers (rotary frequencies) rebuilt by their module.
    At most one full-precision tensor exists at a time: a 70B model needs neither its 138 GB of
    bf16 weights on disk nor in memory. The same seed gives the same bytes on the same kind of
    device (GPU and CPU generators differ). quant: Params4bit's settings (kit.quantize)."""
    import bitsandbytes as bnb

    generator = torch.Generator(device).manual_seed(seed)
    done: dict[int, torch.Tensor] = {}
    rebuilt: dict[int, torch.nn.Module] = {}
    for module, kind, name, meta in list(_slots(model)):
        if id(meta) in done:  # tied: already made
            getattr(module, kind)[name] = done[id(meta)]
            continue
        if kind == "_buffers":
            fresh = rebuilt.get(id(module))
            if fresh is None:  # e.g. the rotary embedding: its __init__ computes its buffers
                with torch.device(device):
                    fresh = rebuilt[id(module)] = type(module)(config=model.config)
            tensor = getattr(fresh, name).to(device)
        elif isinstance(module, bnb.nn.Linear4bit) and name == "weight":
            weight = torch.empty(meta.shape, dtype=_compute_dtype(module), device=device)
            weight.normal_(0.0, std, generator=generator)
            tensor = bnb.nn.Params4bit(weight, requires_grad=False, module=module,
                                       **quant).to(device)  # quantizes, as transformers does
        else:
            tensor = torch.empty(meta.shape, dtype=meta.dtype, device=device)
            if meta.dim() > 1:
                tensor.normal_(0.0, std, generator=generator)
            elif name == "bias":
                tensor.zero_()
            else:
                tensor.fill_(1.0)
            tensor = torch.nn.Parameter(tensor, requires_grad=meta.requires_grad)
        getattr(module, kind)[name] = done[id(meta)] = tensor
    quantize.keep_packing(model)


def _compute_dtype(module) -> torch.dtype:
    """The dtype a 4-bit layer's weight has before quantization: its compute dtype."""
    return getattr(module, "compute_dtype", None) or torch.bfloat16


def _slots(model: torch.nn.Module):
    """(module, kind, name, tensor) for every parameter and buffer (persistent or not), in the
    same order on every rank; a tensor shared by two modules (tied embeddings) appears twice."""
    for module in model.modules():
        for kind in ("_parameters", "_buffers"):
            for name, tensor in getattr(module, kind).items():
                if tensor is not None:
                    yield module, kind, name, tensor


def receive_from_rank0(model: torch.nn.Module, device: torch.device) -> int:
    """Rank 0 sends every tensor of its loaded model; the other ranks, holding the same model on
    the meta device, put what arrives in place (on `device`). Returns the bytes sent per rank.
    A collective: every rank calls it."""
    import bitsandbytes as bnb

    main = dist.get_rank() == 0
    slots = list(_slots(model))
    # What rank 0 holds, described once: shape, dtype, grad flag, an alias's first slot, and for
    # a 4-bit weight its quantization constants (bitsandbytes' own serialised form, all tensors).
    plan: list = [None]
    if main:
        seen: dict[int, int] = {}
        described = []
        for i, (_, _, _, t) in enumerate(slots):
            alias = seen.setdefault(id(t), i)
            state = getattr(t, "quant_state", None) if isinstance(t, bnb.nn.Params4bit) else None
            stats = state.as_dict(packed=True) if state is not None else None
            described.append((tuple(t.shape), t.dtype, t.requires_grad,
                              alias if alias != i else None,
                              {k: (tuple(v.shape), v.dtype) for k, v in stats.items()}
                              if stats is not None else None))  # fmt: skip
        plan[0] = described
    dist.broadcast_object_list(plan, src=0)
    sent = 0
    placed: list = []
    for i, ((module, kind, name, tensor), (shape, dtype, grad, alias, stats)) in enumerate(
            zip(slots, plan[0], strict=True)):  # fmt: skip
        if alias is not None:  # tied: the same object as an earlier slot
            if not main:
                getattr(module, kind)[name] = placed[alias]
            placed.append(placed[alias])
            continue
        data = tensor.data if main else torch.empty(shape, dtype=dtype, device=device)
        dist.broadcast(data, src=0)
        sent += data.numel() * data.element_size()
        received = {}
        if stats is not None:
            own = tensor.quant_state.as_dict(packed=True) if main else {}
            for key, (s, d) in stats.items():
                t = own[key].to(device) if main else torch.empty(s, dtype=d, device=device)
                dist.broadcast(t, src=0)
                sent += t.numel() * t.element_size()
                received[key] = t
        if not main:
            if stats is not None:
                tensor = bnb.nn.Params4bit.from_prequantized(
                    data, received, requires_grad=grad, device=device, module=module)
            elif kind == "_parameters":
                tensor = torch.nn.Parameter(data, requires_grad=grad)
            else:
                tensor = data
            getattr(module, kind)[name] = tensor
        placed.append(tensor)
    if not main:
        quantize.keep_packing(model)
    return sent


# --------------------------------------------------------------------------- the load-only report

class HostMemory:
    """Peak host memory of this process while the block runs, split as the kernel counts it:
    anonymous (this process's own; what the OOM killer frees by killing it) and file-backed
    (pages of memory-mapped checkpoint files: the page cache, shared by every rank that maps
    the same file and reclaimable). Sampled from /proc/self/status every `every_s` seconds.
    Gap filled: getrusage and psutil give one peak for both, or none."""

    def __init__(self, every_s: float = 0.01):
        self.every_s, self.peak = every_s, {"RssAnon": 0.0, "RssFile": 0.0, "VmRSS": 0.0}

    def sample(self) -> None:
        for line in open("/proc/self/status"):
            key, _, value = line.partition(":")
            if key in self.peak:
                self.peak[key] = max(self.peak[key], int(value.split()[0]) / 1024)

    def __enter__(self):
        import threading

        self._stop = threading.Event()
        self.sample()

        def run():
            while not self._stop.wait(self.every_s):
                self.sample()

        self._thread = threading.Thread(target=run, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.sample()


def peak_rss_mib() -> float:
    """This process's peak resident host memory so far (VmHWM; not ru_maxrss, which on Linux
    carries the launching parent's peak over exec). It counts pages of memory-mapped checkpoint
    files a rank has touched (HostMemory splits them out)."""
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024  # KiB -> MiB
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def state_digest(model: torch.nn.Module) -> str:
    """sha256 of every tensor a rank holds (packed 4-bit bytes and their quantization constants
    included), in module order: equal digests are bit-identical models."""
    import hashlib

    digest = hashlib.sha256()
    for _, _, name, t in _slots(model):
        tensors = [t.data]
        state = getattr(t, "quant_state", None)
        if state is not None:
            tensors += [v for _, v in sorted(state.as_dict(packed=True).items())]
        for x in tensors:
            digest.update(name.encode())
            digest.update(x.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def report(cfg: Config, env) -> dict:
    """Load (only) as cfg says on this rank; what it cost."""
    import bitsandbytes  # noqa: F401  (the libraries' own memory is not the load's)
    import transformers  # noqa: F401

    before = peak_rss_mib()
    start = time.perf_counter()
    with HostMemory() as mem:
        model, _ = load(cfg, env.device)
    seconds = time.perf_counter() - start
    dist.barrier()
    packed = quantize.quantized_bytes(model) if cfg.quantization.method != "none" else {}
    return {"mode": cfg.model.loading, "rank": env.rank, "world_size": env.world_size,
            "seconds": round(seconds, 2), "rss_before_mib": round(before, 1),
            "peak_rss_mib": round(peak_rss_mib(), 1),
            "peak_anon_mib": round(mem.peak["RssAnon"], 1),
            "peak_file_mib": round(mem.peak["RssFile"], 1),
            "read_checkpoint": cfg.model.loading == "full" or env.rank == 0,
            "model_bytes": packed.get("total") or sum(
                p.numel() * p.element_size() for p in model.parameters()),
            "device": env.device.type, "digest": state_digest(model)}  # fmt: skip


def _main(argv: list[str]) -> int:
    import argparse
    import json
    from pathlib import Path

    from kit import builtin
    from kit import dist as kdist
    from kit.config import load_config

    parser = argparse.ArgumentParser(prog="python -m kit.loading")
    parser.add_argument("config", help="the run's config.yaml")
    parser.add_argument("--report", required=True, help="folder for rank<R>.json")
    parser.add_argument("overrides", nargs="*", help="config key=value")
    args = parser.parse_intermixed_args(argv)
    cfg = load_config(args.config, args.overrides)
    env = kdist.init(cfg.training.device, cfg.run.dist_timeout_min)
    try:
        with kdist.main_process_first(env):
            builtin.resolve(cfg.model.name)
        row = report(cfg, env)
        out = Path(args.report)
        out.mkdir(parents=True, exist_ok=True)
        (out / f"rank{env.rank}.json").write_text(json.dumps(row, indent=1))
    finally:
        kdist.cleanup()
    return 0


if __name__ == "__main__":
    import sys

    from kit import dist as _kdist

    sys.exit(_kdist.entry(lambda: _main(sys.argv[1:])))
