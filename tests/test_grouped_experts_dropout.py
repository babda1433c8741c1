"""The grouped experts' LoRA dropout masks (kit.recipe.grouped_experts.Mask): a hash of (seed,
flat row, column), asked at any rows in any order; integer arithmetic that gives the same bits
eager and compiled (and on CUDA); drops p of the values with no pattern over rows or columns."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kit.recipe.drop_mask import drop_mask
from kit.recipe.grouped_experts import Mask, dropout_masks


def _mix(h: np.ndarray) -> np.ndarray:
    """The hash in unsigned 32-bit numpy (logical shifts, products wrap by definition)."""
    h = h.astype(np.uint32)
    h ^= h >> np.uint32(16)
    h *= np.uint32(0x21F0AAAD)
    h ^= h >> np.uint32(15)
    h *= np.uint32(0x735A2D97)
    return h ^ (h >> np.uint32(15))


def _reference(seed: int, rows, width: int, p: float) -> np.ndarray:
    """One hash per pair of columns; column 2c draws its low 16 bits, column 2c + 1 its high."""
    key = _mix(_mix(np.asarray(rows, dtype=np.uint32)) ^ np.uint32(seed))
    cols = np.arange(width, dtype=np.uint32)
    pairs = ((cols >> np.uint32(1)) ^ np.uint32(0x5BD1E995)) * np.uint32(0x61C88647)
    h = _mix(key[:, None] ^ pairs[None, :])
    bits = np.where(cols % 2 == 1, h >> np.uint32(16), h & np.uint32(0xFFFF))
    return bits < np.uint32(round(p * 2**16))


def _mask(seed: int, width: int, p: float) -> Mask:
    return Mask(torch.tensor(seed, dtype=torch.int32), width, p)


# rows near 2^31 and seeds near 2^31 - 1: every product wraps, every shift sees the sign bit
ROWS = torch.tensor([0, 1, 2, 5, 1000, 98303, 2**30 + 7, 2**31 - 2, 2**31 - 1])


@pytest.mark.parametrize("seed", [0, 1, 12345, 2**31 - 2])
def test_the_mask_is_the_32_bit_hash_of_seed_row_and_column(seed):
    """int32 torch on the CPU wraps as unsigned 32-bit arithmetic does: the mask equals the
    hash computed in numpy's uint32, rows at the edges of int32 included."""
    rows = torch.cat([ROWS, torch.randperm(3000, generator=torch.Generator().manual_seed(seed))])
    got = _mask(seed, 300, 0.3).at(rows)
    assert got.dtype == torch.bool and got.shape == (len(rows), 300)
    assert np.array_equal(got.numpy(), _reference(seed, rows.numpy(), 300, 0.3))


def test_the_mask_depends_on_seed_row_and_column_only():
    """Asked at a permutation of the rows, the permuted mask; asked twice, the same; a row asked
    alone, its row of the whole; another seed, another mask."""
    mask = _mask(7, 256, 0.3)
    rows = torch.arange(4000)
    whole = mask.at(rows)
    order = torch.randperm(4000, generator=torch.Generator().manual_seed(0))
    assert torch.equal(mask.at(order), whole[order])
    assert torch.equal(mask.at(rows), whole)
    assert torch.equal(mask.at(torch.tensor([1234])), whole[1234:1235])
    assert torch.equal(mask.at(rows[:10].int()), whole[:10])  # int32 row ids too
    other = _mask(8, 256, 0.3).at(rows)
    agree = (other == whole).float().mean().item()  # independent masks: 1 - 2p(1-p) = 0.58
    assert abs(agree - 0.58) < 0.01


@pytest.mark.parametrize("p", [0.05, 0.3])
def test_the_drop_fraction_is_p_and_shows_no_pattern(p):
    """1,024,000 values: the fraction dropped within 3 sigma of p; per column and per row within
    5 sigma, and spread as a binomial's (no column or row drops more than chance says);
    neighbouring columns, rows and seeds uncorrelated (within 4 / sqrt(n))."""
    rows, width = 1000, 1024
    m = _mask(2024, width, p).at(torch.arange(rows)).double()
    assert abs(Mask(torch.tensor(0), width, p).threshold / 2**16 - p) < 1e-3 * p
    n = rows * width
    assert abs(m.mean().item() - p) < 3 * (p * (1 - p) / n) ** 0.5
    for fractions, count in ((m.mean(0), rows), (m.mean(1), width)):
        sigma = (p * (1 - p) / count) ** 0.5
        assert (fractions - p).abs().max() < 5 * sigma
        assert 0.85 < fractions.std().item() / sigma < 1.15

    def correlation(a, b):
        a, b = a.flatten() - a.mean(), b.flatten() - b.mean()
        return ((a * b).mean() / (a.std() * b.std())).item()

    bound = 4 / n**0.5
    assert abs(correlation(m[:, 1:], m[:, :-1])) < bound  # adjacent columns
    assert abs(correlation(m[1:], m[:-1])) < bound  # adjacent rows
    for seed in (2025, 2024 ^ 1, 2024 ^ 2**30):  # neighbouring seeds, one bit apart
        assert abs(correlation(m, _mask(seed, width, p).at(torch.arange(rows)).double())) < bound


