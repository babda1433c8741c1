"""Notebook 05's last section, "The recipe in plain sight", prints the training run's own source
with inspect.getsource: the functions it names must exist, and what they print must still take
the steps its text walks through, in that order (so that the page fails when the recipe moves).
Static: the notebook is read, the functions imported and their source searched; nothing runs."""

from __future__ import annotations

import inspect
import re

import nbformat

from kit import train
from kit.lab import order
from kit.recipe import engines, model, recompute
from kit.run import tour

NAMESPACE = {"train": train, "engines": engines, "model": model, "recompute": recompute}
# What the page prints, in reading order, and the calls each must contain, in this order.
PAGE = {
    "model.build": ["loading.load(", "lora.apply_lora(", "recompute.apply(", ".train()",
                    "check_checkpointing_active("],
    "recompute.apply": ["tile_mlp(", "enable_activation_checkpointing(", "selective_checkpointing("],
    "recompute.enable_activation_checkpointing": ['"use_reentrant": False',
                                                  "disable_input_require_grads()",
                                                  "layer.gradient_checkpointing = i % every == 0"],
    "engines.FSDP2.wrap": ["MixedPrecisionPolicy(", "for layer in decoder_layers(model):",
                           "fully_shard(layer", "fully_shard(embeddings", "fully_shard(model",
                           "set_modules_to_backward_prefetch("],
    "train.Recipe._setup": ["self.engine.wrap(", "self.model.parameters()", "AdamW("],
    "train.Recipe.train_step": ["self.engine.no_sync(", "loss = self.model(", ".backward()",
                                "clip_grad_norm(", "self.optimizer.step()", "zero_grad("],
}  # fmt: skip


def page_cells() -> list[str]:
    path = next(p for p in tour.notebooks() if p.stem == "05-order-of-operations")
    cells = nbformat.read(str(path), as_version=4).cells
    start = next(i for i, c in enumerate(cells) if c.source.startswith("## The recipe in plain sight"))
    return [c.source for c in cells[start:] if c.cell_type == "code"]


def in_order(text: str, calls: list[str]) -> list[str]:
    """The calls missing from `text` or found out of order ([] when all are there, in order)."""
    at, wrong = 0, []
    for call in calls:
        found = text.find(call, at)
        if found < 0:
            wrong.append(call)
        else:
            at = found + len(call)
    return wrong


def test_the_page_prints_the_functions_the_run_uses_in_reading_order():
    code = "\n".join(page_cells())
    named = re.findall(r"inspect\.getsource\(([\w.]+)\)", code)
    assert named == list(PAGE), named
    for name in named:  # each resolves to a real function of the recipe, not a copy
        fn = eval(name, dict(NAMESPACE))
        assert inspect.isfunction(fn) and fn.__module__.startswith("kit."), name


def test_what_it_prints_still_takes_each_step_in_order():
    for name, calls in PAGE.items():
        source = inspect.getsource(eval(name, dict(NAMESPACE)))
        assert in_order(source, calls) == [], (name, in_order(source, calls))


def test_the_setup_excerpt_shows_the_wrap_then_the_optimizer():
    code = "\n".join(page_cells())
    first, last = re.search(r'order\.excerpt\(setup, "([^"]+)", "([^"]+)"\)', code).groups()
    shown = order.excerpt(inspect.getsource(train.Recipe._setup), first, last)
    assert shown.lstrip().startswith("self.model = self.engine.wrap(")
    assert in_order(shown, PAGE["train.Recipe._setup"]) == []
    assert len(shown.splitlines()) < 20  # the part, not the whole setup


def test_the_checker_is_not_blind():
    assert in_order("b(); a()", ["a(", "b("]) == ["b("]
    assert in_order("a()", ["a(", "fully_shard("]) == ["fully_shard("]
