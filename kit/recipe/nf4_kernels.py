"""The Triton kernel of kit.recipe.nf4 (imported only where it runs: triton comes with CUDA builds
of torch, not with the CPU install).

One program dequantizes ROWS quantization blocks: it reads their packed bytes once (two 4-bit
codes a byte, the high nibble first, as bitsandbytes packs them), looks each code up in the
16-value table, and writes the values scaled by their block's absmax, interleaved back into
order. With double quantization (`NESTED`) the absmax is itself 8-bit: code2[q] x absmax2[block /
BS2] + offset, computed here in the order bitsandbytes computes it (a rounded product, then the
sum: the product is an explicit `mul.rn`, which the compiler cannot fuse with the add), so that
every value is the one bitsandbytes' own dequantize returns, bit for bit."""

import torch
import triton
import triton.language as tl


@triton.jit
def _mul_rn(a, b):  # a * b rounded on its own (no fused multiply-add with what follows)
    return tl.inline_asm_elementwise("mul.rn.f32 $0, $1, $2;", "=r,r,r", [a, b],
                                     dtype=tl.float32, is_pure=True, pack=1)


@triton.jit
def dequant(packed_ptr, code_ptr, absmax_ptr, absmax2_ptr, code2_ptr, offset_ptr, out_ptr, n,
            NESTED: tl.constexpr, BS: tl.constexpr, BS2: tl.constexpr, ROWS: tl.constexpr):
    blk = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    blk_ok = blk < tl.cdiv(n, BS)
    if NESTED:
        q = tl.load(absmax_ptr + blk, mask=blk_ok, other=0).to(tl.int32)
        scale = _mul_rn(tl.load(code2_ptr + q),
                        tl.load(absmax2_ptr + blk // BS2, mask=blk_ok, other=0.0))
        scale = scale + tl.load(offset_ptr)
    else:
        scale = tl.load(absmax_ptr + blk, mask=blk_ok, other=0.0)
    byte = blk[:, None].to(tl.int64) * (BS // 2) + tl.arange(0, BS // 2)[None, :]
    b = tl.load(packed_ptr + byte, mask=byte * 2 < n, other=0).to(tl.int32)
    hi = tl.load(code_ptr + (b >> 4)) * scale[:, None]
    lo = tl.load(code_ptr + (b & 15)) * scale[:, None]
    vals = tl.reshape(tl.join(hi, lo), (ROWS, BS))
    idx = blk[:, None].to(tl.int64) * BS + tl.arange(0, BS)[None, :]
    tl.store(out_ptr + idx, vals.to(out_ptr.dtype.element_ty), mask=idx < n)


VALUES_PER_PROGRAM = 4096  # 64 blocks of 64: 2 KiB read and 8 KiB (bf16) written a program


def dequantize_into(out: torch.Tensor, packed: torch.Tensor, code: torch.Tensor,
                    absmax: torch.Tensor, absmax2: torch.Tensor | None,
                    code2: torch.Tensor | None, offset: torch.Tensor | None,
                    blocksize: int, blocksize2: int) -> torch.Tensor:
    """Fill `out` (contiguous, any float dtype, n values) from `packed` (uint8, ceil(n / 2))."""
    n = out.numel()
    rows = max(1, VALUES_PER_PROGRAM // blocksize)
    nested = absmax2 is not None
    dummy = absmax  # an unread pointer where not nested
    dequant[(triton.cdiv(triton.cdiv(n, blocksize), rows),)](
        packed, code, absmax, absmax2 if nested else dummy, code2 if nested else dummy,
        offset if nested else dummy, out, n, NESTED=nested, BS=blocksize, BS2=blocksize2,
        ROWS=rows, num_warps=4)
    return out
