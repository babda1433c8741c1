"""Grouped experts: every expert of a MoE layer as one GEMM per projection (kit.recipe.experts).

Per layer and pass, for the rows (token, k-th choice) of the top-k routing:
- the rows are sorted by expert once (a stable argsort of the flattened expert ids); each expert's
  rows are one contiguous group, its end offset the cumulative bincount;
- each expert stack (NF4, packed (E*out, in)) is dequantized to the compute dtype by ONE
  call over the whole stack (kit.recipe.nf4.dequantize: bitsandbytes' values, the kit's kernel
  on GPUs), viewed as (E, out, in);
- the base projection of every group is one grouped GEMM: `torch._grouped_mm` (CUTLASS, Hopper
  and newer, bf16), elsewhere a loop over the sorted groups' slices (`grouped_kernel` chooses);
- each LoRA branch is two more grouped GEMMs (A, then B, times its scale) on the input dropped out
  with a counter-based mask: drop(row, col) = hash32(seed, flat row token*k + choice, col) < p,
  computed at the sorted rows themselves (no mask drawn in token order and gathered), one int32
  seed per layer call and branch drawn from torch's generator (so torch.manual_seed and a
  recompute's restored RNG state give the same masks). Integer arithmetic only: the same bits on
  CPU and CUDA, eager and compiled. Backward computes the mask again from the seed and the rows
  (a few int ops that inductor fuses into the kernel that reads the input): no mask is kept;
- gate/activation (the module's own `_apply_gate`), biases; gate_up's adapters' up-projection
  added to the base's result by the kernel that makes it (kit.recipe.lora_down.add_rows, on the
  grouped GEMM's GPUs); the rows are gathered back to token order, weighted and summed over the
  k choices, the down projection's and its adapters' parts added as read (one Triton kernel on
  GPUs, kit.recipe.experts_kernels, and one more for that sum's two gradients), and every
  backward of the layout is a gather too (the permutation's inverse, `Groups.inverse`): no
  scatter, no atomics, the same sums every run.

Backward: `_FrozenBase` keeps nothing of the dequantized stack; it dequantizes the stack again for
the input's gradient (the base is frozen: no weight gradient). Under a recompute policy
(kit.recipe.recompute) the grouped GEMMs are matmuls like any other: `matmuls` keeps the base
projections' and the adapters' r-wide results, and the layer's recompute runs again only the
element-wise work, the adapters' up-projections and the stacks' dequantize (whose result the
kept GEMM no longer reads: a next lever). The LoRA GEMMs go through autograd
(their factors are small). Expert ids must lie in [0, E): the kit runs no expert parallelism of
transformers' kind (its sentinel id E for another rank's expert).

Gaps filled by hand: transformers' grouped_mm experts read the dense 3-D stacks and know no LoRA;
bitsandbytes has no grouped 4-bit GEMM; PEFT's ParamWrapper merges B@A into a dense stack; the
masks are kit.recipe.drop_mask's hash (torch has no random numbers keyed by the caller's indices).
With lora.fused_down the mask is computed inside the LoRA down-projection's kernel
(kit.recipe.lora_down): no dropped copy of the rows.
"""

from __future__ import annotations

import torch

from kit.recipe.drop_mask import drop_mask, threshold_of


def grouped_kernel(device: torch.device, dtype: torch.dtype) -> bool:
    """True where `torch._grouped_mm` runs at speed: a CUDA GPU of compute capability 9.0 or newer
    (its CUTLASS grouped kernel; older GPUs get a loop inside torch) in bf16. Anywhere else (the
    CPU, pre-Hopper GPUs, fp32 runs) the kit loops over the sorted groups: the same arithmetic."""
    from kit.budget.machine import GROUPED_GEMM_CAPABILITY

    return (device.type == "cuda" and dtype == torch.bfloat16 and hasattr(torch, "_grouped_mm")
            and torch.cuda.get_device_capability(device) >= GROUPED_GEMM_CAPABILITY)  # fmt: skip


