"""Attention implementations by name, what each costs, and activation checkpointing measured.

    impl, warning = resolve("sdpa_efficient")  # what from_pretrained(attn_implementation=) takes
    usable()                                   # {name: True or why not}, on this machine
    rows = sweep([512, 1024], ["eager", "sdpa", "sdpa_math"])    # one attention call, fwd + bwd
    rows = checkpointing_sweep(["none", "full", "every-2"])      # the recipe, per setting

`attention.implementation` (kit/config.py) takes transformers' own implementations (`eager`,
`sdpa`, `flex_attention`, `flash_attention_2`) and `sdpa_<backend>`: PyTorch's
scaled_dot_product_attention pinned to one of its kernels (flash, efficient, cudnn, math). Those
are registered with transformers' extension points: `AttentionInterface.register(name, fn)`, where
fn runs transformers' own `sdpa_attention_forward` inside `torch.nn.attention.sdpa_kernel(backend)`,
and `AttentionMaskInterface.register(name, sdpa_mask)`, so the model builds the same mask as for
`sdpa` (without it transformers builds no mask at all for an unknown name: padding would be
silently ignored). The kernel context is entered on every call of the attention function, so an
activation-checkpointing recompute (which calls the layer's forward again) enters it again; the
backward of a fused kernel is that kernel's own backward op, chosen in forward.

A pinned kernel that cannot run a call is an error naming the kernel, the call and what can run
it, not a quiet fallback: pinning exists to get that kernel. `flash_attention_2` without the
flash-attn package falls back to `sdpa` with a warning: an optional package, and sdpa carries a
FlashAttention-2 kernel of its own.

Kernel side: importing this module imports neither torch nor transformers; `in_child("sweep",
...)` and `checkpointing_sweep` measure in child processes, so a notebook kernel never initialises
CUDA (notebook 00's rule).
"""

from __future__ import annotations

import importlib.util
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

from kit.config import ConfigError

ROOT = Path(__file__).resolve().parents[1]
NAMES = ("eager", "sdpa", "sdpa_flash", "sdpa_efficient", "sdpa_cudnn", "sdpa_math",
         "flex_attention", "flash_attention_2")  # fmt: skip
# sdpa_<backend> -> torch.nn.attention.SDPBackend member
BACKENDS = {"sdpa_flash": "FLASH_ATTENTION", "sdpa_efficient": "EFFICIENT_ATTENTION",
            "sdpa_cudnn": "CUDNN_ATTENTION", "sdpa_math": "MATH"}  # fmt: skip
# The names they are registered under in transformers. Not the config names: transformers takes
# any implementation whose name contains "flash" for a FlashAttention request
# (utils.generic.is_flash_attention_requested) and would go looking for flash-attn kernels.
REGISTERED = {"sdpa_flash": "kit_sdpa_fa", "sdpa_efficient": "kit_sdpa_efficient",
              "sdpa_cudnn": "kit_sdpa_cudnn", "sdpa_math": "kit_sdpa_math"}  # fmt: skip
FLASH_ATTN_MISSING = (
    "attention.implementation: 'flash_attention_2' needs the flash-attn package, which is not "
    "installed; using 'sdpa' (its flash backend is the same algorithm)"
)
# torch's own headers before the reasons a kernel was refused (CUDA; CPU gives none)
_REFUSED = {"EFFICIENT_ATTENTION": "Memory efficient kernel not used because",
            "FLASH_ATTENTION": "Flash attention kernel not used because",
            "CUDNN_ATTENTION": "cuDNN attention kernel not used because"}  # fmt: skip
# Largest |output - fp32 math reference| that counts as agreeing, by dtype.
TOLERANCE = {"float32": 1e-4, "float16": 5e-3, "bfloat16": 3e-2}


# --------------------------------------------------------------------------- names -> transformers


