"""The Triton kernels of kit.recipe.lora_down (imported only where they run: triton comes with
CUDA builds of torch, not with the CPU install).

Each tile computes the dropout mask from its rows' ids and its columns: kit.recipe.drop_mask's
hash, the same bits, in uint32 here (logical shifts: the masks torch's int32 version needs to
undo its arithmetic shifts are not needed), one mix per two elements (~6 integer operations an
element), which with the input's read bounds these kernels. Rows are in segments (`bounds`); each row block finds its
first and last segment by a binary search over the bounds and masks the rows outside a segment
on the r-wide product, not on the input tile. Accumulation in fp32; the tiles autotuned once per
width and rank."""

import torch
import triton
import triton.language as tl

from kit.budget.machine import column_shares


@triton.jit
def mix(h):  # kit.recipe.drop_mask._mix on uint32
    h = h ^ (h >> 16)
    h = h * 0x21F0AAAD
    h = h ^ (h >> 15)
    h = h * 0x735A2D97
    return h ^ (h >> 15)


@triton.jit
def keep(seed, ids, k0, threshold, BK: tl.constexpr):
    """Not kit.recipe.drop_mask._hashed (the values kept) of columns k0 .. k0 + BK (k0 even):
    one mix per pair of columns, half the tile, each hash's low and high 16 bits the pair's two
    draws (joined and laid out as columns 2c, 2c + 1)."""
    key = mix(mix(ids.to(tl.uint32)) ^ seed.to(tl.uint32))
    pairs = (k0 // 2 + tl.arange(0, BK // 2)).to(tl.uint32)
    h = mix(key[:, None] ^ ((pairs ^ 0x5BD1E995) * 0x61C88647)[None, :])
    bits = tl.reshape(tl.join(h & 0xFFFF, h >> 16), (h.shape[0], BK))
    # no method called on `threshold`: inductor's analysis of which arguments a kernel writes
    # traces it with numbers as plain ints, fails on `.to`, and then copies every input
    return bits.to(tl.int32) >= threshold


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
def segment_of(bounds_ptr, row, S, LOG_S: tl.constexpr):
    """The last segment s in [0, S) whose start bounds[s] <= row (empty segments before it
    share its start and are passed over)."""
    lo = row * 0
    hi = lo + S - 1
    for _ in tl.static_range(LOG_S):
        mid = (lo + hi + 1) // 2
        go = tl.load(bounds_ptr + mid) <= row
        lo = tl.where(go, mid, lo)
        hi = tl.where(go, hi, mid - 1)
    return lo


@triton.jit
def segments(bounds_ptr, first, last, S, HAS_BOUNDS: tl.constexpr, LOG_S: tl.constexpr):
    if HAS_BOUNDS:
        return segment_of(bounds_ptr, first, S, LOG_S), segment_of(bounds_ptr, last, S, LOG_S)
    return 0, 0


def _configs(pairs):
    return [triton.Config({"BM": bm, "BK": bk}, num_warps=w) for bm, bk, w in pairs]


# Few configs: each is compiled once per width and rank at the first step (the first tiles are
# the ones measured before autotuning, benchmarks/records/2026-11-29-fused-down-1xh200).
@triton.autotune(configs=_configs([(64, 64, 4), (128, 64, 4), (64, 128, 4)]),
                 key=["K", "R", "HAS_BOUNDS", "DROP", "SPLIT"])
@triton.jit
def down(x_ptr, a_ptr, out_ptr, bounds_ptr, rows_ptr, seed_ptr, M, K, R, S, threshold, SPLIT,
         HAS_BOUNDS: tl.constexpr, HAS_ROWS: tl.constexpr, DROP: tl.constexpr,
         IEEE: tl.constexpr, LOG_S: tl.constexpr, BR: tl.constexpr, BM: tl.constexpr,
         BK: tl.constexpr):
    """Row block pid of share j (program_id 1) of the columns: every SPLIT-th tile of BK from
    j's, into out's j-th (M, R) slice (SPLIT > 1: fp32 partials the host sums)."""
    pid = tl.program_id(0)
    j = tl.program_id(1)
    m = pid * BM + tl.arange(0, BM)
    m_ok = m < M
    r = tl.arange(0, BR)
    ids = row_ids(rows_ptr, m, m_ok, HAS_ROWS)
    seed = 0
    if DROP:
        seed = tl.load(seed_ptr)
    s_lo, s_hi = segments(bounds_ptr, pid * BM, tl.minimum(pid * BM + BM, M) - 1, S,
                          HAS_BOUNDS, LOG_S)
    acc = tl.zeros((BM, BR), dtype=tl.float32)
    for k0 in range(j * BK, K, SPLIT * BK):
        k = k0 + tl.arange(0, BK)
        k_ok = k < K
        xt = tl.load(x_ptr + m[:, None].to(tl.int64) * K + k[None, :],
                     mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        if DROP:
            xt = tl.where(keep(seed, ids, k0, threshold, BK), xt, 0.0)
        for s in range(s_lo, s_hi + 1):
            at = tl.load(a_ptr + s * R * K + r[None, :] * K + k[:, None],
                         mask=(r[None, :] < R) & k_ok[:, None], other=0.0)
            if IEEE:
                part = tl.dot(xt, at, input_precision="ieee")
            else:
                part = tl.dot(xt, at)
            if HAS_BOUNDS:  # rows of other segments: masked on the r-wide product
                start = bound(bounds_ptr, s, M, HAS_BOUNDS)
                end = bound(bounds_ptr, s + 1, M, HAS_BOUNDS)
                part = tl.where(((m >= start) & (m < end))[:, None], part, 0.0)
            acc += part
    tl.store(out_ptr + j.to(tl.int64) * M * R + m[:, None].to(tl.int64) * R + r[None, :],
             acc.to(out_ptr.dtype.element_ty), mask=m_ok[:, None] & (r[None, :] < R))


@triton.autotune(configs=_configs([(64, 64, 4), (128, 64, 4)]),
                 key=["K", "R", "HAS_BOUNDS", "DROP"])
@triton.jit
def dx(g_ptr, a_ptr, dx_ptr, bounds_ptr, rows_ptr, seed_ptr, M, K, R, S, threshold,
       HAS_BOUNDS: tl.constexpr, HAS_ROWS: tl.constexpr, DROP: tl.constexpr,
       IEEE: tl.constexpr, LOG_S: tl.constexpr, BR: tl.constexpr, BM: tl.constexpr,
       BK: tl.constexpr):
    pid = tl.program_id(0)
    m = pid * BM + tl.arange(0, BM)
    k = tl.program_id(1) * BK + tl.arange(0, BK)
    m_ok, k_ok = m < M, k < K
    r = tl.arange(0, BR)
    s_lo, s_hi = segments(bounds_ptr, pid * BM, tl.minimum(pid * BM + BM, M) - 1, S,
                          HAS_BOUNDS, LOG_S)
    gt = tl.load(g_ptr + m[:, None].to(tl.int64) * R + r[None, :],
                 mask=m_ok[:, None] & (r[None, :] < R), other=0.0)
    acc = tl.zeros((BM, BK), dtype=tl.float32)
    for s in range(s_lo, s_hi + 1):
        part = gt
        if HAS_BOUNDS:
            start = bound(bounds_ptr, s, M, HAS_BOUNDS)
            end = bound(bounds_ptr, s + 1, M, HAS_BOUNDS)
            part = tl.where(((m >= start) & (m < end))[:, None], gt, 0.0)
        at = tl.load(a_ptr + s * R * K + r[:, None] * K + k[None, :],
                     mask=(r[:, None] < R) & k_ok[None, :], other=0.0)
        if IEEE:
            acc += tl.dot(part, at, input_precision="ieee")
        else:
            acc += tl.dot(part, at)
    if DROP:
        seed = tl.load(seed_ptr)
        ids = row_ids(rows_ptr, m, m_ok, HAS_ROWS)
        acc = tl.where(keep(seed, ids, tl.program_id(1) * BK, threshold, BK), acc, 0.0)
    tl.store(dx_ptr + m[:, None].to(tl.int64) * K + k[None, :],
             acc.to(dx_ptr.dtype.element_ty), mask=m_ok[:, None] & k_ok[None, :])


DA_BK = 64  # fixed: the host sizes the split of each segment's rows by it


@triton.autotune(configs=[triton.Config({"BM": bm}, num_warps=w)
                          for bm, w in ((64, 4), (128, 4))],
                 key=["K", "R", "HAS_BOUNDS", "DROP"])
@triton.jit
def da(g_ptr, x_ptr, da_ptr, bounds_ptr, rows_ptr, seed_ptr, M, K, R, threshold,
       HAS_BOUNDS: tl.constexpr, HAS_ROWS: tl.constexpr, DROP: tl.constexpr,
       IEEE: tl.constexpr, BR: tl.constexpr, BK: tl.constexpr, BM: tl.constexpr):
    k = tl.program_id(0) * BK + tl.arange(0, BK)
    s = tl.program_id(1)
    j = tl.program_id(2)
    split = tl.num_programs(2)
    k_ok = k < K
    r = tl.arange(0, BR)
    start = bound(bounds_ptr, s, M, HAS_BOUNDS)
    end = bound(bounds_ptr, s + 1, M, HAS_BOUNDS)
    seed = 0
    if DROP:
        seed = tl.load(seed_ptr)
    acc = tl.zeros((BR, BK), dtype=tl.float32)
    for m0 in range(start + j * BM, end, split * BM):
        m = m0 + tl.arange(0, BM)
        m_ok = m < end
        xt = tl.load(x_ptr + m[:, None].to(tl.int64) * K + k[None, :],
                     mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        if DROP:
            ids = row_ids(rows_ptr, m, m_ok, HAS_ROWS)
            xt = tl.where(keep(seed, ids, tl.program_id(0) * BK, threshold, BK), xt, 0.0)
        gt = tl.load(g_ptr + m[:, None].to(tl.int64) * R + r[None, :],
                     mask=m_ok[:, None] & (r[None, :] < R), other=0.0)
        if IEEE:
            acc += tl.dot(tl.trans(gt), xt, input_precision="ieee")
        else:
            acc += tl.dot(tl.trans(gt), xt)
    base = (j.to(tl.int64) * tl.num_programs(1) + s) * R * K
    tl.store(da_ptr + base + r[:, None] * K + k[None, :], acc,
             mask=(r[:, None] < R) & k_ok[None, :])


@triton.autotune(configs=[triton.Config({"BM": bm, "BN": bn}, num_warps=w)
                          for bm, bn, w in ((64, 128, 4), (128, 128, 8), (128, 64, 4))],
                 key=["N", "R", "HAS_IDS"])
@triton.jit
def up_add(c_ptr, low_ptr, up_ptr, out_ptr, ids_ptr, M, N, R, alpha, S_S, S_R, S_N,
           HAS_IDS: tl.constexpr, IEEE: tl.constexpr, BR: tl.constexpr, BM: tl.constexpr,
           BN: tl.constexpr):
    """out = c + alpha * low @ up[s]^T for the rows of segment s: each (BM, BN) tile reads its c
    once, and an r-wide strip of low and of each of its segments' up (the rank padded to BR >=
    16 for the dot); up[s][n, r] at s S_S + n S_N + r S_R (a dense layer's (N, R): one
    segment; a mixture of experts' (S, R, N) factors, each row's segment `ids[m]`, sorted)."""
    m = tl.program_id(0) * BM + tl.arange(0, BM)
    n = tl.program_id(1) * BN + tl.arange(0, BN)
    r = tl.arange(0, BR)
    m_ok, n_ok = m < M, n < N
    at = m[:, None].to(tl.int64) * N + n[None, :]
    ok = m_ok[:, None] & n_ok[None, :]
    c = tl.load(c_ptr + at, mask=ok, other=0.0)  # first: nothing below waits on it
    lo = tl.load(low_ptr + m[:, None].to(tl.int64) * R + r[None, :],
                 mask=m_ok[:, None] & (r[None, :] < R), other=0.0)
    s_lo, s_hi = 0, 0
    if HAS_IDS:
        sid = tl.load(ids_ptr + m, mask=m_ok, other=-1).to(tl.int32)
        s_lo = tl.min(tl.where(m_ok, sid, 2**30), axis=0)
        s_hi = tl.max(sid, axis=0)
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for s in range(s_lo, s_hi + 1):
        ut = tl.load(up_ptr + s * S_S + n[None, :] * S_N + r[:, None] * S_R,
                     mask=n_ok[None, :] & (r[:, None] < R), other=0.0)  # (BR, BN): up[s]^T
        part = lo
        if HAS_IDS:  # rows of other segments: zero on the r-wide strip
            part = tl.where((sid == s)[:, None], lo, 0.0)
        if IEEE:
            acc += tl.dot(part, ut, input_precision="ieee")
        else:
            acc += tl.dot(part, ut)
    tl.store(out_ptr + at, (c.to(tl.float32) + alpha * acc).to(out_ptr.dtype.element_ty), mask=ok)


# ---------------------------------------------------------------- the ops (kit.recipe.lora_down)
# torch.library.triton_op: eagerly a custom op that launches the kernels; inside a compiled layer
# the compiler sees the kernels themselves and launches them from the layer's generated code (no
# op dispatch, no Python launcher per call: measured 127 ms of host time a step as custom ops,
# benchmarks/records/2026-11-29-fused-down-1xh200). Arguments as kit.recipe.lora_down's.


def _launch(x_like, a, bounds, rows, seed):
    """(M, K, R, S, the flags and pointers every kernel takes)."""
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


def down_split(m: int, k: int, device: torch.device) -> int:
    """Shares of the columns for `down` on `device` (kit.budget.machine.column_shares)."""
    return column_shares(m, k, torch.cuda.get_device_properties(device).multi_processor_count)


@torch.library.triton_op("kit::lora_down_triton", mutates_args=())
def down_op(x: torch.Tensor, a: torch.Tensor, bounds: torch.Tensor | None,
            rows: torch.Tensor | None, seed: torch.Tensor | None, threshold: int) -> torch.Tensor:
    x, a = x.contiguous(), a.contiguous()
    m, k, r, segments, flags, ptrs = _launch(x, a, bounds, rows, seed)
    split = down_split(m, k, x.device) if m else 1
    out = x.new_empty(m, r) if split == 1 else x.new_empty(split, m, r, dtype=torch.float32)
    if m:
        torch.library.wrap_triton(down)[lambda meta: (triton.cdiv(m, meta["BM"]), split)](
            x, a, out, *ptrs, m, k, r, segments, threshold, split, LOG_S=_log2(segments),
            **flags)
    return out if split == 1 else out.sum(0).to(x.dtype)


@torch.library.triton_op("kit::lora_down_triton_dx", mutates_args=())
def dx_op(g: torch.Tensor, a: torch.Tensor, bounds: torch.Tensor | None,
          rows: torch.Tensor | None, seed: torch.Tensor | None, threshold: int,
          like: torch.Tensor) -> torch.Tensor:
    g, a = g.contiguous(), a.contiguous()
    m, k, r, segments, flags, ptrs = _launch(g, a, bounds, rows, seed)
    flags["IEEE"] = like.dtype == torch.float32
    out = like.new_empty(m, k)
    if m:
        torch.library.wrap_triton(dx)[
            lambda meta: (triton.cdiv(m, meta["BM"]), triton.cdiv(k, meta["BK"]))](
            g, a, out, *ptrs, m, k, r, segments, threshold, LOG_S=_log2(segments), **flags)
    return out


@torch.library.triton_op("kit::lora_down_triton_da", mutates_args=())
def da_op(g: torch.Tensor, x: torch.Tensor, bounds: torch.Tensor | None,
          rows: torch.Tensor | None, seed: torch.Tensor | None, threshold: int,
          like: torch.Tensor) -> torch.Tensor:
    """One program per (64 columns, segment, share of its rows); a dense layer's one segment is
    split so that the GPU has ~4 programs per multiprocessor, each share summed after (fp32
    partials, no atomics: the same sum every run)."""
    g, x = g.contiguous(), x.contiguous()
    m, k, r, segments, flags, ptrs = _launch(x, like, bounds, rows, seed)
    programs = triton.cdiv(k, DA_BK) * segments
    units = (torch.cuda.get_device_properties(x.device).multi_processor_count
             if x.is_cuda else 8)  # fmt: skip
    split = max(1, min(16, triton.cdiv(4 * units, programs), triton.cdiv(m, 64 * segments)))
    parts = torch.empty(split, segments, r, k, device=x.device, dtype=torch.float32)
    torch.library.wrap_triton(da)[(triton.cdiv(k, DA_BK), segments, split)](
        g, x, parts, *ptrs, m, k, r, threshold, BK=DA_BK, **flags)
    return (parts.sum(0) if split > 1 else parts[0]).to(like.dtype)


@torch.library.triton_op("kit::lora_up_add_triton", mutates_args=())
def up_add_op(c: torch.Tensor, low: torch.Tensor, up: torch.Tensor,
              alpha: float) -> torch.Tensor:
    """c + alpha * low @ up^T (kit.recipe.lora_down.add_up): c (M, N), low (M, R), up (N, R)."""
    up = up.contiguous()
    return _up_add(c, low, up, None, alpha, (0, 1, up.shape[1]))


@torch.library.triton_op("kit::lora_up_add_rows_triton", mutates_args=())
def up_add_rows_op(c: torch.Tensor, low: torch.Tensor, up: torch.Tensor, ids: torch.Tensor,
                   offsets: torch.Tensor) -> torch.Tensor:
    """c + low @ up[s] for the rows of segment s (kit.recipe.grouped_experts' sorted rows):
    c (M, N), low (M, R), up (S, R, N), ids (M,) each row's segment (sorted), offsets int32 (S,)
    the segments' ends (for backward's torch._grouped_mm)."""
    up = up.contiguous()
    return _up_add(c, low, up, ids, 1.0, (up.shape[1] * up.shape[2], up.shape[2], 1))


def _up_add(c, low, up, ids, alpha, strides):
    c, low = c.contiguous(), low.contiguous()
    m, n, r = c.shape[0], c.shape[1], low.shape[1]
    out = torch.empty_like(c)
    if m:
        torch.library.wrap_triton(up_add)[
            lambda meta: (triton.cdiv(m, meta["BM"]), triton.cdiv(n, meta["BN"]))](
            c, low, up, out, ids if ids is not None else up, m, n, r, alpha, *strides,
            HAS_IDS=ids is not None, IEEE=c.dtype == torch.float32,
            BR=max(16, triton.next_power_of_2(r)))
    return out
