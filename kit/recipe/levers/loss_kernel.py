"""The fused loss's element-wise pass as one Triton kernel (imported only where it runs: triton
comes with CUDA builds of torch, not with the CPU install).

    losses = rows(logits, target, scale, ignore_index, want_grad)

One program a row of the head's logits (bf16, as the head's matmul wrote them): a first pass
reads the row once for its log-sum-exp (a running maximum and sum in fp32), a second reads it
again (from L2, mostly) and writes the gradient of the summed loss, (softmax - one-hot) x scale,
over the logits in place, in their dtype. The eager chunk of kit.recipe.levers.loss makes an fp32
copy and walks it six times (~40 bytes a logit); this moves ~6. Rows whose target is
`ignore_index` have loss 0 and gradient 0. `scale` is a one-element fp32 tensor (1 / the
denominator), read on the GPU: no synchronisation with the host.

Gap filled: torch has no cross-entropy that writes its gradient in place without an fp32 copy;
liger-kernel has one (inside its fused linear cross-entropy), but it is the peer baseline's
package, not the kit's, and its kernel's arguments are private to each release.
"""

import torch
import triton
import triton.language as tl

BLOCK = 8192  # columns a step of a row's loop (16 a thread at 16 warps: 16-byte loads)
WARPS = 16


@triton.jit
def _rows(logits, stride, target, losses, scale, n_cols, ignore_index,
          WANT_GRAD: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    base = logits + row * stride
    t = tl.load(target + row)
    valid = t != ignore_index
    cols = tl.arange(0, BLOCK)
    top = float("-inf")
    total = 0.0
    for start in range(0, n_cols, BLOCK):
        x = tl.load(base + start + cols, mask=start + cols < n_cols,
                    other=float("-inf")).to(tl.float32)
        new_top = tl.maximum(top, tl.max(x, axis=0))
        total = total * tl.exp(top - new_top) + tl.sum(tl.exp(x - new_top), axis=0)
        top = new_top
    lse = top + tl.log(total)
    hit = tl.load(base + tl.where(valid, t, 0)).to(tl.float32)
    tl.store(losses + row, tl.where(valid, lse - hit, 0.0))
    if WANT_GRAD:
        s = tl.where(valid, tl.load(scale), 0.0)
        for start in range(0, n_cols, BLOCK):
            at = start + cols
            inside = at < n_cols
            x = tl.load(base + at, mask=inside, other=0.0).to(tl.float32)
            g = (tl.exp(x - lse) - tl.where(at == t, 1.0, 0.0)) * s
            tl.store(base + at, g.to(base.dtype.element_ty), mask=inside)


def rows(logits: torch.Tensor, target: torch.Tensor, scale: torch.Tensor, ignore_index: int,
         want_grad: bool) -> torch.Tensor:
    """Each row's loss (fp32, 0 where ignored); with `want_grad` the logits become the gradient
    of sum(losses) x scale with respect to them."""
    assert logits.is_cuda and logits.stride(1) == 1 and logits.shape[0] == target.shape[0]
    losses = torch.empty(logits.shape[0], device=logits.device, dtype=torch.float32)
    if logits.shape[0]:
        _rows[(logits.shape[0],)](logits, logits.stride(0), target, losses,
                                  scale.to(torch.float32), logits.shape[1], ignore_index,
                                  WANT_GRAD=want_grad, BLOCK=BLOCK, num_warps=WARPS)
    return losses
