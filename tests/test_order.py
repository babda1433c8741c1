"""Notebook 05's cases (kit.lab.order_rank, read by kit.lab.order): each is the recipe's order with one step
moved, removed or changed, the notebook shows the code that ran, and the headline case is run
for real here on a group of one (the two-rank run of every case is notebook 05's own test)."""

from __future__ import annotations

import ast

import pytest
from conftest import ROOT, TINY

from kit.config import load_config
from kit.lab import order

# How each case differs from recipe_order; nothing else may differ.
ONE_STEP = {"optimizer_first": "moved", "lora_after_shard": "moved",
            "checkpointing_after_shard": "moved", "no_train_mode": "removed",
            "device_map_auto": "changed"}  # fmt: skip


def statements(name: str) -> list[str]:
    """The statements of a case as the notebook shows them, its docstring left out."""
    (fn,) = ast.parse(order.source(name)).body
    return [ast.unparse(s) for s in fn.body[1:]]  # body[0]: the docstring


def one_step(case: list[str], recipe: list[str]) -> str | None:
    """'moved', 'removed' or 'changed' when `case` is `recipe` with that done to one statement."""
    if case != recipe and sorted(case) == sorted(recipe) and any(
            [s for s in case if s != m] == [s for s in recipe if s != m] for m in recipe):
        return "moved"
    if any(recipe[:i] + recipe[i + 1:] == case for i in range(len(recipe))):
        return "removed"
    if len(case) == len(recipe) and sum(a != b for a, b in zip(case, recipe, strict=True)) == 1:
        return "changed"
    return None


def test_each_case_is_the_recipe_with_one_step_moved_removed_or_changed():
    from kit.lab.order_rank import RUNS

    recipe = statements("recipe_order")
    assert {f for f, _, _ in RUNS} == {"recipe_order", *ONE_STEP}
    for name, how in ONE_STEP.items():
        assert one_step(statements(name), recipe) == how, (name, statements(name))
    # The checker is not blind: two statements moved, or one added, is none of the three.
    swapped = recipe[:]
    swapped[0], swapped[1], swapped[4], swapped[5] = swapped[1], swapped[0], swapped[5], swapped[4]
    assert one_step(swapped, recipe) is None
    assert one_step([*recipe[:1], "model.eval()", *recipe[1:]], recipe) is None


def test_every_table_shows_runs_that_run_and_columns_that_exist():
    from kit.lab.order_rank import RUNS

    for runs, columns in order.CASES.values():
        assert set(runs) <= set(RUNS) and set(columns) <= set(order.COLUMNS)
    shown = {run for runs, _ in order.CASES.values() for run in runs}
    assert shown == set(RUNS)  # every run is in some table


def test_the_notebook_shows_the_code_that_runs():
    import inspect
    import textwrap

    from kit.lab import order_rank

    for name in ("recipe_order", *ONE_STEP):
        assert order.source(name) == inspect.getsource(getattr(order_rank, name)).rstrip()
    assert order.source("Trial.shard") == textwrap.dedent(
        inspect.getsource(order_rank.Trial.shard)).rstrip()
    with pytest.raises(KeyError, match="no function 'nope'"):
        order.source("nope")


def test_read_names_a_folder_without_cases(tmp_path):
    with pytest.raises(FileNotFoundError, match="no cases here"):
        order.read(tmp_path)


def test_optimizer_built_before_fully_shard_trains_nothing(group_of_one):
    """The headline of notebook 05, on one rank: under FSDP2 the optimizer built before
    fully_shard holds none of the model's trainable tensors and the loss never moves, with no
    error; built after, it holds all of them and the loss falls."""
    from kit.lab.order_rank import run_one

    cfg = load_config(TINY, ["training.device=cpu", "training.steps=3"])
    first = run_one(cfg, group_of_one, "optimizer_first", "fsdp2", "nf4")
    right = run_one(cfg, group_of_one, "recipe_order", "fsdp2", "nf4")
    assert first["ok"] and right["ok"], (first["error"], right["error"])
    assert (first["optimizer_holds"], first["trainable"]) == (0, 8)
    assert len(set(first["losses"])) == 1
    assert (right["optimizer_holds"], right["lora_sharded"]) == (8, 8)
    assert right["losses"][0] == first["losses"][0] > right["losses"][-1]


PLACEMENT = """
import sys
from types import SimpleNamespace

import torch
import torch.distributed as dist

from kit.lab.order_rank import Trial

dist.init_process_group("gloo")
rank = dist.get_rank()
env = SimpleNamespace(device=torch.device("cpu"), rank=rank, world_size=dist.get_world_size())
trial = Trial(cfg=None, env=env, engine="fsdp1", base="nf4")
for name, rank_1_on in (("own", "cpu"), ("off", "meta")):
    model = torch.nn.Linear(2, 2, device=rank_1_on if rank == 1 else "cpu")
    try:
        trial.weights_on_own_devices(model)
        print(f"{name} rank {rank}: passed", flush=True)
    except ValueError as e:
        print(f"{name} rank {rank}: {e}", flush=True)
dist.destroy_process_group()
"""


@pytest.mark.slow
def test_fsdp1_placement_check_raises_on_every_rank_together(tmp_path):
    """FSDP1 raises only on a rank whose weights are off its device_id, and the others then wait
    in its first collective for good (seen on 2 GPUs with device_map="auto"): Trial.shard first
    checks every rank's placement, so every rank raises the same error, here with rank 1's
    weights on the meta device (2 gloo processes, for real)."""
    import subprocess
    import sys

    script = tmp_path / "placement.py"
    script.write_text(PLACEMENT)
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                           "--nproc_per_node=2", str(script)], capture_output=True, text=True,
                          timeout=300, cwd=ROOT)  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    error = ("weights off their rank's device: rank 1's on meta (its device_id cpu): FSDP1 "
             "raises there and the other ranks wait in its first collective")
    for said in (f"off rank 0: {error}", f"off rank 1: {error}", "own rank 0: passed",
                 "own rank 1: passed"):  # the ranks share one pipe: lines may run together
        assert proc.stdout.count(said) == 1, proc.stdout
    assert proc.stdout.count("passed") == 2, proc.stdout
