"""Exercises of notebook 03 (LoRA adapters): PEFT's trainable count for adapters on q and v of
the tiny model (03.1), and the largest rank whose adapters on every expert of a mixture of experts
stay within a memory budget (03.2). torch and PEFT are imported when a solution runs, not with
this module."""

from __future__ import annotations

from functools import cache

from kit.budget import shapes
from kit.lab.exercises import Exercise
from kit.lab.exercises.checks import number

TINY, RANK, QV = "kit:tiny-llama", 4, ("q_proj", "v_proj")
MOE, BUDGET_GIB = "kit:qwen3-30b-a3b", 5
ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")


@cache
def _peft_trainable() -> int:
    """What PEFT reports trainable after kit.recipe.lora.apply_lora (r=4 on q_proj and v_proj)
    on the tiny model loaded in 4 bits, as notebook 03 loads it."""
    from kit.config import load_config
    from kit.lab.quantize_nf4 import load_on_cpu
    from kit.recipe import lora

    cfg = load_config(None, [f"model.name={TINY}", f"lora.r={RANK}",
                             f"lora.target_modules=[{','.join(QV)}]"])  # fmt: skip
    return lora.trainable_summary(lora.apply_lora(load_on_cpu(TINY), cfg))["trainable"]


def _by_hand_without_gqa() -> int:
    """The count a learner gets who gives v_proj as many outputs as q_proj (no grouped-query)."""
    shape = shapes.shape_of(TINY)
    return shape.layers * 2 * RANK * (shape.hidden + shape.heads * shape.head_dim)


def _full_matrices() -> int:
    shape = shapes.shape_of(TINY)
    return shape.layers * sum(a * b for n, (a, b) in shape.linears().items() if n in QV)


def _largest_rank(targets="all-linear") -> int:
    """The largest r whose adapters' fp32 training state (weights, gradients, AdamW's two
    moments: 16 bytes a parameter) stays within BUDGET_GIB on MOE's shape."""
    shape = shapes.shape_of(MOE)
    r = 0
    while 16 * shapes.lora_params(shape, r + 1, targets) <= BUDGET_GIB * 2**30:
        r += 1
    return r


EXERCISES = [
    Exercise(
        key="03.1",
        question=(f"Apply LoRA with r={RANK} to q_proj and v_proj only of {TINY} (a kit config "
                  "with lora.target_modules=[q_proj,v_proj], through lora.apply_lora as in "
                  "section 1): how many parameters does PEFT report trainable? Count it by hand "
                  "first. (answer: a number)"),
        check=number(_peft_trainable, lambda: {
            _by_hand_without_gqa(): "v_proj is smaller than q_proj here: grouped-query "
                                    "attention gives it fewer output features (see B's shapes)",
            _full_matrices(): "that is the size of the frozen q and v matrices; LoRA trains "
                              "r x (in + out) per layer",
        }, "r x (in + out) for each adapted layer, in every decoder layer", whole=True),
        solution=_peft_trainable,
        wrong=(_by_hand_without_gqa(), _full_matrices(), RANK),
    ),
    Exercise(
        key="03.2",
        question=(f"{MOE}, adapters on all-linear (every expert gets its own): what is the "
                  "largest rank r whose fp32 training state (16 bytes a parameter) stays within "
                  f"{BUDGET_GIB} GiB? (answer: a whole number; shapes.lora_params counts)"),
        check=number(lambda: _largest_rank(), lambda: {
            _largest_rank(ATTENTION): "that is the rank for attention only; all-linear also "
                                      "adapts every expert of every layer",
            16: "r=16 needs almost twice the budget (section 7 prints its GiB)",
        }, "16 x shapes.lora_params(shape, r, 'all-linear') grows linearly with r: find where "
           "it crosses the budget", whole=True),
        solution=_largest_rank,
        wrong=(_largest_rank(ATTENTION), 16, 4),
    ),
]