class Groups:
    """The sorted layout of one layer's routed rows: `order` (sorted position -> flat row
    token*k + choice), `offsets` (int32 cumulative ends per expert, on the device), `ends` (the
    same as a list, only for the fallback loop, which needs them on the host), `fast`."""

    def __init__(self, index: torch.Tensor, experts: int, fast: bool):
        ids = index.reshape(-1)
        self.order = torch.argsort(ids, stable=True)
        self.ids = ids[self.order]
        # histc, not bincount: bincount on CUDA reads the largest id back to the host (a sync
        # per layer); histc takes float ids on the CPU, int ids on CUDA (deterministic mode)
        counts = torch.histc(ids.float() if ids.device.type == "cpu" else ids.int(), bins=experts,
                             min=0, max=experts - 1)  # fmt: skip
        self.offsets = torch.cumsum(counts, 0, dtype=torch.int32)
        self.ends = None if fast else self.offsets.tolist()
        self.fast, self.top_k = fast, index.shape[-1]
        # flat row -> its sorted position (the permutation's inverse: one int scatter)
        self.inverse = torch.empty_like(self.order).index_put_(
            (self.order,), torch.arange(ids.numel(), device=ids.device))

    def bounds(self) -> torch.Tensor:
        """int32 (E + 1,): every group's start, then the end (kit.recipe.lora_down's layout)."""
        return torch.nn.functional.pad(self.offsets, (1, 0))


def gmm(x: torch.Tensor, w: torch.Tensor, groups: Groups) -> torch.Tensor:
    """Rows of group g (sorted x, (S, K)) times w[g] ((E, K, N)): (S, N)."""
    if groups.fast:
        return torch._grouped_mm(x, w, offs=groups.offsets)
    parts, start = [], 0
    for g, end in enumerate(groups.ends):
        if end > start:
            parts.append(x[start:end] @ w[g])
        start = end
    return torch.cat(parts) if parts else x.new_zeros(0, w.shape[-1])


class _FrozenBase(torch.autograd.Function):
    """x @ W_g^T per group with W = stack() (E, out, in), made in forward and made again in
    backward: no dequantized weight lives between them (the planner counts none). The packed
    stack is held by the closure, as bitsandbytes' matmul_4bit holds its weight."""

    @staticmethod
    def forward(ctx, x, stack, groups):
        ctx.stack, ctx.groups = stack, groups
        return gmm(x, stack().transpose(-2, -1), groups)

    @staticmethod
    def backward(ctx, grad):
        return gmm(grad.contiguous(), ctx.stack(), ctx.groups), None, None


def stack_of(module: torch.nn.Module, name: str):
    """A function returning module.<name> as (E, out, in) in the compute dtype: the NF4 stack
    dequantized by one call, or the dense parameter (gpt-oss's (E, in, out) transposed, a view)."""
    stored = getattr(module, "_kit_nf4", {}).get(name)
    param = getattr(module, name)
    if stored is None:
        return lambda: param.transpose(1, 2) if module.is_transposed else param
    from kit.recipe import nf4

    state, experts = stored["state"], stored["shape"][0]

    def dequantize():
        packed = param.full_tensor() if hasattr(param, "full_tensor") else param
        return nf4.dequantize(packed, state).view(experts, stored["out"], -1)

    return dequantize


@torch.library.custom_op("kit::dense_copy", mutates_args=())
def dense_copy(t: torch.Tensor) -> torch.Tensor:
    """A row-major copy of `t`, opaque to the compiler. `torch._grouped_mm` wants a unit stride in
    each operand's last two dims; a compiled layer (training.compile) lays an element-wise
    result out as it likes, `.contiguous()` included (torch 2.11-2.13's inductor gives the
    LoRA factor B, a permuted view scaled and cast, the strides of the permutation, and the
    kernel refuses them). A custom op's output has the strides its fake says: row-major. Gap
    filled: inductor's grouped_mm fallback states no stride requirement on its operands."""
    return t.contiguous().clone()


@dense_copy.register_fake
def _(t):
    return t.new_empty(t.shape)


dense_copy.register_autograd(lambda ctx, grad: grad)


