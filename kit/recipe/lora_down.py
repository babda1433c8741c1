"""An adapter's down-projection with its dropout inside: one kernel reads the input once.

    low = lora_down(x, a, bounds, rows, seed, threshold)   # (M, R) = (x * keep) @ a[s]^T
    deltas = branches(x, downs, ups, scales, p)            # adapters reading x: B(A(drop(x))) s
    enable(peft_model)                                     # lora.fused_down: every adapter

`x` (M, K) holds M rows in S contiguous segments (`bounds`: int32 (S + 1,) segment starts and
the end; None: one segment), `a` (S, R, K) one down-projection per segment: a dense layer's
adapters (S = 1; q, k and v stacked, R = 3r) or a mixture of experts' sorted rows (S experts,
kit.recipe.grouped_experts). `keep` is the dropout mask kit.recipe.drop_mask
defines: hash(seed, row, col) >= threshold for the row's id `rows[m]` (None: m itself), not
rescaled (the caller scales the R-wide result or the up-projection by 1/(1-p)).

PEFT drops the input out into a copy (a bernoulli mask, a masked product), which the matmul then
reads; backward reads the mask and the copy again. Here the mask is computed from the row and
column indices inside the matmul's tiles, forward and backward: no mask and no dropped copy
exist in memory, and the input is read once per pass. Backward is two kernels, the input's
gradient (keep * (g @ a[s])) and the factors' ((g_s^T @ (x_s * keep)) per segment).

The op is a torch custom op (compiled layers call it as one opaque kernel): on CUDA its Triton
kernels, elsewhere the reference in torch ops (the same mask, the same sums), which is what the
CPU runs and what the GPU tests hold the kernels to. `kit.recipe.recompute`'s policies keep its
result as an adapter's down-projection.

Gap filled: neither PEFT, torch nor bitsandbytes has a matmul with dropout inside it, and
torch's bernoulli draws its mask in the tensor's order (the rows of a sorted MoE layer would need
a whole mask drawn and gathered).
"""

from __future__ import annotations

import functools

import torch

from kit.recipe.drop_mask import drop_mask, threshold_of


def available(device: torch.device) -> bool:
    """The Triton kernels can run here: kit.budget.machine.triton_kernels, the planner's rule,
    asked of this process's device."""
    import importlib.util

    from kit.budget.machine import triton_kernels

    if device.type != "cuda":
        return False
    major, minor = torch.cuda.get_device_capability(device)
    return triton_kernels({"capability": f"{major}.{minor}"},
                          {"triton": importlib.util.find_spec("triton") is not None})


# ---------------------------------------------------------------- reference (torch ops)


def _segments(bounds: torch.Tensor | None, m: int) -> list[tuple[int, int]]:
    ends = [0, m] if bounds is None else bounds.tolist()
    return list(zip(ends[:-1], ends[1:], strict=True))


def _kept(x, rows, seed, threshold):
    if seed is None:
        return x
    ids = rows if rows is not None else torch.arange(x.shape[0], device=x.device)
    return x.masked_fill(drop_mask(seed, ids, x.shape[-1], threshold), 0)


def _ref_down(x, a, bounds, rows, seed, threshold):
    xk = _kept(x, rows, seed, threshold)
    out = x.new_zeros(x.shape[0], a.shape[1])
    for s, (lo, hi) in enumerate(_segments(bounds, x.shape[0])):
        out[lo:hi] = (xk[lo:hi].float() @ a[s].float().t()).to(out.dtype)
    return out


def _ref_dx(g, a, bounds, rows, seed, threshold, dtype):
    dx = g.new_zeros(g.shape[0], a.shape[-1], dtype=dtype)
    for s, (lo, hi) in enumerate(_segments(bounds, g.shape[0])):
        dx[lo:hi] = (g[lo:hi].float() @ a[s].float()).to(dtype)
    return _kept(dx, rows, seed, threshold)


def _ref_da(g, x, bounds, rows, seed, threshold, dtype):
    xk = _kept(x, rows, seed, threshold)
    parts = [g[lo:hi].float().t() @ xk[lo:hi].float() for lo, hi in _segments(bounds, x.shape[0])]
    return torch.stack(parts).to(dtype)


# ---------------------------------------------------------------- the ops


@torch.library.custom_op("kit::lora_down", mutates_args=())
def lora_down(x: torch.Tensor, a: torch.Tensor, bounds: torch.Tensor | None,
              rows: torch.Tensor | None, seed: torch.Tensor | None, threshold: int) -> torch.Tensor:
    """(M, R): row m of segment s is (x[m] * keep[m]) @ a[s]^T (module docstring)."""
    return _ref_down(x, a, bounds, rows, seed, threshold)