def test_dropout_masks_draw_tensor_seeds_from_torch_and_none_where_p_is_0():
    """One seed per branch with p > 0, as a 0-d int32 tensor (a compiled layer sees a tensor,
    not a new constant per call), drawn from torch's generator: torch.manual_seed repeats them."""
    a = torch.zeros(8, 64)
    lora = {"gate_up_proj": [(a, None, 1.0, 0.05), (a, None, 1.0, 0.0)],
            "down_proj": [(torch.zeros(8, 32), None, 1.0, 0.3)]}  # fmt: skip
    torch.manual_seed(3)
    first = dropout_masks(lora, ("gate_up_proj", "down_proj"), "cpu")
    torch.manual_seed(3)
    again = dropout_masks(lora, ("gate_up_proj", "down_proj"), "cpu")
    up, off = first["gate_up_proj"]
    (down,) = first["down_proj"]
    assert off is None and (up.width, up.p, down.width, down.p) == (64, 0.05, 32, 0.3)
    for mask in (up, down):
        assert mask.seed.dtype == torch.int32 and mask.seed.dim() == 0
    assert up.seed != down.seed
    assert again["gate_up_proj"][0].seed == up.seed and again["down_proj"][0].seed == down.seed
    assert dropout_masks({"down_proj": [(a, None, 1.0, 0.0)]}, ("down_proj",), "cpu") == {
        "down_proj": [None]}  # fmt: skip


def test_zeroed_keeps_no_mask_for_backward_and_its_gradient_is_masked():
    """Mask.zeroed (what the grouped forward runs): x zeroed where dropped; autograd keeps the
    seed and the rows, no (rows, width) mask; the gradient is zero where the value was dropped."""
    mask = _mask(11, 64, 0.3)
    rows = torch.randperm(500, generator=torch.Generator().manual_seed(1))
    x = torch.randn(500, 64, requires_grad=True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        y = mask.zeroed(x, rows)
    drop = mask.at(rows)
    assert torch.equal(y, x.detach().masked_fill(drop, 0))
    assert sorted(t.numel() for t in saved) == [1, 500]
    (grad,) = torch.autograd.grad(y, x, torch.ones_like(y))
    assert torch.equal(grad, (~drop).float())


def test_a_compiled_mask_equals_eager_bit_for_bit():
    """torch.compile (inductor's C++ backend on the CPU) of Mask.zeroed drops the same values as
    eager, at rows and seeds that make every product wrap, and its gradient is eager's."""

    def zeroed(x, seed, rows):
        return Mask(seed, x.shape[1], 0.05).zeroed(x, rows)

    compiled = torch.compile(zeroed, fullgraph=True)
    rows = torch.cat([ROWS, torch.randperm(3000, generator=torch.Generator().manual_seed(2))])
    x = torch.randn(len(rows), 1000, requires_grad=True)
    cot = torch.randn(len(rows), 1000)
    for seed in (0, 99, 2**31 - 2):
        s = torch.tensor(seed, dtype=torch.int32)
        try:
            got = compiled(x, s, rows)
        except Exception as error:  # no C++ compiler here: inductor's CPU backend cannot build
            said = f"{type(error).__name__} {error}"
            if seed == 0 and any(n in said for n in ("CppCompileError", "InvalidCxxCompiler")):
                pytest.skip("inductor's C++ backend cannot compile on this machine")
            raise
        want = zeroed(x, s, rows)  # x has no zeros: equal outputs, equal masks
        assert torch.equal(got, want)
        assert torch.equal(
            torch.autograd.grad(got, x, cot)[0], torch.autograd.grad(want, x, cot)[0]
        )


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_the_mask_on_cuda_eager_and_compiled_equals_the_cpus():
    """The same bits on CUDA as on the CPU: eager (one kernel compiled apart), op by op, and
    inside a compiled function (inductor's Triton kernel)."""
    from kit.recipe.drop_mask import _hashed, threshold_of

    threshold = threshold_of(0.05)

    def masked(seed, rows):
        return drop_mask(seed, rows, 2048, threshold)

    rows = torch.cat([ROWS, torch.randperm(98304, generator=torch.Generator().manual_seed(3))])
    s = torch.tensor(2**31 - 2, dtype=torch.int32)
    want = masked(s, rows)
    rows_gpu, s_gpu = rows.cuda(), s.cuda()
    cols = torch.arange(2048, dtype=torch.int32, device="cuda")
    assert torch.equal(masked(s_gpu, rows_gpu).cpu(), want)
    assert torch.equal(masked(s_gpu, rows_gpu[:1000]).cpu(), want[:1000])  # another row count
    assert torch.equal(_hashed(s_gpu, rows_gpu, cols, threshold).cpu(), want)
    assert torch.equal(torch.compile(masked, fullgraph=True)(s_gpu, rows_gpu).cpu(), want)
