"""Exercises of notebook 02 (quantize NF4): the bytes of one Llama-3-8B layer in NF4 with double
quantization (02.1), its packed tensor's shape in bf16 storage (02.2), and what each of 2 FSDP
ranks keeps of it (02.3), computed with bitsandbytes through kit.lab.quantize_nf4 (imported when
a check or a solution runs, not with this module: kernels without torch list every exercise).
Hands-on: one block of 64 weights quantized to NF4 by hand (02.4) and packed two codes a byte
(02.5), each compared with what bitsandbytes' quantize_4bit makes of the same block."""

from __future__ import annotations

from functools import cache

from kit.lab.exercises import Exercise
from kit.lab.exercises.checks import number

SHAPE = (1024, 4096)  # Llama-3-8B's k_proj: (out, in), 8 kv heads x 128 dims from 4,096 features
N = SHAPE[0] * SHAPE[1]
# Likely answers, counted by hand (a check tells them apart within 0.2%).
PACKED_ONLY, FP32_SCALES = N // 2, N // 2 + 4 * N // 64
WHOLE_LAYER = N // 2 + N // 64  # packed + one-byte scales (double quantization's are ~0.1% more)


@cache
def _quantized(storage: str = "uint8") -> dict:
    """bitsandbytes' quantize_4bit (NF4, double quantization) of a normal weight of SHAPE."""
    import torch

    from kit.lab.quantize_nf4 import quantize_weight, state_bytes

    weight = torch.randn(*SHAPE, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    packed, state = quantize_weight(weight, "nf4", True, getattr(torch, storage))
    return {"bytes": packed.numel() * packed.element_size(), "shape": tuple(packed.shape),
            "scales": state_bytes(state, tables=False), "constants": state_bytes(state)}


def _layer_bytes() -> int:
    q = _quantized()
    return q["bytes"] + q["scales"]


def _per_rank_of_two() -> float:
    q = _quantized("bfloat16")
    return q["bytes"] / 2 + q["constants"]  # the packed weight sharded; its constants are not


def _check_shape(answer) -> str | None:
    try:
        shape = tuple(int(n) for n in answer)
    except (TypeError, ValueError):
        return "expected a shape, a tuple such as (4096, 1024)"
    if shape == _quantized("bfloat16")["shape"]:
        return None
    if shape == _quantized()["shape"]:
        return "that is the uint8 tensor: a bf16 element holds 2 bytes, so 4 packed weights"
    if shape in (SHAPE, SHAPE[::-1], (SHAPE[0], SHAPE[1] // 2), (SHAPE[0], SHAPE[1] // 4)):
        return "bitsandbytes does not keep the weight's 2-D shape: it flattens the packed bytes"
    return "count the bytes of the packed weight, then how many bf16 elements hold them"


# ---- hands-on: NF4 by hand, against bitsandbytes ----


def nf4_block(block):
    """(codes, absmax) of one block of 64 weights: the block's largest absolute value is its
    scale; each weight divided by it goes to the nearest of the 16 NF4 levels (its index)."""
    import torch

    from kit.lab.quantize_nf4 import code_values

    levels = torch.tensor(code_values("nf4"))
    absmax = block.abs().max()
    codes = (block / absmax).unsqueeze(-1).sub(levels).abs().argmin(-1)
    return codes, absmax


def nf4_pack(codes):
    """64 codes (0-15) into 32 bytes, two a byte: the first of each pair in the high 4 bits."""
    import torch

    pairs = codes.to(torch.uint8).reshape(-1, 2)
    return pairs[:, 0] << 4 | pairs[:, 1]


def _max_not_absmax(block):
    import torch

    from kit.lab.quantize_nf4 import code_values

    levels = torch.tensor(code_values("nf4"))
    absmax = block.max()
    return (block / absmax).unsqueeze(-1).sub(levels).abs().argmin(-1), absmax


def _rounds_down(block):
    import torch

    from kit.lab.quantize_nf4 import code_values

    levels = torch.tensor(code_values("nf4"))
    absmax = block.abs().max()
    return (torch.bucketize(block / absmax, levels, right=True) - 1).clamp(0, 15), absmax


def _unscaled(block):
    import torch

    from kit.lab.quantize_nf4 import code_values

    levels = torch.tensor(code_values("nf4"))
    return block.unsqueeze(-1).sub(levels).abs().argmin(-1), block.abs().max()


def _low_nibble_first(codes):
    import torch

    pairs = codes.to(torch.uint8).reshape(-1, 2)
    return pairs[:, 1] << 4 | pairs[:, 0]


def _one_code_a_byte(codes):
    import torch

    return codes.to(torch.uint8)


def _blocks():
    """(name, block) the checks quantize: weights as a model holds them (normal, std 0.02), a
    block of negative weights only, and one with an outlier that stretches the scale."""
    import torch

    g = torch.Generator().manual_seed(0)
    normal = torch.randn(64, generator=g) * 0.02
    outlier = torch.randn(64, generator=g) * 0.02
    outlier[17] = 0.3
    return [("a normal block (std 0.02)", normal),
            ("a block of negative weights", -(torch.randn(64, generator=g) * 0.02).abs()),
            ("a block with one outlier (0.3)", outlier)]  # fmt: skip


def _bnb(block):
    """bitsandbytes' packed bytes, codes (high 4 bits first) and absmax for one block: NF4,
    blocks of 64, no double quantization (the absmax exact, in fp32)."""
    import bitsandbytes.functional as F
    import torch

    packed, state = F.quantize_4bit(block.reshape(1, 64), blocksize=64, quant_type="nf4",
                                    quant_storage=torch.uint8)  # fmt: skip
    packed = packed.flatten()
    codes = torch.stack([packed >> 4, packed & 15], 1).flatten().long()
    return packed, codes, float(state.absmax[0])


def _check_block(fn) -> str | None:
    import torch

    from kit.lab.quantize_nf4 import code_values

    if not callable(fn):
        return "give the function itself: exercises.check(\"02.4\", nf4_block) (no parentheses)"
    levels = code_values("nf4")
    for name, block in _blocks():
        try:
            codes, absmax = fn(block.clone())
            codes, absmax = torch.as_tensor(codes).flatten(), float(absmax)
        except Exception as e:  # the learner's code: its error is the hint
            return f"on {name} it raised {type(e).__name__}: {e}"
        _, want, want_absmax = _bnb(block)
        if codes.numel() != 64 or codes.is_floating_point() and not torch.equal(codes, codes.round()):
            return (f"on {name} it returned {codes.numel()} values of {codes.dtype}: return 64 "
                    "integer codes, each the index (0-15) of a level, and the absmax")
        if abs(absmax - want_absmax) > 1e-6 * want_absmax:
            if abs(absmax - float(block.max())) < 1e-9:
                return (f"on {name} your absmax is {absmax:.4f}, the block's max(); the scale is "
                        "the largest *absolute* value, abs().max(), here "
                        f"{want_absmax:.4f}: with max() negative weights fall outside [-1, 1]")
            return (f"on {name} your absmax is {absmax:.4f}; bitsandbytes keeps {want_absmax:.4f}, "
                    "the block's largest absolute value")
        codes = codes.long()
        if torch.equal(codes, want):
            continue
        i = int((codes != want).nonzero()[0])
        x = float(block[i]) / want_absmax
        differ = int((codes != want).sum())
        if not 0 <= int(codes[i]) < 16:
            return f"on {name} code {i} is {int(codes[i])}: a code is an index into the 16 levels, 0-15"
        mine, theirs = levels[int(codes[i])], levels[int(want[i])]
        if differ > 40:
            why = "divide each weight by the absmax first: the levels span [-1, 1]"
        elif mine <= x < theirs or theirs < x <= mine:
            why = ("round to the nearest level, not down or up: the index of the smallest "
                   "|weight / absmax - level|")
        else:
            why = "the index of the level nearest to weight / absmax"
        return (f"on {name} {differ} of 64 codes differ from bitsandbytes'; the first, weight {i}: "
                f"weight / absmax = {x:+.4f}, your code {int(codes[i])} (level {mine:+.4f}), "
                f"bitsandbytes' {int(want[i])} (level {theirs:+.4f}): {why}")
    return None


def _check_pack(fn) -> str | None:
    import torch

    if not callable(fn):
        return "give the function itself: exercises.check(\"02.5\", nf4_pack) (no parentheses)"
    for name, block in _blocks():
        want, codes, _ = _bnb(block)
        try:
            got = torch.as_tensor(fn(codes.clone())).flatten()
        except Exception as e:  # the learner's code: its error is the hint
            return f"on {name}'s codes it raised {type(e).__name__}: {e}"
        if got.numel() != 32:
            return (f"it returned {got.numel()} values for 64 codes: two 4-bit codes share a "
                    "byte, so 32 bytes")
        if got.dtype != torch.uint8:
            return f"it returned {got.dtype}: the packed weight is bytes, torch.uint8"
        if torch.equal(got, want):
            continue
        if torch.equal(got, (want & 15) << 4 | want >> 4):
            return ("the nibbles are swapped: bitsandbytes puts the first code of each pair in "
                    "the high 4 bits (first << 4 | second)")
        i = int((got != want).nonzero()[0])
        return (f"byte {i} is {int(got[i])}, bitsandbytes' is {int(want[i])} (codes "
                f"{int(codes[2 * i])} and {int(codes[2 * i + 1])})")
    return None


EXERCISES = [
    Exercise(
        key="02.1",
        question=(f"Llama-3-8B's k_proj weight is {SHAPE[0]} x {SHAPE[1]}. In NF4 with double "
                  "quantization, how many bytes does it take: the packed weight plus its "
                  "scales (leave out the fixed code tables)? (answer: a number of bytes; "
                  "quantize_nf4.quantization_report on a random weight of that shape counts it)"),
        check=number(_layer_bytes, {
            PACKED_ONLY: "that is the packed 4-bit weight alone: one scale per block of 64 "
                         "weights comes on top",
            FP32_SCALES: "those are fp32 scales: with double quantization each block's scale is "
                         "one byte (plus one fp32 scale per 256 blocks)",
            2 * N: "that is the bf16 weight, before quantization",
        }, "4 bits per weight, plus the per-block scales as double quantization stores them",
            rel=0.002),
        solution=_layer_bytes,
        wrong=(PACKED_ONLY, FP32_SCALES, 2 * N),
    ),
    Exercise(
        key="02.2",
        question=("The same k_proj loaded with bnb_4bit_quant_storage=bfloat16 (the kit's "
                  "default storage under FSDP): what shape has its packed weight tensor? "
                  "(answer: a tuple)"),
        check=_check_shape,
        solution=lambda: _quantized("bfloat16")["shape"],
        wrong=((N // 2, 1), SHAPE, (SHAPE[0], SHAPE[1] // 4)),
    ),
    Exercise(
        key="02.3",
        question=("That bf16-stored k_proj under FSDP2 on 2 ranks: how many bytes of it does "
                  "each rank keep between steps, its part of the packed weight plus the "
                  "quantization constants (scales and code tables, linear4bit_layout's "
                  "constant_bytes)? (answer: a number of bytes)"),
        check=number(_per_rank_of_two, {
            WHOLE_LAYER / 2: "FSDP shards parameters only: the scales are not a parameter, and "
                             "every rank keeps all of them",
            WHOLE_LAYER: "that is the whole layer: FSDP splits the packed weight over the 2 ranks",
        }, "half of the packed weight, and think about which of the two FSDP shards",
            rel=0.002),
        solution=_per_rank_of_two,
        wrong=(WHOLE_LAYER / 2, WHOLE_LAYER),
    ),
    Exercise(
        key="02.4",
        question=("Hands-on, quick: write nf4_block(block), NF4 by hand for one block of 64 "
                  "weights: return (codes, absmax), the block's scale and, for each weight, the "
                  "index (0-15) of the nearest of the 16 levels (quantize_nf4.code_values) to "
                  "weight / absmax. The check compares it with bitsandbytes' quantize_4bit on "
                  "three blocks."),
        check=_check_block,
        solution=lambda: nf4_block,
        wrong=(_max_not_absmax, _rounds_down, _unscaled),
        hands_on=True,
    ),
    Exercise(
        key="02.5",
        question=("Hands-on, stretch: write nf4_pack(codes), the 64 codes of a block as the 32 "
                  "bytes bitsandbytes stores (torch.uint8, two codes a byte). The check compares "
                  "them with quantize_4bit's packed tensor."),
        check=_check_pack,
        solution=lambda: nf4_pack,
        wrong=(_low_nibble_first, _one_code_a_byte),
        hands_on=True,
    ),
]
