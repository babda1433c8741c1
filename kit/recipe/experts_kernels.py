"""The Triton kernels of kit.recipe.grouped_experts' token layout (imported only where they run:
triton comes with CUDA builds of torch, not with the CPU install).

`gather_sum`: out[t] = sum over j < k of w[t, j] * (a[inv[t k + j]] + b[inv[t k + j]]), the
sorted rows of a mixture-of-experts layer back in token order, weighted by the router and summed
over the k choices (the layer's output, `_Combine`). One program reads each of its tokens' k
rows once, in fp32, and writes the token's row: the rows are never gathered into a (tokens x k,
width) copy first, and with `b` the base projection's and the adapters' results are added as
they are read (no (tokens x k, width) sum in memory either). `combine_grad`: that sum's two
gradients (the rows', the router weights') in one pass over the rows.

Gap filled: inductor compiles the weighted sum as a persistent reduction over the k choices
whose programs are few tokens wide, after gathering the rows into a copy; measured on an H200
(Qwen3-30B-A3B's shape, 26,624 tokens x 8 choices x 2,048): 1.30 ms against 0.44 ms for the
kernel (benchmarks/records/2026-11-30-split-gather-2xh200), and at the step with its gradients'
kernel +4.8% (benchmarks/records/2026-12-01-experts-rows-1xh200)."""

import torch
import triton
import triton.language as tl


@triton.autotune(configs=[triton.Config({"BT": bt, "BH": bh}, num_warps=w)
                          for bt, bh, w in ((4, 512, 4), (8, 256, 4), (2, 1024, 4),
                                            (8, 512, 8))],
                 key=["H", "K", "HAS_B"])
@triton.jit
def gather_sum(a_ptr, b_ptr, inv_ptr, w_ptr, out_ptr, T, H, K: tl.constexpr,
               HAS_B: tl.constexpr, BT: tl.constexpr, BH: tl.constexpr):
    t = tl.program_id(0) * BT + tl.arange(0, BT)
    h = tl.program_id(1) * BH + tl.arange(0, BH)
    t_ok, h_ok = t < T, h < H
    ok = t_ok[:, None] & h_ok[None, :]
    acc = tl.zeros((BT, BH), dtype=tl.float32)
    for j in tl.static_range(K):
        row = tl.load(inv_ptr + t.to(tl.int64) * K + j, mask=t_ok, other=0).to(tl.int64)
        at = row[:, None] * H + h[None, :]
        x = tl.load(a_ptr + at, mask=ok, other=0.0).to(tl.float32)
        if HAS_B:
            x += tl.load(b_ptr + at, mask=ok, other=0.0).to(tl.float32)
        x *= tl.load(w_ptr + t.to(tl.int64) * K + j, mask=t_ok, other=0.0).to(tl.float32)[:, None]
        acc += x
    tl.store(out_ptr + t[:, None].to(tl.int64) * H + h[None, :],
             acc.to(out_ptr.dtype.element_ty), mask=ok)


@torch.library.triton_op("kit::gather_sum_triton", mutates_args=())
def gather_sum_op(a: torch.Tensor, b: torch.Tensor | None, inverse: torch.Tensor,
                  weights: torch.Tensor, top_k: int, dtype: torch.dtype) -> torch.Tensor:
    """(T, H) in `dtype` from a (and b), (T k, H) sorted rows, `inverse` (T k,) each token's
    choices' rows, `weights` (T, k) (kit.recipe.grouped_experts.gather_sum)."""
    a = a.contiguous()
    b = b.contiguous() if b is not None else None
    rows, width = a.shape
    tokens = rows // top_k
    out = torch.empty(tokens, width, dtype=dtype, device=a.device)
    if tokens:
        torch.library.wrap_triton(gather_sum)[
            lambda meta: (triton.cdiv(tokens, meta["BT"]), triton.cdiv(width, meta["BH"]))](
            a, b if b is not None else a, inverse.contiguous(), weights.contiguous(), out,
            tokens, width, K=top_k, HAS_B=b is not None)
    return out


@triton.autotune(configs=[triton.Config({"BT": bt, "BH": bh}, num_warps=w)
                          for bt, bh, w in ((4, 256, 4), (8, 256, 8), (2, 512, 4))],
                 key=["H", "K", "HAS_B"])
@triton.jit
def combine_grad(g_ptr, a_ptr, b_ptr, inv_ptr, w_ptr, dh_ptr, dw_ptr, T, H, K: tl.constexpr,
                 KP: tl.constexpr, HAS_B: tl.constexpr, BT: tl.constexpr, BH: tl.constexpr):
    """The weighted sum's gradients in one pass over the rows: dh[row(t, j)] = g[t] w[t, j]
    (each sorted row written once: the rows are a permutation) and dw[t, j] = <g[t], (a +
    b)[row(t, j)]>, each token's g read once a column block."""
    t = tl.program_id(0) * BT + tl.arange(0, BT)
    t_ok = t < T
    cols = tl.arange(0, KP)
    acc = tl.zeros((BT, KP), dtype=tl.float32)
    for h0 in range(0, H, BH):
        h = h0 + tl.arange(0, BH)
        ok = t_ok[:, None] & (h < H)[None, :]
        gt = tl.load(g_ptr + t[:, None].to(tl.int64) * H + h[None, :], mask=ok,
                     other=0.0).to(tl.float32)
        for j in tl.static_range(K):
            row = tl.load(inv_ptr + t.to(tl.int64) * K + j, mask=t_ok, other=0).to(tl.int64)
            wj = tl.load(w_ptr + t.to(tl.int64) * K + j, mask=t_ok, other=0.0).to(tl.float32)
            at = row[:, None] * H + h[None, :]
            x = tl.load(a_ptr + at, mask=ok, other=0.0).to(tl.float32)
            if HAS_B:
                x += tl.load(b_ptr + at, mask=ok, other=0.0).to(tl.float32)
            part = tl.sum(x * gt, axis=1)
            acc += tl.where(cols[None, :] == j, part[:, None], 0.0)
            tl.store(dh_ptr + at, (gt * wj[:, None]).to(dh_ptr.dtype.element_ty), mask=ok)
    tl.store(dw_ptr + t[:, None].to(tl.int64) * K + cols[None, :],
             acc.to(dw_ptr.dtype.element_ty), mask=t_ok[:, None] & (cols < K)[None, :])


@torch.library.triton_op("kit::combine_grad_triton", mutates_args=())
def combine_grad_op(g: torch.Tensor, a: torch.Tensor, b: torch.Tensor | None,
                    inverse: torch.Tensor, weights: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """(dh (T k, H) in a's dtype, dw (T, k) in the weights'): the gradients of gather_sum_op's
    weighted sum for its incoming gradient g (T, H)."""
    g, a = g.contiguous(), a.contiguous()
    b = b.contiguous() if b is not None else None
    tokens, top_k = weights.shape
    width = a.shape[1]
    dh = torch.empty_like(a)
    dw = torch.empty(tokens, top_k, dtype=weights.dtype, device=a.device)
    if tokens:
        torch.library.wrap_triton(combine_grad)[lambda meta: (triton.cdiv(tokens, meta["BT"]),)](
            g, a, b if b is not None else a, inverse.contiguous(), weights.contiguous(), dh, dw,
            tokens, width, K=top_k, KP=triton.next_power_of_2(top_k), HAS_B=b is not None)
    return dh, dw