class _Dispatch(torch.autograd.Function):
    """Token rows to sorted rows, x[order // k]; backward sums each token's k rows by a gather
    at `inverse` (autograd's own gradient of the gather is a scatter-add into zeros: atomics,
    or a sort where deterministic)."""

    @staticmethod
    def forward(ctx, x, groups):
        ctx.groups = groups
        return x[groups.order // groups.top_k]

    @staticmethod
    def backward(ctx, grad):
        # torch ops, not gather_sum: the gradient reaching here is autograd's sum of the base
        # GEMM's and the adapters' (inductor fuses that add into these gathers; the kernel would
        # need it written out first: 24 ms a step more on Qwen3-30B-A3B's shape at 24 GiB). The
        # k rows added one by one, not .sum(1) over a (tokens, k, width) view: compiled, that is
        # an element-wise kernel over (tokens, width) reading k rows an element (a reduction
        # over k is ~8 columns a program: 1.2 ms a layer on that shape, ~1.5 TB/s)
        g = ctx.groups
        inverse = g.inverse.view(-1, g.top_k)
        total = grad[inverse[:, 0]].float()
        for j in range(1, g.top_k):
            total = total + grad[inverse[:, j]].float()
        return total.to(grad.dtype), None


class _Combine(torch.autograd.Function):
    """Sorted rows back to tokens, weighted and summed over the k choices: out[t] =
    sum_j w[t, j] h[inverse[t k + j]] with h = base + extra (the down projection's and its
    adapters' results, added as they are read: `gather_sum`); backward gathers again:
    dh = g[order // k] w[order] (the gradient of both parts), dw[t, j] = <g[t], h[inv[t k + j]]>."""

    @staticmethod
    def forward(ctx, base, extra, weights, groups):
        ctx.groups = groups
        ctx.save_for_backward(base, extra, weights)
        return gather_sum(base, extra, groups, weights,
                          torch.promote_types(base.dtype, weights.dtype))

    @staticmethod
    def backward(ctx, grad):
        base, extra, weights = ctx.saved_tensors
        g = ctx.groups
        if base.is_cuda and _LOADED and nf4_available(base.device):
            # one pass over the rows: dh and dw together (inductor gathers base + extra into a
            # (rows, width) copy for dw: 29 ms a step on Qwen3-30B-A3B's shape at 24 GiB)
            dh, dw = _LOADED[0].combine_grad_op(grad.contiguous(), base, extra, g.inverse,
                                                weights)
            return dh, (dh if extra is not None else None), dw, None
        dh = (grad[g.order // g.top_k] * weights.reshape(-1)[g.order, None]).to(base.dtype)
        h = base if extra is None else base + extra
        rows = h[g.inverse].view(weights.shape[0], g.top_k, -1)
        dw = (rows * grad[:, None, :]).sum(-1)  # in the dtypes autograd's product would use
        return dh, (dh if extra is not None else None), dw.to(weights.dtype), None


def gather_sum(a, b, groups: Groups, weights, dtype):
    """(tokens, width): sum over each token's k sorted rows of (a + b) (b may be None), times
    `weights` (tokens, k). On a GPU where the kit's Triton kernels run, one kernel
    (kit.recipe.experts_kernels, loaded before any layer compiles by `kernels`: a module first
    imported inside a compiled layer breaks its graph); elsewhere torch ops."""
    if a.is_cuda and _LOADED and nf4_available(a.device):  # the answer kept, not a probe
        return _LOADED[0].gather_sum_op(a, b, groups.inverse, weights, groups.top_k, dtype)
    h = a if b is None else a + b
    rows = h[groups.inverse].view(-1, groups.top_k, h.shape[-1])
    return (rows * weights[..., None]).sum(1).to(dtype)


_LOADED: list = []  # kit.recipe.experts_kernels, once `kernels()` loaded it


def nf4_available(device) -> bool:
    from kit.recipe import nf4

    return nf4.available(device)


def kernels():
    """The layout's Triton ops (kit.recipe.experts_kernels), loaded where a CUDA run builds a
    model (kit.recipe.model, beside the 4-bit kernels): triton is imported only there."""
    if not _LOADED:
        from kit.recipe import experts_kernels

        _LOADED.append(experts_kernels)
    return _LOADED[0]


class _Dropped(torch.autograd.Function):
    """x zeroed where drop_mask(seed, rows, ...): keeps the seed and the rows for backward, which
    computes the mask again, instead of the (rows, width) mask itself."""

    @staticmethod
    def forward(ctx, x, seed, rows, threshold):
        ctx.threshold = threshold
        ctx.save_for_backward(seed, rows)
        return x.masked_fill(drop_mask(seed, rows, x.shape[-1], threshold), 0)

    @staticmethod
    def backward(ctx, grad):
        seed, rows = ctx.saved_tensors
        drop = drop_mask(seed, rows, grad.shape[-1], ctx.threshold)
        return grad.masked_fill(drop, 0), None, None, None


class Mask:
    """One LoRA branch's dropout for one layer call: value (flat row, col) is dropped with
    probability `p` (to 2^-31), a function of (seed, row, col) alone, asked at any rows."""

    def __init__(self, seed: torch.Tensor, width: int, p: float):
        self.seed, self.width, self.p = seed, width, p
        self.threshold = threshold_of(p)

    def at(self, rows: torch.Tensor) -> torch.Tensor:
        """The bool drop-mask (len(rows), width) of the flat rows `rows` (token*k + choice)."""
        return drop_mask(self.seed, rows, self.width, self.threshold)

    def zeroed(self, x: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """x (rows in the order of `rows`) zeroed where dropped, not rescaled (_lora folds
        1/(1-p) into B); autograd keeps no mask."""
        return _Dropped.apply(x, self.seed, rows, self.threshold)


def dropout_masks(lora: dict, names: tuple, device) -> dict:
    """{name: [Mask per LoRA branch, or None where its p is 0]}: the seeds drawn by one
    torch.randint on `device`'s default generator, in the order of `names` then branches, as
    a tensor (a Python int would be a new constant, and a recompile, at each compiled call)."""
    branches = [(name, down.shape[1], p) for name in names for down, _, _, p in lora.get(name, ())]
    drawn = sum(p > 0 for _, _, p in branches)
    seeds = (torch.randint(0, 2**31 - 1, (drawn,), dtype=torch.int32, device=device)
             if drawn else None)  # fmt: skip
    masks, i = {name: [] for name in names}, 0
    for name, width, p in branches:
        masks[name].append(Mask(seeds[i], width, p) if p > 0 else None)
        i += p > 0
    return masks


def dropped(x: torch.Tensor, drop: torch.Tensor | None, p: float) -> torch.Tensor:
    """Dropout with a given mask: x zeroed where `drop`, the rest / (1 - p)."""
    return x if drop is None else x.masked_fill(drop, 0).mul_(1 / (1 - p))


def _lora(x, down, up, scale, drop, p, experts, groups, fused=False, into=None):
    """One LoRA branch on sorted rows: (drop(x) @ A_g^T) @ B_g^T * scale, two grouped GEMMs
    (`drop`: its Mask, or None; fused: the mask inside the first GEMM's kernel,
    kit.recipe.lora_down, the same mask); with `into`, into + the branch (fused, on the grouped
    kernel's GPUs: one kernel adds B's product as it makes it, kit.recipe.lora_down.add_rows).
    PEFT's ParamWrapper layout: A (E*r, in) expert-major, B (out, r*E) rank-major. Dropout's
    1/(1-p) and the branch's scale are folded into B (E*r*out values, one multiply), not
    applied to the (rows, width) activations: two passes over them fewer, each way."""
    rank = down.shape[0] // experts
    a = down.reshape(experts, rank, -1)
    b = up.reshape(up.shape[0], rank, experts).permute(2, 1, 0)  # (E, r, out)
    dtype = x.dtype if groups.fast else a.dtype  # the grouped kernel computes in bf16
    a = a.to(dtype)
    b = (b * (scale / (1 - p) if drop is not None else scale)).to(dtype)
    if groups.fast and rank % 8:
        # and 16-byte aligned rows: the rank padded to a multiple of 8 with zero rows (lora.r=4
        # would give 8-byte rows), which adds nothing to the product. Each op is a launch per
        # layer and pass on a host-bound step: none where the rank needs none.
        pad = -rank % 8
        a = torch.nn.functional.pad(a, (0, 0, 0, pad))
        b = torch.nn.functional.pad(b, (0, 0, 0, pad))
    fused = fused and drop is not None
    if groups.fast:  # a unit stride in the last two dims, compiled too (E x r x width: MBs);
        # the fused op lays its own A out (its Triton op reads it row-major): no copy of it here
        a, b = (a if fused else dense_copy(a)), dense_copy(b)
    else:
        b = b.contiguous()
    h = x.to(dtype)
    if fused:
        from kit.recipe.lora_down import add_rows, lora_down

        low = lora_down(h, a, groups.bounds(), groups.order, drop.seed, drop.threshold)
        if into is not None and groups.fast and into.dtype == low.dtype:
            return add_rows(into, low, b, groups.ids, groups.offsets)
        out = gmm(low, b, groups)
    else:
        # masked_fill, not a product with the mask: one dtype, so CUDA's vectorized kernel (a
        # bf16 x bool product casts per element: 113 of 974 GPU ms of the 30B-A3B step); the
        # mask is hashed at the sorted rows (groups.order) and autograd keeps only the seed
        h = h if drop is None else drop.zeroed(h, groups.order)
        out = gmm(gmm(h, a.transpose(1, 2), groups), b, groups)
    return out if into is None else into + out.to(into.dtype)


def _project(module, name, x, lora, drops, groups, apart=False):
    """Projection `name` of the sorted rows x: base + bias + LoRA branches; `apart`: (base + bias,
    the branches' sum or None), for a consumer that adds them as it reads them (`_Combine`)."""
    stored = getattr(module, "_kit_nf4", {}).get(name)
    dtype = stored["state"].dtype if stored is not None else getattr(module, name).dtype
    y = _FrozenBase.apply(x.to(dtype), stack_of(module, name), groups)
    bias = getattr(module, f"{name}_bias", None) if getattr(module, "has_bias", False) else None
    if bias is not None:
        y = y + bias[groups.ids]
    extra, fused = None, getattr(module, "_kit_fused_down", False)
    for (down, up, scale, p), drop in zip(lora.get(name, ()), drops, strict=True):
        # out of place: under training.recompute.keeps the base GEMM's result is kept for
        # backward as it is (kit.recipe.recompute), and torch refuses a kept tensor changed in place
        if not apart:  # added to the base as it is made
            y = _lora(x, down, up, scale, drop, p, module.num_experts, groups, fused, into=y)
            continue
        part = _lora(x, down, up, scale, drop, p, module.num_experts, groups, fused).to(y.dtype)
        extra = part if extra is None else extra + part
    return (y, extra) if apart else y


def forward(self, hidden_states, top_k_index=None, top_k_weights=None, router_indices=None,
            routing_weights=None, lora=None):  # fmt: skip
    """The experts module's forward (transformers' signature), grouped; `lora`: {weight name:
    [(A, B, scale, dropout p)]} from PEFT's ParamWrapper modules (kit.recipe.experts)."""
    index = top_k_index if top_k_index is not None else router_indices
    weights = top_k_weights if top_k_weights is not None else routing_weights
    lora = lora or {}
    first = "gate_up_proj" if self.has_gate else "up_proj"
    stored = getattr(self, "_kit_nf4", {}).get(first)
    dtype = stored["state"].dtype if stored is not None else getattr(self, first).dtype
    # 16-byte aligned rows for the grouped kernel: every width a multiple of 8 bf16 values
    widths = [hidden_states.shape[-1],
              *(d for s in getattr(self, "_kit_nf4", {}).values() for d in s["shape"][1:]),
              *(d for p in self._parameters.values() if p is not None and p.dim() == 3
                for d in p.shape[1:])]  # fmt: skip
    fast = grouped_kernel(hidden_states.device, dtype) and all(w % 8 == 0 for w in widths)
    groups = Groups(index, self.num_experts, fast)
    masks = dropout_masks(lora, (first, "down_proj"), hidden_states.device)
    h = _project(self, first, _Dispatch.apply(hidden_states, groups), lora, masks[first], groups)
    h = self._apply_gate(h) if self.has_gate else self.act_fn(h)
    h, extra = _project(self, "down_proj", h, lora, masks["down_proj"], groups, apart=True)
    if getattr(self, "has_post_expert_norm", False):
        h, extra = self.post_expert_norm(h if extra is None else h + extra), None
    return _Combine.apply(h, extra, weights, groups).to(hidden_states.dtype)
