"""The Triton kernels of kit.recipe.lora_down (imported only where they run: triton is on CUDA
machines, not in the CPU install). Each tile computes the dropout mask from its rows' ids and
columns (kit.recipe.drop_mask's hash, the same bits), accumulates in fp32 and
masks the rows outside the segment it multiplies."""

import triton
import triton.language as tl


@triton.jit
def mix(h):  # kit.recipe.drop_mask._mix, the same bits
    h = h ^ ((h >> 16) & 0xFFFF)
    h = h * 0x21F0AAAD
    h = h ^ ((h >> 15) & 0x1FFFF)
    h = h * 0x735A2D97
    return h ^ ((h >> 15) & 0x1FFFF)

@triton.jit
def keep(seed, ids, cols, threshold):  # kit.recipe.drop_mask._hashed, negated
    key = mix(mix(ids) ^ seed)
    h = mix(key[:, None] ^ ((cols ^ 0x5BD1E995) * 0x61C88647)[None, :])
    return ((h >> 1) & 0x7FFFFFFF) >= threshold

@triton.jit
def row_ids(rows_ptr, m, ok, HAS_ROWS: tl.constexpr):
    if HAS_ROWS:
        return tl.load(rows_ptr + m, mask=ok, other=0).to(tl.int32)
    return m.to(tl.int32)

@triton.jit
def bound(bounds_ptr, s, M, HAS_BOUNDS: tl.constexpr):
    if HAS_BOUNDS:
        return tl.load(bounds_ptr + s)
    return s * M  # one segment: 0, M

@triton.jit
def segment_range(lo_ptr, hi_ptr, pid, HAS_BOUNDS: tl.constexpr):
    if HAS_BOUNDS:
        return tl.load(lo_ptr + pid), tl.load(hi_ptr + pid)
    return 0, 0

@triton.jit
def down(x_ptr, a_ptr, out_ptr, bounds_ptr, lo_ptr, hi_ptr, rows_ptr, seed_ptr, M, K, R,
         threshold, HAS_BOUNDS: tl.constexpr, HAS_ROWS: tl.constexpr, DROP: tl.constexpr,
         IEEE: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr, BR: tl.constexpr):
    pid = tl.program_id(0)
    m = pid * BM + tl.arange(0, BM)
    m_ok = m < M
    r = tl.arange(0, BR)
    ids = row_ids(rows_ptr, m, m_ok, HAS_ROWS)
    seed = 0
    if DROP:
        seed = tl.load(seed_ptr)
    s_lo, s_hi = segment_range(lo_ptr, hi_ptr, pid, HAS_BOUNDS)
    acc = tl.zeros((BM, BR), dtype=tl.float32)
    for k0 in range(0, K, BK):
        k = k0 + tl.arange(0, BK)
        k_ok = k < K
        xt = tl.load(x_ptr + m[:, None].to(tl.int64) * K + k[None, :],
                     mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        if DROP:
            xt = tl.where(keep(seed, ids, k, threshold), xt, 0.0)
        for s in range(s_lo, s_hi + 1):
            start = bound(bounds_ptr, s, M, HAS_BOUNDS)
            end = bound(bounds_ptr, s + 1, M, HAS_BOUNDS)
            rows_in = (m >= start) & (m < end)
            at = tl.load(a_ptr + s * R * K + r[None, :] * K + k[:, None],
                         mask=(r[None, :] < R) & k_ok[:, None], other=0.0)
            part = tl.where(rows_in[:, None], xt, 0.0)
            if IEEE:
                acc += tl.dot(part, at, input_precision="ieee")
            else:
                acc += tl.dot(part, at)
    tl.store(out_ptr + m[:, None].to(tl.int64) * R + r[None, :],
             acc.to(out_ptr.dtype.element_ty), mask=m_ok[:, None] & (r[None, :] < R))

@triton.jit
def dx(g_ptr, a_ptr, dx_ptr, bounds_ptr, lo_ptr, hi_ptr, rows_ptr, seed_ptr, M, K, R,
       threshold, HAS_BOUNDS: tl.constexpr, HAS_ROWS: tl.constexpr, DROP: tl.constexpr,
       IEEE: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr, BR: tl.constexpr):
    pid = tl.program_id(0)
    m = pid * BM + tl.arange(0, BM)
    k = tl.program_id(1) * BK + tl.arange(0, BK)
    m_ok, k_ok = m < M, k < K
    r = tl.arange(0, BR)
    s_lo, s_hi = segment_range(lo_ptr, hi_ptr, pid, HAS_BOUNDS)
    gt = tl.load(g_ptr + m[:, None].to(tl.int64) * R + r[None, :],
                 mask=m_ok[:, None] & (r[None, :] < R), other=0.0)
    acc = tl.zeros((BM, BK), dtype=tl.float32)
    for s in range(s_lo, s_hi + 1):
        start = bound(bounds_ptr, s, M, HAS_BOUNDS)
        end = bound(bounds_ptr, s + 1, M, HAS_BOUNDS)
        rows_in = (m >= start) & (m < end)
        at = tl.load(a_ptr + s * R * K + r[:, None] * K + k[None, :],
                     mask=(r[:, None] < R) & k_ok[None, :], other=0.0)
        part = tl.where(rows_in[:, None], gt, 0.0)
        if IEEE:
            acc += tl.dot(part, at, input_precision="ieee")
        else:
            acc += tl.dot(part, at)
    if DROP:
        seed = tl.load(seed_ptr)
        ids = row_ids(rows_ptr, m, m_ok, HAS_ROWS)
        acc = tl.where(keep(seed, ids, k, threshold), acc, 0.0)
    tl.store(dx_ptr + m[:, None].to(tl.int64) * K + k[None, :],
             acc.to(dx_ptr.dtype.element_ty), mask=m_ok[:, None] & k_ok[None, :])

@triton.jit
def da(g_ptr, x_ptr, da_ptr, bounds_ptr, rows_ptr, seed_ptr, M, K, R, threshold, SPLIT,
       HAS_BOUNDS: tl.constexpr, HAS_ROWS: tl.constexpr, DROP: tl.constexpr,
       IEEE: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr, BR: tl.constexpr):
    k = tl.program_id(0) * BK + tl.arange(0, BK)
    s = tl.program_id(1)
    j = tl.program_id(2)
    k_ok = k < K
    r = tl.arange(0, BR)
    start = bound(bounds_ptr, s, M, HAS_BOUNDS)
    end = bound(bounds_ptr, s + 1, M, HAS_BOUNDS)
    seed = 0
    if DROP:
        seed = tl.load(seed_ptr)
    acc = tl.zeros((BR, BK), dtype=tl.float32)
    for m0 in range(start + j * BM, end, SPLIT * BM):
        m = m0 + tl.arange(0, BM)
        m_ok = m < end
        xt = tl.load(x_ptr + m[:, None].to(tl.int64) * K + k[None, :],
                     mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        if DROP:
            ids = row_ids(rows_ptr, m, m_ok, HAS_ROWS)
            xt = tl.where(keep(seed, ids, k, threshold), xt, 0.0)
        gt = tl.load(g_ptr + m[:, None].to(tl.int64) * R + r[None, :],
                     mask=m_ok[:, None] & (r[None, :] < R), other=0.0)
        if IEEE:
            acc += tl.dot(tl.trans(gt), xt, input_precision="ieee")
        else:
            acc += tl.dot(tl.trans(gt), xt)
    base = (j.to(tl.int64) * tl.num_programs(1) + s) * R * K
    tl.store(da_ptr + base + r[:, None] * K + k[None, :], acc,
             mask=(r[:, None] < R) & k_ok[None, :])
