"""Notebook 05a's exercises: which of the kit's additions stops notebook 05's silent mistake, and
(hands-on) the kit's config values that make it train as a command line of the page does: for one
command (quick), then as a function of any command (stretch). The checks read the kit's source and
load its config (kit.lab.plain_recipe, kit.config): no torchrun."""

from __future__ import annotations

from kit.config import ConfigError, load_config
from kit.lab import plain_recipe
from kit.lab.exercises import Exercise, one_of

STILL_ADAPTERS = "kit.recipe.checks:check_lora_changed"


def stops_the_flat_line() -> str:
    """The kit's function that ends a run whose adapters have not moved after a few steps (what
    an optimizer built before fully_shard gives under FSDP2: notebook 05, section 1)."""
    if not plain_recipe.defined(STILL_ADAPTERS):
        raise LookupError(f"{STILL_ADAPTERS} is no longer defined")
    return STILL_ADAPTERS.rsplit(":", 1)[1]


# The page's command line of exercise 05a.2 (options after MODEL_FOLDER ROWS.jsonl).
COMMAND = ["--steps", "10", "--batch", "4", "--seq", "64", "--lr", "5e-3"]
# What the check compares: every value of the kit's config that changes the losses of a run.
COMPARED = ("training.steps", "training.batch_size", "data.max_seq_len", "training.lr",
            "training.seed", "training.warmup_steps", "training.scheduler",
            "training.max_grad_norm", "training.grad_accum", "lora.r", "lora.alpha",
            "lora.dropout", "lora.target_modules", "data.val_fraction")  # fmt: skip
WHY = {
    "lora.dropout": "the tiny config's LoRA drops 5% of each adapter's input at random; the page's "
                    "LoraConfig has lora_dropout=0.0",
    "data.val_fraction": "the kit holds that share of the rows out of training; the page trains "
                         "on every row of its file",
    "training.batch_size": "the page's --batch is rows per process, and so is the kit's",
}


def _value(cfg, dotted: str):
    for part in dotted.split("."):
        cfg = getattr(cfg, part)
    return cfg


def page_overrides() -> list[str]:
    return plain_recipe.overrides_for(COMMAND)


def check_overrides(answer, command: list[str] = COMMAND) -> str | None:
    """None if the tiny config with `answer` trains as the page run with `command` does, else
    the first value that differs and why."""
    if not isinstance(answer, (list, tuple)) or not all(isinstance(a, str) and "=" in a
                                                        for a in answer):  # fmt: skip
        return "answer with a list of 'key=value' strings, e.g. ['training.steps=10', ...]"
    try:
        got = load_config(plain_recipe.CONFIG, list(answer))
    except ConfigError as e:
        return f"the kit refused them: {str(e).splitlines()[0]}"
    want = load_config(plain_recipe.CONFIG, plain_recipe.overrides_for(command))
    flags = {field: flag for flag, field in plain_recipe.PAGE_FLAGS.items()}
    for field in COMPARED:
        if _value(got, field) != _value(want, field):
            why = [f"the page ran with {flags[field]} {_value(want, field)}"] if field in flags \
                else [] if field in WHY else [f"the page's is {_value(want, field)!r}"]
            why += [WHY[field]] if field in WHY else []
            return f"{field} is {_value(got, field)!r} in your run: {'; '.join(why)}"
    return None


# The commands the stretch exercise's function is run on: the quick one's, one option, and some.
COMMANDS = (COMMAND, ["--steps", "3"], ["--seed", "7", "--batch", "2", "--lr", "1e-3"])


def check_function(fn) -> str | None:
    if not callable(fn):
        return "answer with the function itself (overrides_for), not a list it returned"
    for command in COMMANDS:
        try:
            got = fn(list(command))
        except Exception as e:  # the learner's code: any error is a hint
            return f"for the options {' '.join(command)} it raised {type(e).__name__}: {e}"
        if hint := check_overrides(got, command):
            return f"for the options {' '.join(command)}: {hint}"
    return None


def _flags_only(page_args):  # a likely mistake: the options alone, the tiny config's dropout kept
    fields = plain_recipe.PAGE_FLAGS
    return [f"{fields[flag]}={value}" for flag, value in zip(page_args[::2], page_args[1::2],
                                                             strict=True)]  # fmt: skip


def _steps_only(page_args):  # another: the one option of the quick exercise that always appears
    return [f"training.steps={page_args[page_args.index('--steps') + 1]}",
            *plain_recipe.SAME_TRAINING]


EXERCISES = [
    Exercise(
        key="05a.1",
        question=("Notebook 05, section 1: a script that builds AdamW before fully_shard trains "
                  "nothing under FSDP2 and raises nothing. The page has no guard against it. Which "
                  "function of the kit, in the table above, ends such a run with an error? Answer "
                  "with its name (a string)."),
        check=one_of(stops_the_flat_line(), hints={
            "same_init": "same_init compares the ranks' adapters before training: in that case "
                         "they start alike",
            "check_step": "check_step reads one step's loss and gradient norm: there both are "
                          "finite and the norm is not 0 (backward fills the model's tensors; only "
                          "the optimizer holds other ones)",
            "check_checkpointing_active": "that one refuses layers left in eval mode (notebook "
                                          "05, section 4)",
        }, default="answer with a function name from the table's third column, without its "
                   "module, e.g. 'same_init'"),
        solution=stops_the_flat_line,
        wrong=("same_init", "check_step"),
    ),
    Exercise(
        key="05a.2",
        question=("You ran the page as `torchrun --nproc_per_node 2 plain_recipe.py FOLDER "
                  "rows.jsonl " + " ".join(COMMAND) + "`. Write the kit's overrides: a list of "
                  "'key=value' strings that, on top of the tiny config (kit/configs/tiny-cpu.yaml), "
                  "make the kit train as that command does (model.name and data.path aside). The "
                  "check loads the config with them and compares every value that changes the "
                  "losses."),
        check=check_overrides,
        solution=page_overrides,
        hands_on=True,
        wrong=(["training.steps=10", "training.batch_size=4", "data.max_seq_len=64",
                "training.lr=5e-3"],
               ["training.steps=10", "training.batch_size=2", "data.max_seq_len=64",
                "training.lr=5e-3", "lora.dropout=0", "data.val_fraction=0"],
               ["lr=5e-3"]),
    ),
    Exercise(
        key="05a.3",
        question=("Stretch: write overrides_for(page_args), which takes any command line's options "
                  "of the page (a list such as ['--lr', '5e-3', '--seq', '64']) and returns the "
                  "kit's overrides that make it train as that command does. "
                  "plain_recipe.PAGE_FLAGS maps each option to its field. The check runs it on "
                  "three commands and loads the config with what it returns."),
        check=check_function,
        solution=lambda: plain_recipe.overrides_for,
        wrong=(_flags_only, _steps_only, [*plain_recipe.SAME_TRAINING]),
        hands_on=True,
    ),
]
