"""One attention tile's forward with its softmax statistics, and its backward from them
(kit.recipe.levers.attention_tiles).

    out, lse, aux = forward(q, k, v, start, scale)               # no graph
    dq = backward(dout, q, k, v, out, lse, aux, start, scale, dk, dv)   # adds into dk, dv

`q` holds a tile of T queries at positions start .. start + T (batch, heads, T, head_dim); `k`
and `v` the keys and values at 0 .. start + T (batch, key heads, start + T, head_dim). The tile
attends to the keys before `start` without a mask and to the T x T block on the diagonal
causally; each part runs on a fused kernel with its log-sum-exp, and the two are merged as
flash-decoding and ring attention merge partial attention: lse = logaddexp(lse_1, lse_2),
out = sum_i exp(lse_i - lse) out_i. Backward runs each part's backward kernel with the merged
output and log-sum-exp: the kernels recompute the probabilities from them, so each part's
gradient is its share of the whole tile's, and no forward runs again.

Grouped-query heads: the unmasked part folds the query heads that share a key head into its
query rows (no copies of the keys); the diagonal block repeats its T keys per query head.

The kernels (`backend`): cuDNN's attention on Hopper GPUs, PyTorch's flash attention on others,
PyTorch's CPU flash kernel on a CPU; aten ops all, the ones F.scaled_dot_product_attention
dispatches to.

Gap filled: F.scaled_dot_product_attention neither returns the log-sum-exp nor takes it back, so
autograd through it must run a tile's forward again in backward; and its lower-right causal mask
(the tile's shape) runs only on the flash kernel.
"""

from __future__ import annotations

import os

import torch

BACKENDS = ("flash", "cudnn", "cpu")


def backend(device: torch.device) -> str:
    """cuDNN's kernels on Hopper GPUs (measured there: 1.7x flash's speed for a layer's tiles,
    benchmarks/records/2026-11-27-tile-kernels-context-512k-8b-1xh100), flash's elsewhere; KIT_TILE_KERNEL=flash|cudnn
    chooses (benchmarks/tools/tile_attention_bench.py)."""
    if device.type != "cuda":
        return "cpu"
    name = os.environ.get("KIT_TILE_KERNEL") or (
        "cudnn" if torch.cuda.get_device_capability(device)[0] == 9
        and torch.backends.cudnn.is_available() else "flash")
    if name not in BACKENDS[:2]:
        raise ValueError(f"KIT_TILE_KERNEL: {name!r} is not allowed; allowed: flash, cudnn")
    return name


def _fwd(q, k, v, causal: bool, scale: float):
    """(out, lse (batch, heads, rows) fp32, what the backward op needs) of one kernel call."""
    kind = backend(q.device)
    if kind == "cpu":
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, 0.0, causal, scale=scale)
        return out, lse, ()
    if kind == "flash":
        r = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, False,
                                                               scale=scale)
        return r[0], r[1], r[2:8]
    r = torch.ops.aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, causal,
                                                           False, scale=scale)
    return r[0], r[1].view(r[0].shape[:3]), r[2:8]


def _bwd(dout, q, k, v, out, lse, aux, causal: bool, scale: float):
    kind = backend(q.device)
    if kind == "cpu":
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout, q, k, v, out, lse, 0.0, causal, scale=scale)
    if kind == "flash":
        cum_q, cum_k, max_q, max_k, seed, offset = aux
        return torch.ops.aten._scaled_dot_product_flash_attention_backward(
            dout, q, k, v, out, lse, cum_q, cum_k, max_q, max_k, 0.0, causal, seed, offset,
            scale=scale)
    cum_q, cum_k, max_q, max_k, seed, offset = aux
    return torch.ops.aten._scaled_dot_product_cudnn_attention_backward(
        dout, q, k, v, out, lse.unsqueeze(-1), seed, offset, None, cum_q, cum_k, max_q, max_k,
        0.0, causal, scale=scale)


def _fold(t, groups: int):
    """(batch, heads, rows, d) -> (batch, key heads, groups * rows, d): the query heads that share
    a key head as more rows of it (heads h*groups .. h*groups + groups - 1 read key head h)."""
    b, h, n, d = t.shape
    return t.reshape(b, h // groups, groups * n, d)


def _unfold(t, groups: int):
    b, h, n, d = t.shape
    return t.reshape(b, h * groups, n // groups, d)


def _diag_kv(t, groups: int):
    return t.repeat_interleave(groups, dim=1) if groups > 1 else t


def forward(q, k, v, start: int, scale: float):
    """The tile's attention output (batch, heads, T, d), log-sum-exp (batch, heads, T) and what
    `backward` needs of the kernels' own outputs (`aux`)."""
    groups = q.shape[1] // k.shape[1]
    kd, vd = _diag_kv(k[:, :, start:], groups), _diag_kv(v[:, :, start:], groups)
    out, lse, aux = _fwd(q, kd, vd, True, scale)
    if start == 0:
        return out, lse, (aux,)
    pre, pre_lse, pre_aux = _fwd(_fold(q.contiguous(), groups), k[:, :, :start],
                                 v[:, :, :start], False, scale)
    pre, pre_lse = _unfold(pre, groups), pre_lse.reshape(lse.shape)
    total = torch.logaddexp(lse, pre_lse)
    merged = (out.float() * (lse - total).exp().unsqueeze(-1)
              + pre.float() * (pre_lse - total).exp().unsqueeze(-1)).to(q.dtype)
    return merged, total, (aux, pre_aux)


def backward(dout, q, k, v, out, lse, aux, start: int, scale: float, dk, dv):
    """dq of `forward`'s output for the tile, from its output, log-sum-exp and aux; adds the
    keys' and values' gradients into dk and dv (over keys 0 .. start + T, key heads)."""
    groups = q.shape[1] // k.shape[1]
    dout, out = dout.contiguous(), out.contiguous()
    kd, vd = _diag_kv(k[:, :, start:], groups), _diag_kv(v[:, :, start:], groups)
    dq, dkd, dvd = _bwd(dout, q, kd, vd, out, lse, aux[0], True, scale)
    b, _, t, d = dkd.shape
    dk[:, :, start:] += dkd.reshape(b, -1, groups, t, d).sum(2)
    dv[:, :, start:] += dvd.reshape(b, -1, groups, t, d).sum(2)
    del dkd, dvd
    if start == 0:
        return dq
    fq = _fold(q.contiguous(), groups)
    fdq, dkp, dvp = _bwd(_fold(dout, groups), fq, k[:, :, :start], v[:, :, :start],
                         _fold(out, groups), lse.reshape(fq.shape[:3]).contiguous(), aux[1],
                         False, scale)
    dk[:, :, :start] += dkp
    dv[:, :, :start] += dvp
    return dq + _unfold(fdq, groups)
