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
def dequant(packed_ptr, code_ptr, absmax_ptr, absmax2_ptr, code2_ptr, offset_ptr, out_ptr,
            after_ptr, n, NESTED: tl.constexpr, BS: tl.constexpr, BS2: tl.constexpr,
            ROWS: tl.constexpr):
    # after_ptr is never read: a compiled graph's launch depends on it (`dequant_op`)
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
                    blocksize: int, blocksize2: int, after: torch.Tensor | None = None,
                    kernel=dequant) -> torch.Tensor:
    """Fill `out` (contiguous, any float dtype, n values) from `packed` (uint8, ceil(n / 2))."""
    n = out.numel()
    rows = max(1, VALUES_PER_PROGRAM // blocksize)
    nested = absmax2 is not None
    dummy = absmax  # an unread pointer where not nested
    kernel[(triton.cdiv(triton.cdiv(n, blocksize), rows),)](
        packed, code, absmax, absmax2 if nested else dummy, code2 if nested else dummy,
        offset if nested else dummy, out, packed if after is None else after, n, NESTED=nested,
        BS=blocksize, BS2=blocksize2, ROWS=rows, num_warps=4)
    return out


# torch.library.triton_op: eagerly a custom op that launches the kernel; inside a compiled layer
# the compiler sees the kernel itself and launches it from the layer's generated code (with
# inductor's C++ wrapper, from C++: no op dispatch, no Python launcher per call, the lever of
# benchmarks/records/2026-11-29-triton-op-1xh200). Arguments as kit.recipe.nf4's ops.


def _dequantized(packed, code, absmax, absmax2, code2, offset, shape, blocksize, dtype,
                 after=None):
    out = torch.empty(shape, dtype=dtype, device=packed.device)
    return dequantize_into(out, packed, code, absmax, absmax2, code2, offset, blocksize, 256,
                           after, torch.library.wrap_triton(dequant))


@torch.library.triton_op("kit::nf4_linear_triton", mutates_args=())
def linear_op(x: torch.Tensor, packed: torch.Tensor, code: torch.Tensor, absmax: torch.Tensor,
              absmax2: torch.Tensor | None, code2: torch.Tensor | None,
              offset: torch.Tensor | None, shape: list[int], blocksize: int,
              state_dtype: torch.dtype, bias: torch.Tensor | None) -> torch.Tensor:
    w = _dequantized(packed, code, absmax, absmax2, code2, offset, shape, blocksize, state_dtype)
    return torch.nn.functional.linear(x, w if w.dtype == x.dtype else w.to(x.dtype), bias)


@torch.library.triton_op("kit::nf4_dequant_triton", mutates_args=())
def dequant_op(packed: torch.Tensor, code: torch.Tensor, absmax: torch.Tensor,
               absmax2: torch.Tensor | None, code2: torch.Tensor | None,
               offset: torch.Tensor | None, shape: list[int], blocksize: int,
               dtype: torch.dtype, after: torch.Tensor) -> torch.Tensor:
    """The weight, dequantized once `after` exists (never read): backward passes its incoming
    gradient, so that a compiled layer's graph runs this launch in backward, apart from the
    forward's (a graph holding two launches with the same inputs may merge them into one whose
    result, the whole bf16 weight, is kept from forward to backward)."""
    return _dequantized(packed, code, absmax, absmax2, code2, offset, shape, blocksize, dtype,
                        after)
