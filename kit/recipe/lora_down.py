"""An adapter's down-projection with its dropout inside: one kernel reads the input once.

    low = lora_down(x, a, bounds, rows, seed, threshold)   # (M, R) = (x * keep) @ a[s]^T
    parts = lows(x, downs, p)                              # adapters reading x: A(drop(x))
    y = add_up(result, part, up, scale / (1 - p))          # result + B(part) s/(1-p): one op
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

Two ops, one function (`lora_down`) choosing by device: on CUDA the Triton kernels as
`torch.library.triton_op` ops (kit::lora_down_triton and its gradients, kit.recipe.
lora_down_kernels: a compiled layer launches the kernels from its own generated code, no op
dispatch per call), elsewhere the reference in torch ops as a custom op (kit::lora_down: the
same mask, the same sums), which is what the CPU runs and what the GPU tests hold the kernels
to. `kit.recipe.recompute`'s policies keep either's result as an adapter's down-projection
(`ops`).

Gap filled: neither PEFT, torch nor bitsandbytes has a matmul with dropout inside it, and
torch's bernoulli draws its mask in the tensor's order (the rows of a sorted MoE layer would need
a whole mask drawn and gathered).
"""

from __future__ import annotations

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
def lora_down_ref(x: torch.Tensor, a: torch.Tensor, bounds: torch.Tensor | None,
                  rows: torch.Tensor | None, seed: torch.Tensor | None,
                  threshold: int) -> torch.Tensor:
    """(M, R): row m of segment s is (x[m] * keep[m]) @ a[s]^T (module docstring)."""
    return _ref_down(x, a, bounds, rows, seed, threshold)


@lora_down_ref.register_fake
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


def _backward_of(dx_op, da_op):
    def backward(ctx, g):
        x, a, bounds, rows, seed = ctx.saved_tensors
        g = g.contiguous()
        dx = da = None
        if ctx.needs_input_grad[0]:
            dx = dx_op(g, a, bounds, rows, seed, ctx.threshold, x)
        if ctx.needs_input_grad[1]:
            da = da_op(g, x, bounds, rows, seed, ctx.threshold, a)
        return dx, da, None, None, None, None

    return backward


lora_down_ref.register_autograd(_backward_of(lora_down_dx, lora_down_da), setup_context=_setup)


_LOADED: list = []  # the Triton ops' module, once `kernels()` loaded it


def kernels():
    """The Triton ops (kit.recipe.lora_down_kernels) with their gradients, loaded on first use:
    triton is imported only where a CUDA run asks for them (the build does, before any layer is
    compiled)."""
    if not _LOADED:
        from kit.recipe import lora_down_kernels as k

        k.down_op.register_autograd(_backward_of(k.dx_op, k.da_op), setup_context=_setup)
        k.up_add_op.register_autograd(_up_add_backward, setup_context=_up_add_setup)
        k.up_add_rows_op.register_autograd(_rows_backward, setup_context=_rows_setup)
        _LOADED.append(k)
    return _LOADED[0]


def ops() -> tuple:
    """The ops whose result is an adapter's down-projection (the recompute policies keep it):
    the reference's and, once loaded, the kernels'."""
    return (lora_down_ref._opoverload, *(m.down_op._opoverload for m in _LOADED))


def lora_down(x: torch.Tensor, a: torch.Tensor, bounds: torch.Tensor | None,
              rows: torch.Tensor | None, seed: torch.Tensor | None,
              threshold: int) -> torch.Tensor:
    """(M, R): row m of segment s is (x[m] * keep[m]) @ a[s]^T (module docstring). On CUDA the
    Triton op (kit::lora_down_triton: a compiled layer launches its kernels from its own code),
    elsewhere the reference op (kit::lora_down); the build refuses lora.fused_down on a GPU
    where the kernels cannot run (`available`)."""
    if x.is_cuda:
        return kernels().down_op(x, a, bounds, rows, seed, threshold)
    return lora_down_ref(x, a, bounds, rows, seed, threshold)


# ---------------------------------------------------------------- the adapters that use it


def lows(x, downs, p: float) -> tuple[torch.Tensor, ...]:
    """Each adapter's r-wide A(dropout(x)), not rescaled, for adapters that read one input `x`
    (one, or a group: kit.recipe.levers.lora_groups), dropout inside the down-projection's
    kernel: one seed, one mask, one read of x for every member's A. `add_up` applies each
    member's up-projection with 1/(1-p) folded into its factor. Tensors and numbers only
    (compiled once for every layer)."""
    flat = x.reshape(-1, x.shape[-1]).to(downs[0].dtype)
    a = torch.cat(downs) if len(downs) > 1 else downs[0]
    if p > 0:
        # a tensor seed drawn from torch's generator: manual_seed and a recompute's restored RNG
        # state give the same mask, and a compiled layer takes it as an input, not a constant
        seed = torch.randint(0, 2**31 - 1, (1,), dtype=torch.int32, device=x.device)
        low = lora_down(flat, a.unsqueeze(0), None, None, seed, threshold_of(p))
    else:
        low = torch.nn.functional.linear(flat, a)
    return low.split([d.shape[0] for d in downs], dim=-1) if len(downs) > 1 else (low,)