def resolve(name: str, device=None, dtype=None) -> tuple[str, str | None]:
    """(implementation for from_pretrained's attn_implementation, warning or None).

    sdpa_<backend> is registered with transformers first. With `device` (and `dtype`), a pinned
    kernel is also tried there, and one that cannot run is a ConfigError naming what can."""
    if name not in NAMES:
        raise ConfigError(
            f"attention.implementation: {name!r} is not allowed; expected one of {', '.join(NAMES)}"
        )
    if name == "flash_attention_2":
        if importlib.util.find_spec("flash_attn") is None:
            return "sdpa", FLASH_ATTN_MISSING
        return name, None
    if name not in BACKENDS:
        return name, None
    register()
    if device is not None:
        why = _probe(name, device, dtype, mask=False)
        if why is not True:
            here = [n for n, ok in usable(device, dtype).items() if ok is True]
            raise ConfigError(
                f"attention.implementation: {name!r} cannot run on {_device(device).type} with "
                f"{_dtype_name(dtype)}: {why}; allowed here: {', '.join(here)}"
            )
    return REGISTERED[name], None


_pinned_functions: dict = {}


def register() -> None:
    """Register every sdpa_<backend> with transformers (idempotent)."""
    from transformers import AttentionInterface, AttentionMaskInterface
    from transformers.masking_utils import sdpa_mask

    for name in BACKENDS:
        if name not in _pinned_functions:
            _pinned_functions[name] = _pinned(name)
        AttentionInterface.register(REGISTERED[name], _pinned_functions[name])
        AttentionMaskInterface.register(REGISTERED[name], sdpa_mask)


def _pinned(name: str):
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    backend = getattr(SDPBackend, BACKENDS[name])

    def attention(module, query, key, value, attention_mask, **kwargs):
        try:
            with sdpa_kernel(backend):
                return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
        except RuntimeError as e:
            if "No available kernel" not in str(e) and "No viable backend" not in str(e):
                raise
            error = _refused(name, module, query, key, value, attention_mask, kwargs)
        raise error

    attention.__name__ = attention.__qualname__ = f"{REGISTERED[name]}_attention_forward"
    return attention


def _refused(name, module, query, key, value, mask, kwargs) -> ConfigError:
    """One line: the call the pinned kernel refused, torch's reasons, what can run it instead."""
    import warnings

    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    def attempt(backend) -> list[str] | None:  # None: it ran; else the warnings torch gave
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                with torch.no_grad(), sdpa_kernel(getattr(SDPBackend, backend)):
                    sdpa_attention_forward(module, query, key, value, mask, **kwargs)
                return None
            except RuntimeError:
                return [str(w.message) for w in caught]

    reasons = _reasons(BACKENDS[name], attempt(BACKENDS[name]) or [])
    if not reasons and query.device.type == "cpu":
        reasons = "PyTorch has no CPU kernel for it (on CPU, SDPA has flash and math kernels)"
    reasons = reasons or "PyTorch gave no reason"
    others = [n for n in BACKENDS if n != name and attempt(BACKENDS[n]) is None]
    call = (f"{query.device.type} {str(query.dtype).removeprefix('torch.')}, head_dim "
            f"{query.shape[-1]}, {query.shape[1]} query / {key.shape[1]} key-value heads, "
            f"{'an attention mask (padding or packing)' if mask is not None else 'causal'}")  # fmt: skip
    error = ConfigError(f"attention.implementation: {name!r} cannot run this call ({call}): "
                        f"{reasons}; allowed for it: {', '.join(['sdpa', *others, 'eager'])}")  # fmt: skip
    error.reasons = reasons
    return error


def _reasons(backend: str, messages: list[str]) -> str:
    """torch's reasons for refusing `backend`, from the warnings it gives on failure (CUDA)."""
    import re

    keep, out = False, []
    for m in messages:
        header = next((b for b, h in _REFUSED.items() if m.startswith(h)), None)
        if header:
            keep = header == backend
        elif keep and "runtime disabled" not in m:
            m = re.sub(r"\s*\(Triggered internally at [^)]*\)\.?\s*$", "", m)
            out.append(" ".join(m.split()))
    return " ".join(out)


# --------------------------------------------------------------------------- what runs here


