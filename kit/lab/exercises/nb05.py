"""Notebook 05's exercises: the recipe's order, and which moved step gives the flat line (answers
read from the code the ranks ran, kit/lab/order_rank.py, through kit.lab.order: no torchrun).
Hands-on (05.3): a case with two steps out of place, which the learner mends by moving one line
and adding one; the check runs it as the notebook's cases run (kit.lab.order_rank.Trial, FSDP2,
the tiny Llama in NF4) beside recipe_order, and says from what it measured what is still wrong."""

from __future__ import annotations

import ast

from kit.lab import order
from kit.lab.exercises import Exercise, one_of
from kit.lab.exercises.checks import calls_of, function_from, source_of

# A statement of a case -> the step it is (the names a learner answers with).
STEPS = {"t.load(": "load", "t.add_lora(": "lora", "enable_activation_checkpointing(": "checkpointing",
         ".train()": "train mode", "t.shard(": "shard", "AdamW(": "optimizer"}  # fmt: skip


def steps_of(case: str, text: str | None = None) -> tuple[str, ...]:
    """The steps of a case of kit/lab/order_rank.py (or of the function `text` defines), in the
    order its code takes them."""
    (fn,) = ast.parse(text or order.source(case)).body
    found = []
    body = fn.body[1:] if ast.get_docstring(fn) else fn.body
    for statement in body:
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


# ---- hands-on: mend a case, run it beside recipe_order ----

# The case as the notebook gives it: the optimizer built before sharding (section 1) and no
# model.train() (section 4). Moving one line and adding one mends it.
GIVEN = """
def my_order(t):
    model = t.load()
    model = t.add_lora(model)
    opt = torch.optim.AdamW(trainable(model), lr=t.lr)
    enable_activation_checkpointing(model)
    model = t.shard(model)
    return t.train(model, opt)
"""
MENDED = """
def my_order(t):
    model = t.load()
    model = t.add_lora(model)
    enable_activation_checkpointing(model)
    model.train()
    model = t.shard(model)
    opt = torch.optim.AdamW(trainable(model), lr=t.lr)
    return t.train(model, opt)
"""
TRAIN_MODE_ONLY = """
def my_order(t):
    model = t.load()
    model = t.add_lora(model)
    opt = torch.optim.AdamW(trainable(model), lr=t.lr)
    enable_activation_checkpointing(model)
    model.train()
    model = t.shard(model)
    return t.train(model, opt)
"""
OPTIMIZER_ONLY = """
def my_order(t):
    model = t.load()
    model = t.add_lora(model)
    enable_activation_checkpointing(model)
    model = t.shard(model)
    opt = torch.optim.AdamW(trainable(model), lr=t.lr)
    return t.train(model, opt)
"""
_MEASURED: dict[str, dict] = {}  # source -> what its run measured (and recipe_order's, "recipe")


def measure(fns: list) -> None:
    """Run every case of `fns` not run yet, in one child process (kit.lab.exercise_ranks:
    order_cases: one import of torch, transformers, PEFT and bitsandbytes for all of them)."""
    from kit.run import child

    todo = {source_of(fn): fn.__name__ for fn in fns if callable(fn)}
    todo = {src: name for src, name in todo.items() if src not in _MEASURED}
    if not todo:
        return
    found = child.call("kit.lab.exercise_ranks:order_cases",
                       cases=[[name, src] for src, name in todo.items()], timeout=600,
                       env={"CUDA_VISIBLE_DEVICES": ""})  # fmt: skip
    for src, row in zip(todo, found["cases"], strict=True):
        _MEASURED[src] = {**row, "recipe": found["recipe_order"]}


def measured(case) -> dict:
    """What `case(t)` measured, run as the notebook's cases run (FSDP2, the tiny Llama in NF4, 3
    AdamW steps, a gloo group of one in a child process): losses, the tensors the optimizer holds,
    the layers in train mode, step 1's layer forwards, or the error; recipe_order's beside it."""
    measure([case])
    row = _MEASURED[source_of(case)]
    keys = ("ok", "error", "losses", "optimizer_holds", "trainable", "layers_in_train_mode",
            "layers", "layer_forwards")  # fmt: skip
    return {"yours": {k: row.get(k) for k in keys}, "recipe_order": {k: row["recipe"].get(k) for k in keys}}


def _check_mended(fn) -> str | None:
    if not callable(fn):
        return "give the function itself: exercises.check(\"05.3\", my_order) (no parentheses)"
    if "recipe_order" in calls_of(fn):
        return "write the steps yourself, as the given case does: it calls recipe_order"
    measure([fn])
    row = _MEASURED[source_of(fn)]
    recipe = row["recipe"]
    steps = steps_of("", source_of(fn))
    if not row["ok"]:
        why = (" (section 2: LoRA added to a sharded 4-bit model)"
               if "lora" in steps and "shard" in steps and steps.index("lora") > steps.index("shard")
               else "")  # fmt: skip
        return f"it raised {row['error']}{why}"
    losses = row.get("losses") or []
    if len(set(losses)) == 1:
        return (f"the loss never moved ({losses[0]:.4f} at every step), with no error: the "
                f"optimizer holds {row['optimizer_holds']} of the model's {row['trainable']} "
                "trainable tensors, built before t.shard replaced them (section 1)")
    if row["layers_in_train_mode"] < row["layers"]:
        return (f"{row['layers_in_train_mode']} of {row['layers']} decoder layers in train "
                f"mode: step 1 ran {row['layer_forwards']} layer forwards where recipe_order ran "
                f"{recipe['layer_forwards']}, because transformers recomputes nothing in eval "
                "mode and keeps every activation instead (section 4)")
    if row["layer_forwards"] != recipe["layer_forwards"]:
        return (f"step 1 ran {row['layer_forwards']} layer forwards, recipe_order "
                f"{recipe['layer_forwards']}: activation checkpointing is not on")
    if losses != recipe["losses"]:
        shown = ", ".join(f"{x:.4f}" for x in losses)
        return (f"it trains, but its losses ({shown}) are not recipe_order's "
                f"({', '.join(f'{x:.4f}' for x in recipe['losses'])}): compare the steps' order")
    return None


def _case(source: str):
    return function_from(source, "my_order", "05.3")


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
    Exercise(
        key="05.3",
        question=("Hands-on: my_order(t) is a case of your own with two mistakes of this "
                  "notebook in it. Predict what it does (exercises.nb05.measured(my_order) runs "
                  "it as it stands), then mend it by moving one line and adding one, so that it "
                  "trains as recipe_order does. The check runs it under FSDP2 on the tiny Llama "
                  "in NF4 beside recipe_order and compares losses, optimizer and layers."),
        check=_check_mended,
        solution=lambda: _case(MENDED),
        wrong=(_case(TRAIN_MODE_ONLY), _case(OPTIMIZER_ONLY)),  # GIVEN's hint: TRAIN_MODE_ONLY's
        hands_on=True,
        given=GIVEN,
        prepare=measure,
    ),
]
