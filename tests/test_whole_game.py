"""Notebook 00a, the whole game: one headless run of its defaults (papermill, as the tour runs it), a
real 2-process NF4 + LoRA fine-tune of SmolLM2-135M-Instruct, and what its text says of the
result: no reply in the form before, the form learned in its few steps (at least 6 of the 8
questions after), the share of parameters trained as printed."""

from __future__ import annotations

import re

import nbformat
import pytest
from conftest import ROOT

from kit.run import tour

NOTEBOOK = ROOT / "notebooks" / "00a-whole-game.ipynb"


def outputs(path) -> list[str]:
    """Each code cell's text output (streams and text/plain), in order."""
    cells = [c for c in nbformat.read(str(path), as_version=4).cells if c.cell_type == "code"]
    return ["".join(o.get("text", "") or o.get("data", {}).get("text/plain", "") for o in c.outputs)
            for c in cells]  # fmt: skip


@pytest.mark.slow
def test_the_whole_game_runs_and_the_form_is_learned(tmp_path):
    outcome = tour.run(NOTEBOOK, tmp_path / NOTEBOOK.name, {"out_dir": str(tmp_path / "run")})
    assert outcome.ok, outcome.error
    text = "\n".join(outputs(outcome.output))
    trained = re.search(r"loss ([\d.]+) -> ([\d.]+) in 4 steps on 2 processes; trained [\d,]+ of "
                        r"[\d,]+ parameters \((\d\.\d)%\)", text)
    assert trained and float(trained[2]) < float(trained[1]) and trained[3] == "1.8", text
    before = re.search(r"^before\s+(\d+)\s+(\d+)\s+8$", text, re.M)
    after = re.search(r"^after\s+(\d+)\s+(\d+)\s+8$", text, re.M)
    assert before and after, text
    assert int(before[1]) == 0 and int(after[1]) >= 6, (before[0], after[0])
    assert "exercise 00a.1: not answered yet." in text  # the exercise, unanswered, runs through
