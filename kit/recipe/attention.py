"""Attention implementations by name: what the recipe asks transformers for, and what runs here.

    impl, warning = resolve("sdpa_efficient")  # what from_pretrained(attn_implementation=) takes
    usable("cpu", "float32")                   # {name: True or why not}: the one probe of this

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

Rank side (kit.recipe.quantize calls resolve on every rank); importing it imports neither torch nor
transformers. usable() initialises CUDA where there is one: a notebook runs it in a child process,
`kit.run.child.call("kit.recipe.attention:usable", ...)` (kit.lab.hardware's probe does). The microbenchmark of
one attention call is kit/lab/attention_bench.py.
"""

from __future__ import annotations

import importlib.util

from kit.config import ConfigError

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
                f"attention.implementation: {name!r} cannot run on {torch_device(device).type} with "
                f"{dtype_name(dtype)}: {why}; allowed here: {', '.join(here)}"
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


def torch_device(device):
    """torch.device for "auto" (cuda when there is one), None, "cpu", "cuda:1", ..."""
    import torch

    if device in (None, "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def torch_dtype(dtype):
    """torch dtype for "bfloat16", "float32", ... (None: bfloat16)."""
    import torch

    return getattr(torch, dtype) if isinstance(dtype, str) else dtype or torch.bfloat16


def dtype_name(dtype) -> str:
    return str(torch_dtype(dtype)).removeprefix("torch.")


class CallingModule:
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
    dev, dt = torch_device(device), torch_dtype(dtype)
    q = torch.randn(2, 4, 16, head_dim, device=dev, dtype=dt, requires_grad=True)
    kv = torch.randn(2, 2, 16, head_dim, device=dev, dtype=dt, requires_grad=True)
    m = None
    if mask:  # what sdpa_mask builds for a left-padded batch: bool, True = attend
        m = torch.ones(16, 16, dtype=torch.bool, device=dev).tril().expand(2, 1, 16, 16).clone()
        m[1, :, :, :3] = False
    try:
        out = _pinned_functions[name](CallingModule(2), q, kv, kv, m, scaling=head_dim**-0.5)[0]
        out.float().sum().backward()
        return True
    except ConfigError as e:
        return getattr(e, "reasons", str(e))
    except RuntimeError as e:
        return first_line(e)


def _probe_flex(device, dtype):
    """True if flex_attention runs forward and backward on device/dtype, else why not. Not
    compiled (seconds to compile; the model compiles it): the eager path checks the same
    device rules first."""
    import warnings

    import torch
    from torch.nn.attention.flex_attention import flex_attention

    q = torch.randn(1, 2, 16, 16, device=device, dtype=torch_dtype(dtype), requires_grad=True)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "called without torch.compile": here on purpose
            flex_attention(q, q, q).float().sum().backward()
        return True
    except (RuntimeError, NotImplementedError) as e:
        return first_line(e)


def usable(device="auto", dtype="bfloat16") -> dict:
    """{implementation: True, or why it cannot run} on `device` with `dtype`: every name the
    config allows, each pinned kernel tried forward and backward, causal and with a padding mask.
    Initialises CUDA where there is one: from a notebook, run it in a child process,
    kit.run.child.call("kit.recipe.attention:usable", device=..., dtype=...)."""
    from transformers.utils import is_torch_flex_attn_available

    dev = torch_device(device)
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
    elif dtype_name(dtype) == "float32":
        out["flash_attention_2"] = "needs float16 or bfloat16"
    else:
        out["flash_attention_2"] = True
    return out


def first_line(e: BaseException) -> str:
    """The exception's first non-blank line (torch's messages run on for pages), at most 400."""
    text = str(e).strip()
    lines = [line for line in text.splitlines() if line.strip()]
    return (lines[0] if lines else type(e).__name__)[:400]
