"""notebooks/plain_recipe.py, the recipe on one page without the kit (notebook 05a), run for real
under torchrun (2 processes, gloo, CPU) beside the kit's own run (kit.train) on the same model
folder, rows and settings: the same loss at every step. kit.lab.plain_recipe runs both."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
from conftest import ROOT

from kit.lab import plain_recipe

STEPS = 6  # 32 rows, 16 a step over 2 processes: 3 epochs, so the per-epoch reshuffle counts too


def test_the_page_imports_nothing_of_the_kit_and_stays_one_page():
    facts = plain_recipe.page_facts()
    assert "kit" not in facts["imports"], facts
    assert {"peft", "torch", "transformers"} <= set(facts["imports"]), facts
    assert facts["code_lines"] <= 70, facts  # one page: about 60 lines of code


def test_the_notebooks_checked_cell_holds_the_page_as_it_is():
    """Notebook 05a's one checked cell (its run is the tour's; what it calls runs here) prints
    page_facts(): its stored output is the page's length and imports today."""
    import nbformat

    nb = nbformat.read(str(ROOT / "notebooks" / "05a-plain-recipe.ipynb"), as_version=4)
    (cell,) = [c for c in nb.cells if "nbval-check-output" in c.metadata.get("tags", [])]
    assert "page_facts()" in cell.source
    assert "".join(o.get("text", "") for o in cell.outputs) == f"{plain_recipe.page_facts()}\n"


def test_every_addition_names_what_the_kit_defines():
    table = plain_recipe.additions()  # raises LookupError when one has moved
    assert table.count("\n") == len(plain_recipe.ADDITIONS) + 1
    assert plain_recipe.defined("kit.recipe.engines:FSDP2.wrap")
    assert not plain_recipe.defined("kit.recipe.engines:FSDP2.no_such_method")
    assert not plain_recipe.defined("kit.no_such_module:anything")


def test_the_page_and_the_kit_train_alike(tmp_path):
    """Both runs at once (CI time: their start-ups overlap). The page prints its losses with 8
    decimals, the kit's are its metrics.jsonl floats: measured equal to the 8th decimal, on CPU
    (and on one H200 with nccl). The two run the same operations: the kit's AdamW steps each
    rank's shard with torch's own functional Adam, its clipping sums the shards' squared norms
    as torch does over DTensors. What could still differ on another machine is the order of a
    float32 sum, hence rel 1e-5, not 0."""
    from kit.inputs import builtin

    rows = plain_recipe.write_rows(tmp_path / "rows.jsonl", 32)
    folder = builtin.resolve(plain_recipe.MODEL)  # built once per test session
    with ThreadPoolExecutor(1) as pool:
        page = pool.submit(plain_recipe.run_plain, folder, rows, steps=STEPS, out_dir=tmp_path)
        kit = plain_recipe.run_kit(rows, steps=STEPS, out_dir=tmp_path)
        plain = page.result()
    assert len(plain) == len(kit) == STEPS
    assert plain == pytest.approx(kit, rel=1e-5), plain_recipe.table(plain, kit)
    assert plain[-1] < plain[0] - 0.2, plain  # it trains: equal losses that never moved prove nothing