def _device(device):
    import torch

    if device in (None, "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def _dtype(dtype):
    import torch

    return getattr(torch, dtype) if isinstance(dtype, str) else dtype or torch.bfloat16


def _dtype_name(dtype) -> str:
    return str(_dtype(dtype)).removeprefix("torch.")


class _Attention:
    """What transformers' attention functions read from the calling attention module."""

    def __init__(self, groups: int = 1, implementation: str = "sdpa"):
        from types import SimpleNamespace

        self.is_causal, self.training, self.layer_idx = True, True, 0
        self.num_key_value_groups = groups
        self.config = SimpleNamespace(_attn_implementation=implementation)


def _probe(name: str, device=None, dtype=None, mask: bool = False, head_dim: int = 64):
    """True if pinned kernel `name` runs a small causal call (GQA, as Llama's) forward and
    backward on device/dtype (with a padding mask if `mask`), else torch's reason."""
    import torch

    register()
    dev, dt = _device(device), _dtype(dtype)
    q = torch.randn(2, 4, 16, head_dim, device=dev, dtype=dt, requires_grad=True)
    kv = torch.randn(2, 2, 16, head_dim, device=dev, dtype=dt, requires_grad=True)
    m = None
    if mask:  # what sdpa_mask builds for a left-padded batch: bool, True = attend
        m = torch.ones(16, 16, dtype=torch.bool, device=dev).tril().expand(2, 1, 16, 16).clone()
        m[1, :, :, :3] = False
    try:
        out = _pinned_functions[name](_Attention(2), q, kv, kv, m, scaling=head_dim**-0.5)[0]
        out.float().sum().backward()
        return True
    except ConfigError as e:
        return getattr(e, "reasons", str(e))
    except RuntimeError as e:
        return _first_line(e)


def _probe_flex(device, dtype):
    """True if flex_attention runs forward and backward on device/dtype, else why not. Not
    compiled (seconds to compile; the model compiles it): the eager path checks the same
    device rules first."""
    import warnings

    import torch
    from torch.nn.attention.flex_attention import flex_attention

    q = torch.randn(1, 2, 16, 16, device=device, dtype=_dtype(dtype), requires_grad=True)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "called without torch.compile": here on purpose
            flex_attention(q, q, q).float().sum().backward()
        return True
    except (RuntimeError, NotImplementedError) as e:
        return _first_line(e)


def usable(device="auto", dtype="bfloat16") -> dict:
    """{implementation: True, or why it cannot run} on `device` with `dtype` (initialises CUDA
    when there is one: from a notebook, use in_child("usable"))."""
    from transformers.utils import is_torch_flex_attn_available

    dev = _device(device)
    out: dict = {"eager": True, "sdpa": True}
    for name in BACKENDS:
        ok = _probe(name, dev, dtype)
        if ok is True:
            masked = _probe(name, dev, dtype, mask=True)
            ok = True if masked is True else f"causal batches only; with a padding mask: {masked}"
        out[name] = ok
    out["flex_attention"] = _probe_flex(dev, dtype) if is_torch_flex_attn_available() else (
        "not available in this torch")
    if importlib.util.find_spec("flash_attn") is None:
        out["flash_attention_2"] = "the flash-attn package is not installed (falls back to sdpa)"
    elif dev.type != "cuda":
        out["flash_attention_2"] = "runs on CUDA GPUs only"
    elif _dtype_name(dtype) == "float32":
        out["flash_attention_2"] = "needs float16 or bfloat16"
    else:
        out["flash_attention_2"] = True
    return out


# --------------------------------------------------------------------------- microbenchmark


def _call(name: str, seq_len: int, heads: int, kv_heads: int, device, dtype):
    """fn(q, k, v) -> attention output (batch, seq, heads, head_dim): the function transformers
    runs for implementation `name`, with the causal mask that implementation takes."""
    import torch
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    groups = heads // kv_heads
    if name == "eager":
        from transformers.models.llama.modeling_llama import eager_attention_forward

        # The additive causal mask the model builds for eager (once per forward, all layers).
        mask = torch.full((seq_len, seq_len), torch.finfo(dtype).min, device=device, dtype=dtype)
        mask = mask.triu(1)[None, None]
        module = _Attention(groups, "eager")
        return lambda q, k, v: eager_attention_forward(
            module, q, k, v, mask, scaling=q.shape[-1] ** -0.5)[0]
    if name == "flash_attention_2":
        if importlib.util.find_spec("flash_attn") is None:
            raise RuntimeError("the flash-attn package is not installed (the recipe uses sdpa then)")
        if device.type != "cuda" or dtype == torch.float32:
            raise RuntimeError("flash_attention_2 runs on CUDA GPUs in float16 or bfloat16 only")
    if name == "flex_attention":
        from torch.nn.attention.flex_attention import create_block_mask

        mask = create_block_mask(lambda b, h, q, kv: q >= kv, None, None, seq_len, seq_len,
                                 device=str(device))  # fmt: skip
    else:
        mask = None  # sdpa and flash: is_causal, as the model runs a batch without padding
    impl, _ = resolve(name)
    fn, module = ALL_ATTENTION_FUNCTIONS[impl], _Attention(groups, impl)
    return lambda q, k, v: fn(module, q, k, v, mask, scaling=q.shape[-1] ** -0.5, dropout=0.0)[0]


def _inputs(batch, seq_len, heads, kv_heads, head_dim, device, dtype, seed):
    """q, k, v as an attention layer hands them over: (batch, heads, seq, head_dim) views of
    (batch, seq, heads, head_dim) projections; the leaves (which get .grad) and an output grad."""
    import torch

    g = torch.Generator(device="cpu").manual_seed(seed)
    shapes = [(batch, seq_len, h, head_dim) for h in (heads, kv_heads, kv_heads)]
    leaves = [torch.randn(s, generator=g).to(device, dtype).requires_grad_() for s in shapes]
    grad = torch.randn(batch, seq_len, heads, head_dim, generator=g).to(device, dtype)
    return leaves, grad


def _reference(leaves, grad):
    """Output and q, k, v gradients from SDPA's math kernel in float32, one key-value head (and
    its query heads) of one sequence at a time: exact, and the seq x seq scores stay small."""
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    q, k, v = leaves
    batch, _, heads, head_dim = q.shape
    groups = heads // k.shape[2]
    out = torch.empty(q.shape, device=q.device, dtype=torch.float32)
    grads = [torch.empty(t.shape, device=t.device, dtype=torch.float32) for t in leaves]
    for b in range(batch):
        for j in range(k.shape[2]):
            heads_j = (b, slice(None), slice(j * groups, (j + 1) * groups))
            where = [heads_j, (b, slice(None), slice(j, j + 1)), (b, slice(None), slice(j, j + 1))]
            part = [t[w].detach().float()[None].requires_grad_()
                    for t, w in zip(leaves, where, strict=True)]  # fmt: skip
            with sdpa_kernel(SDPBackend.MATH):
                o = sdpa_attention_forward(_Attention(groups), *(t.transpose(1, 2) for t in part),
                                           None, scaling=head_dim**-0.5)[0]  # fmt: skip
            o.backward(grad[heads_j].float()[None])
            out[heads_j] = o.detach()[0]
            for g, t, w in zip(grads, part, where, strict=True):
                g[w] = t.grad[0]
    return out, grads


def _cpu_peak_bytes(step) -> int:
    """Peak bytes the CPU allocator held above the start while step() ran (torch.profiler)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    events = [e for e in prof.profiler.kineto_results.events()
              if e.name() == "[memory]" and e.device_type().name == "CPU"]  # fmt: skip
    live = peak = 0
    for e in sorted(events, key=lambda e: e.start_ns()):
        live += e.nbytes()
        peak = max(peak, live)
    return peak


def _measure(fn, leaves, grad, repeats: int) -> dict:
    import time

    import torch

    q, k, v = (t.transpose(1, 2) for t in leaves)
    device = grad.device

    def step():
        fn(q, k, v).backward(grad)
        for t in leaves:
            t.grad = None

    out = fn(q, k, v)  # also the warm-up (flex_attention compiles here)
    out.backward(grad)
    result = {"out": out.detach().float(), "grads": [t.grad.float() for t in leaves]}
    for t in leaves:
        t.grad = None
    del out
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
        step()
        result["peak_mib"] = (torch.cuda.max_memory_allocated(device) - base) / 2**20
        times = []
        for _ in range(repeats):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            step()
            end.record()
            torch.cuda.synchronize(device)
            times.append(start.elapsed_time(end))
    else:
        result["peak_mib"] = _cpu_peak_bytes(step) / 2**20
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            step()
            times.append((time.perf_counter() - t0) * 1e3)
    result["ms"] = statistics.median(times)
    return result


def sweep(seq_lens, implementations=NAMES, batch: int = 1, heads: int = 8,
          kv_heads: int | None = None, head_dim: int = 64, device="auto", dtype="bfloat16",
          repeats: int = 3, seed: int = 0) -> list[dict]:  # fmt: skip
    """One causal attention call, forward + backward, per implementation and sequence length.

    Each row: `ms` (median of `repeats` after a warm-up: CUDA events on a GPU, perf_counter on
    CPU); `peak_mib`, the memory the call added above its inputs (GPU: torch.cuda
    .max_memory_allocated; CPU: the allocator's peak as torch.profiler records it), named in
    `memory`; `out_diff` / `grad_diff`, the largest absolute difference of the output / of the
    q, k, v gradients from SDPA's math kernel in float32, and `agrees` (out_diff within
    TOLERANCE[dtype]); `error`: why it did not run (out of memory, no kernel), never raised."""
    import gc

    import torch

    for name in implementations:
        if name not in NAMES:
            raise ConfigError(f"implementations: {name!r} is not allowed; expected some of "
                              f"{', '.join(NAMES)}")  # fmt: skip
    dev, dt = _device(device), _dtype(dtype)
    kv_heads = kv_heads or heads
    memory = ("cuda max_memory_allocated above inputs" if dev.type == "cuda"
              else "CPU allocator peak above inputs (torch.profiler)")  # fmt: skip
    rows = []
    for n in seq_lens:
        leaves, grad = _inputs(batch, n, heads, kv_heads, head_dim, dev, dt, seed)
        ref_out, ref_grads = _reference(leaves, grad)
        for name in implementations:
            row = {"implementation": name, "seq_len": n, "ms": None, "peak_mib": None,
                   "out_diff": None, "grad_diff": None, "agrees": None, "error": None,
                   "device": dev.type, "dtype": _dtype_name(dt), "memory": memory}  # fmt: skip
            for t in leaves:  # an earlier row may have failed halfway through its backward
                t.grad = None
            try:
                got = _measure(_call(name, n, heads, kv_heads, dev, dt), leaves, grad, repeats)
                out_diff = (got["out"] - ref_out).abs().max().item()
                grad_diff = max((g - r).abs().max().item()
                                for g, r in zip(got["grads"], ref_grads, strict=True))  # fmt: skip
                row.update(ms=round(got["ms"], 3), peak_mib=round(got["peak_mib"], 2),
                           out_diff=out_diff, grad_diff=grad_diff,
                           agrees=out_diff <= TOLERANCE[row["dtype"]])  # fmt: skip
                del got
            except Exception as e:  # noqa: BLE001 - a row, not a crash (OOM, no kernel, ...)
                row["error"] = ("out of memory: " if isinstance(e, torch.OutOfMemoryError)
                                else "") + _first_line(e)  # fmt: skip
            rows.append(row)
            gc.collect()
            if dev.type == "cuda":
                torch.cuda.empty_cache()
        del leaves, grad, ref_out, ref_grads
    return rows


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    lines = [line for line in text.splitlines() if line.strip()]
    return (lines[0] if lines else type(e).__name__)[:400]


# --------------------------------------------------------------------------- checkpointing


KEEPS_SETTINGS = ("keeps-matmuls", "keeps-mlp", "keeps-attention")


def setting_overrides(setting: str) -> list[str]:
    """'none' | 'full' | 'every-K' | 'keeps-<what>' -> the recipe's config overrides."""
    if setting == "none":
        return ["training.recompute.enabled=false"]
    if setting == "full":
        return ["training.recompute.enabled=true", "training.recompute.every=1"]
    if setting in KEEPS_SETTINGS:  # selective checkpointing (kit.recompute)
        return ["training.recompute.enabled=true",
                f"training.recompute.keeps={setting.removeprefix('keeps-')}"]
    k = setting.removeprefix("every-")
    if setting.startswith("every-") and k.isdigit() and int(k) >= 1:
        return ["training.recompute.enabled=true", f"training.recompute.every={k}"]
    raise ConfigError(f"checkpointing setting: {setting!r} is not allowed; expected 'none', "
                      "'full', 'every-K' (K >= 1: every K-th decoder layer recomputes) or "
                      f"one of {', '.join(KEEPS_SETTINGS)}")  # fmt: skip


def checkpointing_sweep(settings=("none", "full", "every-2"), model: str = "kit:tiny-llama",
                        nproc: int = 2, steps: int = 4, seq_len: int = 256, batch_size: int = 4,
                        device: str = "auto", out_dir="launch/nb06",
                        config: str = "kit/configs/tiny-cpu.yaml", overrides=(),
                        timeout: int = 1800) -> list[dict]:  # fmt: skip
    """Train the recipe (kit.train) a few steps per activation-checkpointing setting; one row
    each: peak memory per rank (`peak_mem_gib` from metrics.jsonl: GPU max_memory_allocated,
    CPU the process's peak RSS), median step time and tokens/s per device over the steps after
    the first, or the error.

    nproc >= 1: one `torchrun --nproc_per_node=NPROC -m kit.train` run per setting (the recipe
    exactly: FSDP, NF4, LoRA). nproc = 0: every setting in turn in one process, a process group
    of one: a child process, or the child in_child started (seconds instead of a torchrun
    start-up per setting; for CPUs). `overrides` go to every run."""
    from kit.torchrun import TorchrunFailed, run_recipe

    if nproc < 0:
        raise ConfigError(f"nproc: {nproc} is not allowed; expected 0 (one process, no torchrun) "
                          "or the processes per setting")  # fmt: skip
    runs = []
    for s in settings:
        folder = Path(out_dir) / s
        folder = folder if folder.is_absolute() else ROOT / folder
        runs.append((s, folder, [
            f"model.name={model}", f"training.steps={steps}", f"data.max_seq_len={seq_len}",
            f"training.batch_size={batch_size}", f"training.device={device}",
            "training.eval_every=0", "checkpointing.save_adapter=false",
            "checkpointing.save_probe_logits=false", "run.overwrite=true",
            *setting_overrides(s), *overrides,
        ]))  # fmt: skip
    errors: dict = {}
    if nproc == 0:
        todo = [[str(f), o] for _, f, o in runs]
        errors = (_train_settings(config, todo) if _in_child else
                  in_child("_train_settings", config=config, runs=todo, timeout=timeout))  # fmt: skip
    else:
        for _, folder, over in runs:
            try:
                run_recipe(folder, *over, nproc=nproc, config=config)
            except TorchrunFailed as e:
                lines = [x for x in str(e).splitlines() if x.startswith("[rank")]
                errors[str(folder)] = (lines[-1] if lines else _first_line(e))[:400]
    return [_summary(s, folder, nproc, errors.get(str(folder))) for s, folder, _ in runs]


def _summary(setting: str, folder: Path, nproc: int, error: str | None) -> dict:
    row = {"setting": setting, "nproc": nproc, "peak_mem_gib": None, "step_s": None,
           "tokens_per_s": None, "final_loss": None, "error": error}  # fmt: skip
    metrics = folder / "metrics.jsonl"
    if error is None and metrics.is_file():
        train = [json.loads(x) for x in metrics.read_text().splitlines()]
        train = [r for r in train if r["split"] == "train"]
        timed = train[1:] or train  # the first step warms up (allocator, lazy init)
        row.update(peak_mem_gib=max(r["peak_mem_gib"] for r in train),
                   step_s=statistics.median(r["step_s"] for r in timed),
                   tokens_per_s=statistics.median(r["tokens_per_s"] for r in timed))  # fmt: skip
        result = folder / "result.json"
        if result.is_file():
            row["final_loss"] = json.loads(result.read_text()).get("final_loss")
    elif error is None:
        row["error"] = f"no metrics in {folder}"
    return row


def _return_freed_memory(first: bool) -> None:
    """CPU: make the process's peak RSS (the recipe's peak_mem_gib) count one run only: glibc
    returns freed blocks of 128 KiB and more to the system at once (by default it keeps them
    for reuse, and the next run would reuse them unseen), then VmHWM is reset to VmRSS."""
    import ctypes

    try:
        libc = ctypes.CDLL("libc.so.6")
        if first:
            libc.mallopt(-3, 128 * 1024)  # M_MMAP_THRESHOLD
            libc.mallopt(-1, 128 * 1024)  # M_TRIM_THRESHOLD
        libc.malloc_trim(0)
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except (OSError, AttributeError):
        pass


def _train_settings(config: str, runs: list) -> dict:
    """In this process, one recipe run per (folder, overrides), in turn; {folder: error}.

    A process group of one (kit.dist); peak memory is reset between runs (CUDA peak stats, or
    the process's RSS high-water mark, see _return_freed_memory)."""
    import gc

    import torch

    from kit import dist as kdist
    from kit import train
    from kit.config import load_config

    errors = {}
    for i, (folder, overrides) in enumerate(runs):
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        else:
            _return_freed_memory(first=i == 0)
        if "RANK" in os.environ and not torch.distributed.is_initialized():
            os.environ["MASTER_PORT"] = str(kdist._free_port())  # a fresh group per run
        try:
            train.run(load_config(ROOT / config, [f"run.output_dir={folder}", *overrides]))
        except Exception as e:  # noqa: BLE001 - a row, not a crash
            errors[folder] = f"{type(e).__name__}: {_first_line(e)}"
    kdist.cleanup()
    return errors


# --------------------------------------------------------------------------- kernel side


CHILD_FUNCTIONS = ("usable", "sweep", "checkpointing_sweep", "_train_settings")
_in_child = False  # True in a child started by in_child: checkpointing_sweep(nproc=0) runs here


def in_child(functions: str | list[str], timeout: int = 1800, **kwargs):
    """Run usable / sweep / checkpointing_sweep in one child process and return the JSON result;
    a list of functions returns a list of results, each function given the keyword arguments it
    declares (one start-up and one set of imports for all). The caller never imports torch or
    touches CUDA."""
    names = [functions] if isinstance(functions, str) else list(functions)
    for name in names:
        if name not in CHILD_FUNCTIONS:
            raise ValueError(f"functions: {name!r} is not allowed; expected {CHILD_FUNCTIONS}")
    env = {"TOKENIZERS_PARALLELISM": "false", **os.environ}
    proc = subprocess.run(
        [sys.executable, "-m", "kit.attention", ",".join(names), json.dumps(kwargs)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout,
    )  # fmt: skip
    if proc.returncode != 0:
        raise RuntimeError(f"kit.attention {','.join(names)} failed ({proc.returncode}):\n"
                           f"{proc.stderr[-3000:]}")  # fmt: skip
    results = json.loads(proc.stdout.strip().splitlines()[-1])
    return results[0] if isinstance(functions, str) else results


def _main(argv: list[str]) -> None:
    import inspect

    global _in_child
    _in_child = True
    names, kwargs = argv[0].split(","), json.loads(argv[1]) if len(argv) > 1 else {}
    if not set(names) <= set(CHILD_FUNCTIONS):
        sys.exit(f"usage: python -m kit.attention {{{','.join(CHILD_FUNCTIONS)}}}[,...] "
                 "'{json keyword arguments}'")  # fmt: skip
    results = []
    for name in names:
        fn = globals()[name]
        declared = inspect.signature(fn).parameters
        results.append(fn(**{k: v for k, v in kwargs.items() if k in declared}))
    print(json.dumps(results, default=str))


def plot_sweep(rows: list[dict], axes=None):
    """Time and memory against sequence length, one line per implementation (log-log)."""
    import matplotlib.pyplot as plt

    axes = axes if axes is not None else plt.subplots(1, 2, figsize=(11, 3.8))[1]
    for name in dict.fromkeys(r["implementation"] for r in rows):
        ok = [r for r in rows if r["implementation"] == name and r["error"] is None]
        if ok:
            x = [r["seq_len"] for r in ok]
            axes[0].plot(x, [r["ms"] for r in ok], marker="o", label=name)
            axes[1].plot(x, [max(r["peak_mib"], 1e-3) for r in ok], marker="o", label=name)
    where = f"{rows[0]['device']}, {rows[0]['dtype']}" if rows else ""
    for ax, label in zip(axes, ("ms per forward + backward", "peak MiB above inputs"),
                         strict=True):  # fmt: skip
        ax.set(xscale="log", yscale="log", xlabel="sequence length", ylabel=label, title=where)
        ax.set_xticks(sorted({r["seq_len"] for r in rows}), minor=False)
        ax.set_xticklabels(sorted({r["seq_len"] for r in rows}))
    axes[0].legend(fontsize=8)
    return axes


def plot_checkpointing(rows: list[dict], axes=None):
    """Peak memory and step time per checkpointing setting (bars)."""
    import matplotlib.pyplot as plt

    axes = axes if axes is not None else plt.subplots(1, 2, figsize=(10, 3))[1]
    ok = [r for r in rows if r["error"] is None]
    names = [r["setting"] for r in ok]
    axes[0].bar(names, [r["peak_mem_gib"] for r in ok])
    axes[0].set_ylabel("peak GiB per rank")
    axes[1].bar(names, [r["step_s"] for r in ok], color="tab:orange")
    axes[1].set_ylabel("seconds per step (median)")
    return axes


if __name__ == "__main__":
    from kit import attention  # the module itself, not a second copy named __main__

    attention._main(sys.argv[1:])
