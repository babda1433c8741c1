"""A first real fine-tune as a new user does it: 40 chat rows of their own, the shipped real-model
recipe on 2 CPU processes, then a chat with the result (issue 31's path, end to end)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from conftest import ROOT

from kit.recipe import data

HELD_OUT = ROOT / "kit" / "data" / "answer-format-heldout.jsonl"


@pytest.mark.full  # CI time: the real model's fine-tune runs in notebook 12's test (test_capstone), the front door in test_front_door
@pytest.mark.slow
def test_forty_chat_rows_train_on_the_first_try_and_the_result_chats(tmp_path):
    """40 rows (a validation split of 4, which packs into one row: once refused for 2 ranks)
    train with nothing but data.path changed; the ranks say what they see (the loss on the
    assistant's turns); the adapter replies in the taught form to questions it never saw, the
    base mostly not; `kit chat` answers in it too."""
    from kit.inference.merge import load_for_inference

    rows = (ROOT / "kit" / "data" / "answer-format.jsonl").read_text().splitlines()[:40]
    mine = tmp_path / "my_chat.jsonl"
    mine.write_text("\n".join(rows) + "\n")
    # As the README says: the front door, the shipped recipe by name, data.path changed.
    run = subprocess.run([sys.executable, "-m", "kit", "train", "smollm2-answer-cpu",
                          f"data.path={mine}", f"run.output_dir={tmp_path / 'run'}"], cwd=ROOT,
                         capture_output=True, text=True, timeout=900)  # fmt: skip
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr
    said = next(line for line in run.stdout.splitlines() if "]:data: " in line)  # rank 0's
    assert " 1 validation packed rows; loss on the assistant's turns; " in said, said
    # The check said the same before any rank started, and that the run folder is new.
    checked = run.stdout.splitlines()[0]
    planned = next(line for line in run.stdout.splitlines() if "]:plan: " in line)  # rank 0's
    assert checked == (f"{said.split(']:', 1)[1]}; {planned.split(']:', 1)[1]}; "
                       f"run: {tmp_path / 'run'}: starting at step 0")
    adapter = json.loads((tmp_path / "run" / "adapter" / "adapter_config.json").read_text())
    assert adapter["base_model_name_or_path"] == "kit:smollm2-135m-instruct"  # not this KIT_HOME
    held = [json.loads(line)["messages"] for line in HELD_OUT.read_text().splitlines()]
    questions, answers = [m[0]["content"] for m in held], [m[1]["content"] for m in held]
    model, tokenizer = load_for_inference(tmp_path / "run")
    after = data.score(data.chat_replies(model, tokenizer, questions), answers)
    with model.disable_adapter():
        before = data.score(data.chat_replies(model, tokenizer, questions), answers)
    assert after["in_form"] - before["in_form"] >= 16, (before, after)
    proc = subprocess.run([sys.executable, "-m", "kit", "chat", str(tmp_path / "run"),
                           "--prompt", questions[0], "--max-new-tokens", "16"], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert proc.returncode == 0 and proc.stdout.startswith("adapter: ANSWER: "), proc.stdout