@lora_down.register_fake
def _(x, a, bounds, rows, seed, threshold):
    return x.new_empty(x.shape[0], a.shape[1])


@torch.library.custom_op("kit::lora_down_dx", mutates_args=())
def lora_down_dx(g: torch.Tensor, a: torch.Tensor, bounds: torch.Tensor | None,
                 rows: torch.Tensor | None, seed: torch.Tensor | None, threshold: int,
                 like: torch.Tensor) -> torch.Tensor:
    """The input's gradient (M, K) in `like`'s dtype: keep * (g @ a[s])."""
    return _ref_dx(g, a, bounds, rows, seed, threshold, like.dtype)


@lora_down_dx.register_fake
def _(g, a, bounds, rows, seed, threshold, like):
    return like.new_empty(g.shape[0], a.shape[-1])


@torch.library.custom_op("kit::lora_down_da", mutates_args=())
def lora_down_da(g: torch.Tensor, x: torch.Tensor, bounds: torch.Tensor | None,
                 rows: torch.Tensor | None, seed: torch.Tensor | None, threshold: int,
                 like: torch.Tensor) -> torch.Tensor:
    """The factors' gradient (S, R, K) in `like`'s dtype: g_s^T @ (x_s * keep) per segment."""
    return _ref_da(g, x, bounds, rows, seed, threshold, like.dtype)


@lora_down_da.register_fake
def _(g, x, bounds, rows, seed, threshold, like):
    return like.new_empty(like.shape)


def _setup(ctx, inputs, output):
    x, a, bounds, rows, seed, threshold = inputs
    ctx.save_for_backward(x, a, bounds, rows, seed)
    ctx.threshold = threshold


def _backward(ctx, g):
    x, a, bounds, rows, seed = ctx.saved_tensors
    g = g.contiguous()
    dx = da = None
    if ctx.needs_input_grad[0]:
        dx = lora_down_dx(g, a, bounds, rows, seed, ctx.threshold, x)
    if ctx.needs_input_grad[1]:
        da = lora_down_da(g, x, bounds, rows, seed, ctx.threshold, a)
    return dx, da, None, None, None, None


lora_down.register_autograd(_backward, setup_context=_setup)


# ---------------------------------------------------------------- the Triton kernels


@functools.cache
def _kernels():
    """The Triton module, imported on first use (triton is imported only on a CUDA machine)."""
    import triton

    from kit.recipe import lora_down_kernels as k

    return triton, k.down, k.dx, k.da


def _launch(x_like, a, bounds, rows, seed):
    """(M, K, R, S, the flags and pointers every kernel takes)."""
    triton = _kernels()[0]
    m, k, r = x_like.shape[0], a.shape[-1], a.shape[1]
    segments = 1 if bounds is None else bounds.shape[0] - 1
    flags = dict(HAS_BOUNDS=bounds is not None, HAS_ROWS=rows is not None, DROP=seed is not None,
                 IEEE=x_like.dtype == torch.float32, BR=max(16, triton.next_power_of_2(r)))
    dummy = a  # an unused pointer argument (its flag is off)
    ptrs = (bounds if bounds is not None else dummy, rows if rows is not None else dummy,
            seed if seed is not None else dummy)
    return m, k, r, segments, flags, ptrs


def _log2(segments: int) -> int:
    return max(1, (segments - 1).bit_length())


@lora_down.register_kernel("cuda")
def down_triton(x, a, bounds, rows, seed, threshold):
    triton, down, _, _ = _kernels()
    x, a = x.contiguous(), a.contiguous()
    m, k, r, segments, flags, ptrs = _launch(x, a, bounds, rows, seed)
    out = x.new_empty(m, r)
    if m:
        down[lambda meta: (triton.cdiv(m, meta["BM"]),)](
            x, a, out, *ptrs, m, k, r, segments, threshold, LOG_S=_log2(segments), **flags)
    return out


@lora_down_dx.register_kernel("cuda")
def dx_triton(g, a, bounds, rows, seed, threshold, like):
    triton, _, dx, _ = _kernels()
    g, a = g.contiguous(), a.contiguous()
    m, k, r, segments, flags, ptrs = _launch(g, a, bounds, rows, seed)
    flags["IEEE"] = like.dtype == torch.float32
    out = like.new_empty(m, k)
    if m:
        dx[lambda meta: (triton.cdiv(m, meta["BM"]), triton.cdiv(k, meta["BK"]))](
            g, a, out, *ptrs, m, k, r, segments, threshold, LOG_S=_log2(segments), **flags)
    return out


