"""The dropout mask as a function of (seed, row, column): a 32-bit integer hash, asked at any rows
in any order, the same bits on the CPU and CUDA, eager, compiled and inside Triton kernels
(kit.recipe.lora_down_kernels computes it in its tiles).

    drop = drop_mask(seed, rows, width, threshold)   # bool (len(rows), width)

Users: the grouped experts' LoRA dropout (kit.recipe.grouped_experts: the sorted rows' masks)
and the adapters' fused down-projection (kit.recipe.lora_down). Gap filled: torch has no
counter-based random numbers keyed by the caller's indices (bernoulli draws Philox in the
tensor's own order: a mask for rows in another order must be drawn whole and gathered).
"""

from __future__ import annotations

import functools

import torch


def _mix(h: torch.Tensor) -> torch.Tensor:
    """A 32-bit hash of each value of the int32 tensor `h`: an xorshift-multiply finalizer of two
    rounds (constants 0x21f0aaad, 0x735a2d97: low bias, both below 2^31, so they are int32 literals
    in Triton and C++ alike). Products wrap mod 2^32 on every backend; torch's `>>` on a signed
    int is arithmetic, so each shift is masked to its logical result."""
    h = h ^ ((h >> 16) & 0xFFFF)
    h = h * 0x21F0AAAD
    h = h ^ ((h >> 15) & 0x1FFFF)
    h = h * 0x735A2D97
    return h ^ ((h >> 15) & 0x1FFFF)


def _hashed(seed, rows, cols, threshold):
    """drop_mask's arithmetic. One mix per pair of columns (2c, 2c + 1), its low 16 bits drawing
    column 2c and its high 16 bits column 2c + 1: the kernels (kit.recipe.lora_down_kernels)
    hash half a tile and split each hash in two. The row's key is hashed once per row; the pair
    is only spread, (pair ^ 0x5bd1e995) * 0x61c88647 (odd: 2^32 over the golden ratio), so that
    distinct pairs stay distinct and their xor-differences unaligned: no two rows' keys give the
    same set of inputs (a mixed pair would cost a second mix). The xor first keeps inductor from
    folding arange * constant into index arithmetic (its CPU kernel of a compiled layer then
    failed an index check). Here (torch ops) each column computes its pair's mix: the same bits."""
    key = _mix(_mix(rows.to(torch.int32)) ^ seed)
    h = _mix(key[:, None] ^ (((cols >> 1) ^ 0x5BD1E995) * 0x61C88647))
    bits = torch.where((cols & 1) == 1, (h >> 16) & 0xFFFF, h & 0xFFFF)
    return bits < threshold


@functools.cache
def _fused():
    return torch.compile(_hashed)


@functools.cache
def _fusable(device: torch.device) -> bool:
    """Triton builds for this GPU (what inductor generates its CUDA kernels with)."""
    import importlib.util

    return importlib.util.find_spec("triton") is not None and \
        torch.cuda.get_device_capability(device) >= (7, 0)  # fmt: skip


def drop_mask(seed: torch.Tensor, rows: torch.Tensor, width: int, threshold: int) -> torch.Tensor:
    """Bool (len(rows), width): 16 bits of hash(seed, row, col // 2) < `threshold` (p * 2^16), as
    mix(mix(mix(row) ^ seed) ^ spread(col // 2)), not a hash of the flat index row * width + col
    (which passes 2^31 at large batches). Inside a compiled layer these ops fuse into the kernel that
    reads the input; eager on a GPU they run as one compiled kernel (the rows' count dynamic),
    since one by one they are ~15 passes over int32 (rows, width) tensors (6.6 ms and 2.3 GB at
    98,304 x 2,048 on an H200, against 0.4 ms for one fused kernel). On the CPU, op by op."""
    cols = torch.arange(width, dtype=torch.int32, device=rows.device)
    if rows.is_cuda and not torch.compiler.is_compiling() and _fusable(rows.device):
        torch._dynamo.maybe_mark_dynamic(rows, 0)
        torch._dynamo.mark_static(cols, 0)  # a constant width: no integer division per element
        return _fused()(seed, rows, cols, threshold)
    return _hashed(seed, rows, cols, threshold)


DRAW_BITS = 16  # bits of a hash a value's draw takes: two values a hash, p to 2^-16


def threshold_of(p: float) -> int:
    """drop_mask's threshold for dropout rate p: dropped where its 16 bits < p * 2^16."""
    return min(round(p * 2**DRAW_BITS), 2**DRAW_BITS - 1)
