"""Notebook 12, the capstone: its data set (reproducible, held-out questions kept out of training),
the helpers it reads results with (kit.recipe.data: packed_mask, score), and one headless run of the
notebook whose measured margin is the one its text states."""

from __future__ import annotations

import ast
import importlib.util
import json
import re
import subprocess
import sys

import pytest
import torch
from conftest import ROOT

from kit.config import load_config
from kit.inputs import datafile
from kit.recipe import data

NOTEBOOK = ROOT / "notebooks" / "12-capstone-real-model.ipynb"
TRAIN = ROOT / "kit" / "data" / "answer-format.jsonl"
HELD_OUT = ROOT / "kit" / "data" / "answer-format-heldout.jsonl"
SCRIPT = ROOT / "benchmarks" / "tools" / "make_answer_format.py"
MARGIN = 24  # of 32: "at least 24 more of the 32 held-out questions are answered in it"
# CI time: 4 of the notebook's 8 steps (13 s each on 2 cores); the margin holds there too (+32 of
# 32 at 4, 5 and 6 steps, one run each on 2 cores; the merged model's right answers 16, 18 and 20
# against the base's 16); the tour runs all 8.
STEPS = 4


def rows(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def make_script():
    spec = importlib.util.spec_from_file_location("make_answer_format", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_data_set_is_what_its_script_writes(tmp_path):
    proc = subprocess.run([sys.executable, str(SCRIPT), "--out", str(tmp_path)], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    for path in (TRAIN, HELD_OUT):
        assert (tmp_path / path.name).read_bytes() == path.read_bytes(), path.name


def test_data_set_rows_are_checked_chats_and_held_out_items_stay_out():
    cfg = load_config(None, [f"data.path={TRAIN.relative_to(ROOT)}"]).data
    train = datafile.read_checked(cfg.path, cfg)  # every row checked, as the ranks read it
    held = rows(HELD_OUT)
    assert 200 <= len(train) <= 400 and len(held) == 32
    for r in train + held:
        assert [m["role"] for m in r["messages"]] == ["user", "assistant"]
        assert data.ANSWER_FORM.fullmatch(r["messages"][1]["content"])
    asked = [r["messages"][0]["content"] for r in train]
    script = make_script()
    for kind, items in script.HELD_OUT.items():
        for item in items:
            if isinstance(item, str):  # a table's item: no training question names it
                assert not [q for q in asked if re.search(rf"\b{re.escape(item)}\b", q)], item
            else:  # a sum or product: no training question asks it, in any phrasing
                assert not set(asked) & {q.format(*item) for q in script.ASK[kind]}, item


def test_score_counts_one_line_answers_and_answers_held_as_a_word():
    replies = ["ANSWER: Paris", "The capital of France is Paris.", "ANSWER: 12\nANSWER: 13",
               "ANSWER: 120"]  # fmt: skip
    expected = ["Paris", "Paris", "12", "12"]
    assert data.score(replies, expected) == {"in_form": 2, "right": 3, "of": 4}


def test_packed_mask_is_the_block_diagonal_causal_mask():
    from transformers import LlamaConfig

    position_ids = torch.tensor([0, 1, 2, 0, 1, 0, 1, 2, 3])
    sample = torch.tensor([0, 0, 0, 1, 1, 2, 2, 2, 2])
    expected = (sample[:, None] == sample[None, :]) & torch.ones(9, 9, dtype=torch.bool).tril()
    assert torch.equal(data.packed_mask(position_ids, LlamaConfig()), expected)
    one = data.packed_mask(torch.arange(5), LlamaConfig())  # one sample: plain causal
    assert torch.equal(one, torch.ones(5, 5, dtype=torch.bool).tril())


def printed(notebook: dict) -> str:
    """What the code cells printed (stdout), in order."""
    return "".join("".join(o["text"]) for c in notebook["cells"] if c["cell_type"] == "code"
                   for o in c.get("outputs", []) if o.get("output_type") == "stream")  # fmt: skip


@pytest.mark.slow
def test_notebook_12_teaches_the_form_by_the_margin_it_states(tmp_path):
    """One headless run (papermill, as the tour runs it), a real 2-process NF4 + LoRA run: the
    held-out questions answered in the form `ANSWER: <x>` rise by at least MARGIN of 32 from the
    base to the adapter, and to the merged model loaded by plain transformers, while the answers'
    correctness moves far less (the text's claims)."""
    papermill = pytest.importorskip("papermill")
    out = tmp_path / "nb12"
    papermill.execute_notebook(
        str(NOTEBOOK), str(tmp_path / "12.ipynb"), parameters={"out_dir": str(out), "steps": STEPS},
        cwd=str(ROOT / "notebooks"), kernel_name="python3", progress_bar=False,
    )  # fmt: skip
    assert f"at least {MARGIN} more of the 32" in " ".join(NOTEBOOK.read_text().split())
    text = printed(json.loads((tmp_path / "12.ipynb").read_text()))
    found = re.search(r"^in the form: before (\d+)/32, after (\d+)/32 \(\+(-?\d+)\)$", text, re.M)
    before, after, gain = map(int, found.groups())
    assert gain == after - before >= MARGIN, text
    base = ast.literal_eval(re.search(r"^(\{'in_form'.*\})$", text, re.M)[1])  # section 1
    merged = ast.literal_eval(re.search(r"^merged: (\{.*?\}) \|", text, re.M)[1])
    assert base["in_form"] == before and merged["in_form"] - before >= MARGIN
    assert abs(merged["right"] - base["right"]) < gain / 2  # "right moves far less"
    assert "['The capital of France is Paris.']" in text
    assert "the second sample's first token sees the first: False" in text
    assert "the same split again (as on every rank): True" in text
    assert "held-out questions found in the training file: 0" in text
    result = json.loads((out / "run" / "result.json").read_text())
    assert (result["world_size"], result["status"]) == (2, "completed")
    assert "method: nf4" in (out / "run" / "config.yaml").read_text()
    assert "quantization_config" not in json.loads((out / "merged" / "config.json").read_text())