@lora_down_da.register_kernel("cuda")
def da_triton(g, x, bounds, rows, seed, threshold, like):
    """The factors' gradient: one program per (64 columns, segment, share of its rows); a dense
    layer's one segment is split so that the GPU has ~4 programs per multiprocessor, each share
    summed after (fp32 partials, no atomics: the same sum every run)."""
    from kit.recipe.lora_down_kernels import DA_BK

    triton, _, _, da = _kernels()
    g, x = g.contiguous(), x.contiguous()
    m, k, r, segments, flags, ptrs = _launch(x, like, bounds, rows, seed)
    programs = triton.cdiv(k, DA_BK) * segments
    units = (torch.cuda.get_device_properties(x.device).multi_processor_count
             if x.is_cuda else 8)  # fmt: skip
    split = max(1, min(16, triton.cdiv(4 * units, programs), triton.cdiv(m, 64 * segments)))
    parts = torch.empty(split, segments, r, k, device=x.device, dtype=torch.float32)
    da[(triton.cdiv(k, DA_BK), segments, split)](g, x, parts, *ptrs, m, k, r, threshold,
                                                 BK=DA_BK, **flags)
    return (parts.sum(0) if split > 1 else parts[0]).to(like.dtype)


# ---------------------------------------------------------------- the adapters that use it


def branches(x, downs, ups, scales, p: float) -> tuple[torch.Tensor, ...]:
    """Each adapter's B(A(dropout(x))) * scale for adapters that read one input `x` (one, or a
    group: kit.recipe.levers.lora_groups), dropout inside the down-projection's kernel: one seed,
    one mask, one read of x for every member's A. Tensors and numbers only (compiled once for
    every layer)."""
    shape = x.shape
    flat = x.reshape(-1, shape[-1]).to(downs[0].dtype)
    a = torch.cat(downs) if len(downs) > 1 else downs[0]
    if p > 0:
        # a tensor seed drawn from torch's generator: manual_seed and a recompute's restored RNG
        # state give the same mask, and a compiled layer takes it as an input, not a constant
        seed = torch.randint(0, 2**31 - 1, (1,), dtype=torch.int32, device=x.device)
        low = lora_down(flat, a.unsqueeze(0), None, None, seed, threshold_of(p)) * (1 / (1 - p))
    else:
        low = torch.nn.functional.linear(flat, a)
    parts = low.split([d.shape[0] for d in downs], dim=-1) if len(downs) > 1 else (low,)
    return tuple((torch.nn.functional.linear(part, up) * s).reshape(*shape[:-1], -1)
                 for part, up, s in zip(parts, ups, scales, strict=True))


def dropout_p(module, name: str) -> float:
    drop = module.lora_dropout[name]
    return drop.p if isinstance(drop, torch.nn.Dropout) else 0.0


def _fused_forward(self, x, *args, **kwargs):
    """A LoRA linear layer's forward with `branches` (training; PEFT's own otherwise)."""
    if (not self.training or self.disable_adapters or self.merged
            or kwargs.get("adapter_names") is not None):
        return type(self).forward(self, x, *args, **kwargs)
    result = self.base_layer(x, *args, **kwargs)
    for name in self.active_adapters:
        if name in self.lora_A:
            (delta,) = branches(x, [self.lora_A[name].weight], [self.lora_B[name].weight],
                                [self.scaling[name]], dropout_p(self, name))
            result = result + delta.to(result.dtype)
    return result


def enable(peft_model) -> int:
    """lora.fused_down: every LoRA linear layer runs `branches` (groups of them too, when
    kit.recipe.levers.lora_groups is enabled after this), and every experts module's adapters
    the kernel on its sorted rows (kit.recipe.grouped_experts); returns how many modules. The
    module tree, the keys and saving are PEFT's."""
    import types

    from peft.tuners.lora import LoraLayer

    from kit.config import ConfigError

    count = 0
    for module in peft_model.modules():
        if not isinstance(module, LoraLayer) or not hasattr(module, "lora_A"):
            continue
        if type(module).__name__ == "ParamWrapper":
            if hasattr(module, "_kit_dropout"):  # the outermost wrapper (kit.recipe.experts)
                inner = module
                while type(inner).__name__ == "ParamWrapper":  # down to the experts module
                    inner = inner.base_layer
                inner._kit_fused_down = True
                count += 1
            continue
        if getattr(module, "lora_variant", None):
            raise ConfigError("lora.fused_down: True is not allowed with DoRA or other LoRA "
                              "variants; allowed: false")
        module._kit_fused_down = True
        module.forward = types.MethodType(_fused_forward, module)
        count += 1
    return count