@torch.library.custom_op("kit::lora_up_add", mutates_args=())
def up_add_ref(c: torch.Tensor, low: torch.Tensor, up: torch.Tensor,
               alpha: float) -> torch.Tensor:
    """c + alpha * low @ up^T: c (M, N), low (M, R), up (N, R), one dtype."""
    return torch.addmm(c, low, up.t(), alpha=alpha)


@up_add_ref.register_fake
def _(c, low, up, alpha):
    return torch.empty_like(c, memory_format=torch.contiguous_format)


def _up_add_setup(ctx, inputs, output):
    _, low, up, alpha = inputs
    ctx.save_for_backward(low, up)
    ctx.alpha = alpha


def _up_add_backward(ctx, g):
    """The base's gradient is g itself; the factors' as autograd's of alpha * low @ up^T."""
    low, up = ctx.saved_tensors
    d_low = (g @ up) * ctx.alpha if ctx.needs_input_grad[1] else None
    d_up = (g.t() @ low) * ctx.alpha if ctx.needs_input_grad[2] else None
    return g, d_low, d_up, None


up_add_ref.register_autograd(_up_add_backward, setup_context=_up_add_setup)


def add_up(result: torch.Tensor, low: torch.Tensor, up: torch.Tensor,
           factor: float) -> torch.Tensor:
    """result + factor * low @ up^T, shaped as `result`: the adapted projection's output as one op
    that reads the base's result once and writes the sum (on CUDA with the kernels loaded, the
    Triton op kit::lora_up_add_triton: no copy of the base's result first, as torch.addmm's
    cuBLAS call makes; elsewhere kit::lora_up_add, torch.addmm). Under a compiled layer's recompute
    policy (kit.recipe.recompute, `sums`) this sum is what backward keeps, in place of the base's
    result: backward then neither runs the r-wide up-projection again nor reads two (tokens, out)
    tensors to add them. Other dtypes (fp32 adapters on a bf16 base) add the up-projection's
    result cast, as PEFT does."""
    flat = result.reshape(-1, result.shape[-1])
    low = low.reshape(-1, low.shape[-1])
    if low.dtype == up.dtype == result.dtype:
        op = _LOADED[0].up_add_op if result.is_cuda and _LOADED else up_add_ref
        return op(flat, low, up, float(factor)).view(result.shape)
    delta = torch.nn.functional.linear(low, up) * factor
    return (flat + delta.to(result.dtype)).view(result.shape)


def sum_ops() -> tuple:
    """The ops whose result is an adapted projection's output (`add_up`, `add_rows`): the
    reference's and, once loaded, the kernels'."""
    return (up_add_ref._opoverload,
            *(op._opoverload for m in _LOADED for op in (m.up_add_op, m.up_add_rows_op)))


def add_rows(c: torch.Tensor, low: torch.Tensor, up: torch.Tensor, ids: torch.Tensor,
             offsets: torch.Tensor) -> torch.Tensor:
    """c + low @ up[s] for the rows of segment s: a mixture of experts' sorted rows
    (kit.recipe.grouped_experts) adapted in one pass (c (M, N), low (M, R), up (S, R, N), ids
    (M,) each row's segment, sorted; offsets int32 (S,) the segments' ends; one dtype). The
    Triton op kit::lora_up_add_rows_triton, CUDA and bf16 only (its backward is two
    `torch._grouped_mm`): the grouped GEMM's (M, N) product is never written, nor read again
    to be added."""
    return kernels().up_add_rows_op(c, low, up, ids, offsets)


def _rows_setup(ctx, inputs, output):
    _, low, up, _, offsets = inputs
    ctx.save_for_backward(low, up, offsets)


def _rows_backward(ctx, g):
    """The base's gradient is g; the factors' are torch._grouped_mm's own (its autograd's
    formulas): g @ up[s]^T per segment, and low_s^T @ g_s per segment."""
    low, up, offs = ctx.saved_tensors
    g = g.contiguous()
    d_low = (torch._grouped_mm(g, up.transpose(1, 2), offs=offs)
             if ctx.needs_input_grad[1] else None)  # fmt: skip
    d_up = torch._grouped_mm(low.t(), g, offs=offs) if ctx.needs_input_grad[2] else None
    return g, d_low, d_up, None, None


def dropout_p(module, name: str) -> float:
    drop = module.lora_dropout[name]
    return drop.p if isinstance(drop, torch.nn.Dropout) else 0.0


def _fused_forward(self, x, *args, **kwargs):
    """A LoRA linear layer's forward with `lows` and `add_up` (training; PEFT's own otherwise)."""
    if (not self.training or self.disable_adapters or self.merged
            or kwargs.get("adapter_names") is not None):
        return type(self).forward(self, x, *args, **kwargs)
    result = self.base_layer(x, *args, **kwargs)
    for name in self.active_adapters:
        if name in self.lora_A:
            p = dropout_p(self, name)
            (low,) = lows(x, [self.lora_A[name].weight], p)
            result = add_up(result, low, self.lora_B[name].weight, self.scaling[name] / (1 - p))
    return result


def enable(peft_model) -> int:
    """lora.fused_down: every LoRA linear layer runs `lows` and `add_up` (groups of them too, when
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
