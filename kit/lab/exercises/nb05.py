"""Notebook 05's exercises: the recipe's order, and which moved step gives the flat line (answers
read from the code the ranks ran, kit/lab/order_rank.py, through kit.lab.order: no torchrun)."""

from __future__ import annotations

import ast

from kit.lab import order
from kit.lab.exercises import Exercise, one_of

# A statement of a case -> the step it is (the names a learner answers with).
STEPS = {"t.load(": "load", "t.add_lora(": "lora", "enable_activation_checkpointing(": "checkpointing",
         ".train()": "train mode", "t.shard(": "shard", "AdamW(": "optimizer"}  # fmt: skip


def steps_of(case: str) -> tuple[str, ...]:
    """The steps of a case of kit/lab/order_rank.py, in the order its code takes them."""
    (fn,) = ast.parse(order.source(case)).body
    found = []
    for statement in fn.body[1:]:  # body[0]: the docstring
        text = ast.unparse(statement)
        found += [name for call, name in STEPS.items() if call in text and "t.train(" not in text]
    return tuple(found)


def recipe_steps() -> tuple[str, ...]:
    return steps_of("recipe_order")


def check_order(answer) -> str | None:
    if not isinstance(answer, (list, tuple)):
        return "answer with a tuple of the six step names, e.g. ('load', ...)"
    got, want = tuple(str(a).strip().lower() for a in answer), recipe_steps()
    if sorted(got) != sorted(want):
        return f"use each of these six names once: {', '.join(sorted(want))}"
    if got == want:
        return None
    if got.index("optimizer") < got.index("shard"):
        return "an optimizer built before sharding holds tensors FSDP2 then replaces (section 1)"
    if got.index("lora") > got.index("shard"):
        return "LoRA added to a sharded model: section 2 shows what each engine does then"
    return "close: compare your order with the cell that prints recipe_order, step by step"


def flat_line_case() -> str:
    """The case whose optimizer is built before the model is sharded: under FSDP2 the optimizer
    then holds none of the tensors backward gives gradients to."""
    cases = {f for runs, _ in order.CASES.values() for f, _, _ in runs}
    (case,) = [c for c in sorted(cases)
               if steps_of(c).index("optimizer") < steps_of(c).index("shard")]  # fmt: skip
    return case


EXERCISES = [
    Exercise(
        key="05.1",
        question=("Write the recipe's order as a tuple of these six step names: 'load', 'lora', "
                  "'checkpointing', 'train mode', 'shard', 'optimizer'. Each section above moved "
                  "one of them; the order is what every engine trains with."),
        check=check_order,
        solution=recipe_steps,
        wrong=(("load", "lora", "checkpointing", "train mode", "optimizer", "shard"),
               ("load", "shard", "lora", "checkpointing", "train mode", "optimizer")),
    ),
    Exercise(
        key="05.2",
        question=("A script of your own, under FSDP2, logs the same loss at every step and raises "
                  "nothing: the flat line of the picture above. Which case of this notebook is it? "
                  "Answer with the case's function name (a string)."),
        check=one_of(flat_line_case(), hints={
            "no_train_mode": "that one trains with the recipe's losses: only memory shows it (section 4)",
            "lora_after_shard": "with 4-bit weights that one raises under FSDP2 (section 2)",
            "checkpointing_after_shard": "its losses are the recipe's at every step (section 3)",
            "device_map_auto": "on this CPU it trains with the recipe's losses (section 5)",
        }, default="answer with one of the function names the sections print, e.g. 'no_train_mode'"),
        solution=flat_line_case,
        wrong=("no_train_mode", "lora_after_shard"),
    ),
]
