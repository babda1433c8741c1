"""Data: local files of every supported kind, text or chat messages, clear errors."""

import json

import pytest

from kit import data, tiny
from kit.config import ConfigError, DataConfig


@pytest.fixture(scope="module")
def tokenizer():
    return tiny.train_tokenizer()


def write(tmp_path, kind):
    rows = [{"body": f"row {i} says hello"} for i in range(40)]
    p = tmp_path / f"d.{kind}"
    if kind == "jsonl":
        p.write_text("".join(json.dumps(r) + "\n" for r in rows))
    elif kind == "json":
        p.write_text(json.dumps(rows))
    else:
        import pandas as pd

        df = pd.DataFrame(rows)
        df.to_csv(p, index=False) if kind == "csv" else df.to_parquet(p)
    return p


@pytest.mark.parametrize("kind", ["jsonl", "json", "csv", "parquet"])
def test_local_files_load_and_split(tmp_path, tokenizer, kind):
    cfg = DataConfig(path=str(write(tmp_path, kind)), text_field="body", max_seq_len=16, val_fraction=0.25)
    train, val = data.build_datasets(cfg, tokenizer, seed=0)
    assert (len(train), len(val)) == (30, 10)
    row = train[0]
    assert row["input_ids"].shape == (16,)
    # Padding carries no loss.
    assert ((row["labels"] == -100) == (row["attention_mask"] == 0)).all()


def test_chat_messages_use_the_chat_template(tokenizer):
    train, _ = data.build_datasets(DataConfig(path="kit:sample-chat", max_seq_len=32), tokenizer, seed=0)
    text = tokenizer.decode(train[0]["input_ids"], skip_special_tokens=True)
    assert "<|user|>" in text and "<|assistant|>" in text


def test_missing_text_field_names_the_columns(tmp_path, tokenizer):
    cfg = DataConfig(path=str(write(tmp_path, "jsonl")), text_field="text")
    with pytest.raises(ConfigError, match=r"data.text_field: 'text' is not a column of .*; columns: body"):
        data.build_datasets(cfg, tokenizer, seed=0)


@pytest.mark.parametrize("path, message", [("x.txt", "expected a file ending in"), ("/no/such.jsonl", "does not exist")])
def test_bad_paths(tokenizer, path, message):
    with pytest.raises(ConfigError, match=f"data.path: .*{message}"):
        data.build_datasets(DataConfig(path=path), tokenizer, seed=0)


def test_split_is_identical_across_ranks_and_slices_differ(tokenizer):
    train, _ = data.build_datasets(DataConfig(), tokenizer, seed=0)
    a = next(iter(data.loader(train, 4, 0, 2, seed=0, train=True)))["input_ids"]
    b = next(iter(data.loader(train, 4, 1, 2, seed=0, train=True)))["input_ids"]
    again = next(iter(data.loader(train, 4, 0, 2, seed=0, train=True)))["input_ids"]
    assert (a == again).all() and not (a == b).all()


@pytest.mark.parametrize("kind", ["jsonl", "json", "csv"])
def test_stdlib_reader_matches_datasets(tmp_path, kind):
    path = write(tmp_path, kind)
    assert data.read_rows_stdlib(path) == data.read_rows(path)
