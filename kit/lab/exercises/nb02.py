"""Exercises of notebook 02 (quantize NF4): the bytes of one Llama-3-8B layer in NF4 with double
quantization (02.1), its packed tensor's shape in bf16 storage (02.2), and what each of 2 FSDP
ranks keeps of it (02.3), computed with bitsandbytes through kit.lab.quantize_nf4 (imported when
a check or a solution runs, not with this module: kernels without torch list every exercise)."""

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
]
