"""Data: local files of every supported kind, text or chat messages, clear errors."""

import json

import pytest
from conftest import ROOT, TINY

from kit.config import ConfigError, DataConfig
from kit.inputs import builtin, datafile
from kit.recipe import data, tokens


@pytest.fixture(scope="module")
def tokenizer():
    return builtin.train_tokenizer()


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
    pairs = tmp_path / "pairs.jsonl"  # prompt/completion rows: not a shape the kit reads
    pairs.write_text('{"prompt": "2+2?", "completion": "4"}\n' * 4)
    with pytest.raises(ConfigError) as refused:
        data.build_datasets(DataConfig(path=str(pairs)), tokenizer, seed=0)
    assert str(refused.value) == (
        f"data.text_field: 'text' is not a column of {pairs}; columns: prompt, completion; "
        "prompt/completion rows are not read: write each as messages, the prompt the user's "
        "turn and the completion the assistant's")


GOOD = '{"text": "fine"}\n'
CHAT = '{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ho"}]}\n'
# (file name, its text, what the one line must say): every kind of bad file kit.inputs.datafile refuses.
BAD_FILES = [
    ("missing.jsonl", GOOD * 2 + '{"body": "no text"}\n' + GOOD * 3,
     "row 3 (line 3): 'text' is missing or null; every row needs a string in data.text_field"),
    ("null.jsonl", GOOD * 4 + "\n" + '{"text": null}\n' + GOOD,  # the blank line is counted
     "row 6 (line 6): 'text' is missing or null; every row needs a string in data.text_field"),
    ("number.jsonl", GOOD + '{"text": 7}\n' + GOOD * 3 + '{"text": ["a", "list"]}\n',
     "row 2 (line 2): 'text' is 7 (int), not a string (1 more bad row: 6); every row needs a string"),
    ("empty.jsonl", "", "holds no rows"),
    ("blank.jsonl", "\n  \n\t\n", "holds no rows"),
    ("broken.jsonl", GOOD * 2 + '{"text": "a" "b"}\n' + GOOD,
     "line 3 is not valid JSON (Expecting ',' delimiter: column 14)"),
    ("broken.json", '[\n {"text": "a"},\n {"text": "b"}\n {"text": "c"}\n]\n',
     "line 4 is not valid JSON (Expecting ',' delimiter: column 2)"),
    ("number.json", '[{"text": "a"}, {"text": 3}, {"text": "b"}]',
     "row 2 (record 2): 'text' is 3 (int), not a string; every row needs a string"),
    ("broken.csv", 'text,n\nfine,1\n"open quote,2\nfine,3\n',
     "line 3 does not parse as CSV (unexpected end of data)"),
    ("null.csv", "text,n\nfine,1\nfine,2\n,3\n",
     "row 3 (record 3, the header not counted): 'text' is missing or null; every row needs a "
     "string in data.text_field"),
    ("chat.jsonl", CHAT + '{"messages": "hi"}\n' + CHAT,
     "row 2 (line 2): 'messages' is 'hi' (str), not a non-empty list; every row needs a "
     "non-empty list"),
    ("chat-item.jsonl", CHAT * 3 + '{"messages": [{"role": "user"}]}\n',
     "row 4 (line 4): 'messages' message 1 is {'role': 'user'"),
    ("chat.csv", 'messages\n"[{""role"": ""user"", ""content"": ""hi""}]"\n',
     "is a CSV file with chat rows ('messages'); a CSV holds text rows only (a string column, "
     "data.text_field, data.format=text): chat rows (messages, ShareGPT conversations) need a "
     ".jsonl, .json or .parquet file"),
    ("sharegpt.csv", 'conversations,text\n"[]",fine\n', "is a CSV file with chat rows "
     "('conversations'); a CSV holds text rows only"),
]  # fmt: skip


@pytest.mark.parametrize("name, text, says", BAD_FILES, ids=[b[0] for b in BAD_FILES])
def test_bad_files_are_refused_in_one_line(tmp_path, tokenizer, name, text, says):
    """The check step (check_file) and the ranks (build_datasets) refuse the same file with the
    same line: the field, the file, where in it, what is wrong and what is allowed."""
    from kit.inputs import datafile

    path = tmp_path / name
    path.write_text(text)
    cfg = DataConfig(path=str(path), max_seq_len=16)
    with pytest.raises(ConfigError) as checked:
        datafile.check_file(cfg)
    with pytest.raises(ConfigError) as built:
        data.build_datasets(cfg, tokenizer, seed=0)
    message = str(checked.value)
    assert message == str(built.value)
    assert "\n" not in message and message.startswith(f"data.path: {str(path)!r} ")
    assert says in message, message
    val = DataConfig(path="kit:sample", val_path=str(path))  # data.val_path: the same checks
    with pytest.raises(ConfigError, match=r"^data\.val_path: ") as checked:
        datafile.check_file(val)
    assert says in str(checked.value)


CHAT_ROW = {"messages": [{"role": "user", "content": "Capital of Peru?"},
                         {"role": "assistant", "content": "Lima"}]}
SHAREGPT_ROW = {"conversations": [{"from": "human", "value": "Capital of Peru?"},
                                  {"from": "gpt", "value": "Lima"}]}
SHAPES = {"text": {"text": "row 1 says hello"}, "messages": CHAT_ROW, "sharegpt": SHAREGPT_ROW}


@pytest.mark.parametrize("kind", ["jsonl", "json", "csv", "parquet"])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_each_format_holds_the_row_shapes_the_docs_name(tmp_path, kind, shape):
    """What README.md and docs/recipe.md say of data files, held: .jsonl, .json and .parquet hold
    text, chat (messages) and ShareGPT rows; .csv holds text rows only (its cells are strings), and
    chat rows in a CSV are one line naming the file and what is allowed."""
    import pandas as pd

    from kit.inputs import datafile

    rows = [SHAPES[shape]] * 4
    path = tmp_path / f"rows.{kind}"
    if kind == "jsonl":
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    elif kind == "json":
        path.write_text(json.dumps(rows))
    elif kind == "csv":  # a chat column as JSON text: the one way a CSV could carry one
        pd.DataFrame([{k: v if isinstance(v, str) else json.dumps(v) for k, v in r.items()}
                      for r in rows]).to_csv(path, index=False)
    else:
        pd.DataFrame(rows).to_parquet(path)
    cfg = DataConfig(path=str(path))
    if kind == "csv" and shape != "text":
        with pytest.raises(ConfigError) as refused:
            datafile.check_file(cfg)
        assert str(refused.value).startswith(f"data.path: {str(path)!r} is a CSV file with chat "
                                             "rows"), refused.value
        assert "need a .jsonl, .json or .parquet file" in str(refused.value)
        return
    datafile.check_file(cfg)
    column = datafile.texts_column(datafile.read_rows(path), cfg, str(path))
    assert column == ("text", "text") if shape == "text" else column[0] == "messages"
    readme = " ".join((ROOT / "README.md").read_text().split())
    assert "`.csv` holds plain-text rows only" in readme
    recipe = " ".join((ROOT / "docs" / "recipe.md").read_text().split())
    assert "`.csv` holds text rows only" in recipe


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
    assert datafile.read_rows_stdlib(path) == datafile.read_rows(path)


# ---------------------------------------------------------------- packing (data.packing=true)
TEXTS = [
    "short one",
    "a somewhat longer sample that goes on for a while",
    "Question: what is 13 plus 14? Answer: 13 plus 14 is 27.",
    "mid length text here",
]


@pytest.fixture(scope="module")
def tiny_llama():
    return builtin.resolve("kit:tiny-llama")


def samples(tokenizer, texts, max_len):
    """Each text tokenized on its own, as packing sees it (eos appended, truncated)."""
    return [tokenizer(t + tokenizer.eos_token, max_length=max_len, truncation=True)["input_ids"]
            for t in texts]


def segments(row):
    """(start, end) of each sample in a packed row: position ids restart at 0, padding excluded."""
    starts = (row["position_ids"] == 0).nonzero().flatten().tolist()
    end = starts[-1] + int((row["labels"][starts[-1] + 1:] != -100).sum()) + 1
    return list(zip(starts, starts[1:] + [end], strict=True))


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_packed_row_equals_samples_run_alone(tokenizer, tiny_llama, attn):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32,
                                                 attn_implementation=attn).eval()
    model.config.use_cache = False  # as kit.train sets it: with a KV cache packing is ignored
    alone = [torch.tensor([ids]) for ids in samples(tokenizer, TEXTS, 96)]
    assert len({x.shape[1] for x in alone}) == len(alone)  # lengths differ
    packed = tokens.encode_packed(tokens.Tokens(TEXTS, tokenizer, cut=96), 96)
    assert len(packed["input_ids"]) == 1 and data.count_tokens(packed) < 96  # one row, padded
    bounds = segments({k: v[0] for k, v in packed.items()})
    with torch.no_grad():
        out = model(**packed)
        runs = [model(input_ids=x, labels=x) for x in alone]
        unpositioned = model(input_ids=packed["input_ids"]).logits
    # Loss: the packed row's mean equals the token-weighted mean of the samples' own losses.
    n = torch.tensor([x.shape[1] - 1 for x in alone], dtype=torch.float64)
    expected = sum(r.loss.double() * k for r, k in zip(runs, n, strict=True)) / n.sum()
    assert abs(out.loss.item() - expected.item()) < 1e-5
    # Logits: each sample inside the row sees only itself (no attention across samples).
    for (a, b), run in zip(bounds, runs, strict=True):
        torch.testing.assert_close(out.logits[0, a:b], run.logits[0], atol=1e-5, rtol=1e-5)
    # The check has teeth: without position ids the same row attends across samples.
    a, b = bounds[1]
    assert (unpositioned[0, a:b] - runs[1].logits[0]).abs().max() > 1e-2


def test_packed_rows_hold_every_token_once(tmp_path, tokenizer):
    texts = [("word " * n).strip() for n in (3, 20, 7, 1, 12, 40, 5, 9, 2, 15, 30, 4)]
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    max_len = 24  # the 40-word sample is truncated
    cfg = DataConfig(path=str(path), max_seq_len=max_len, val_fraction=0, packing=True)
    train, _ = data.build_datasets(cfg, tokenizer, seed=0)
    expected = samples(tokenizer, texts, max_len)
    assert max(map(len, expected)) == max_len
    assert set(train.tensors) == {"input_ids", "labels", "position_ids"}  # no attention mask
    found = []
    for i in range(len(train)):
        row = train[i]
        bounds = segments(row)
        for a, b in bounds:
            found.append(row["input_ids"][a:b].tolist())
            assert row["labels"][a] == -100  # no token predicts across a boundary
            assert (row["labels"][a + 1:b] == row["input_ids"][a + 1:b]).all()
            assert row["position_ids"][a:b].tolist() == list(range(b - a))
        end = bounds[-1][1]
        assert (row["input_ids"][end:] == tokenizer.pad_token_id).all()
        assert (row["labels"][end:] == -100).all()
        assert (row["position_ids"][end:] > 0).all()  # padding is not a sample start
        if i + 1 < len(train):  # greedy: the next row's first sample did not fit here
            assert end + segments(train[i + 1])[0][1] > max_len
    assert found == expected  # every token, once, in order
    assert data.count_tokens(train.tensors) == sum(map(len, expected))


def test_packed_batches_resume_and_one_row(tokenizer):
    train, _ = data.build_datasets(DataConfig(packing=True, max_seq_len=64), tokenizer, seed=0)
    batches = data.Batches(data.loader(train, 4, 0, 2, seed=0, train=True))
    for _ in range(len(batches.dl) + 2):  # into the second epoch
        next(batches)
    resumed = data.Batches(data.loader(train, 4, 0, 2, seed=0, train=True))
    resumed.load_state_dict(batches.state_dict())
    a, b = next(batches), next(resumed)
    assert a.keys() == b.keys() and all((a[k] == b[k]).all() for k in a)
    # flash_attention_2's layout: the same batch as one row, whose sample starts transformers
    # finds from the position ids alone.
    from transformers.modeling_flash_attention_utils import prepare_fa_kwargs_from_position_ids

    flat = next(iter(data.loader(train, 4, 0, 2, seed=0, train=True, one_row=True)))
    rows = next(iter(data.loader(train, 4, 0, 2, seed=0, train=True)))
    assert flat["input_ids"].shape == (1, 4 * 64)
    assert all((flat[k] == rows[k].reshape(1, -1)).all() for k in rows)
    (cu_seqlens, _), _ = prepare_fa_kwargs_from_position_ids(flat["position_ids"])
    starts = [r * 64 + a for r in range(4) for a, _ in segments({k: v[r] for k, v in rows.items()})]
    assert cu_seqlens.tolist() == starts + [4 * 64]


# A packed training run that learns and saves: tests/test_train.py's ddp-nf4-packed case.


def test_datasets_caches_the_file_under_kit_home(tmp_path, monkeypatch):
    """The data file's `datasets` cache lives with the kit's other caches (KIT_HOME), not in
    ~/.cache/huggingface."""
    from kit.inputs import datafile

    monkeypatch.setenv("KIT_HOME", str(tmp_path / "home"))
    path = write(tmp_path, "jsonl")
    assert len(datafile.read_rows(path)) == 40
    assert any((tmp_path / "home" / "datasets").rglob("*.arrow"))


def chat_rows(tmp_path, name, rows):
    path = tmp_path / name
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_sharegpt_conversations_train_as_the_same_messages(tmp_path, tokenizer):
    """ShareGPT rows ({from, value} turns in `conversations`) are read as chat messages: the
    same tokens as the {role, content} file, with no option to set."""
    turns = [("system", "Be brief."), ("user", "What is 2+2?"), ("assistant", "4")]
    names = {"system": "system", "user": "human", "assistant": "gpt"}
    messages = [{"messages": [{"role": r, "content": c} for r, c in turns]}] * 8
    sharegpt = [{"conversations": [{"from": names[r], "value": c} for r, c in turns]}] * 8
    built = [data.build_datasets(DataConfig(path=chat_rows(tmp_path, f"{n}.jsonl", rows),
                                            max_seq_len=32), tokenizer, seed=0)[0]
             for n, rows in (("messages", messages), ("sharegpt", sharegpt))]
    assert (built[0].tensors["input_ids"] == built[1].tensors["input_ids"]).all()
    assert "<|assistant|> 4" in tokenizer.decode(built[1][0]["input_ids"])


def test_a_role_typo_is_refused_naming_the_row_and_the_role(tmp_path):
    """A role no chat template knows ("asistant") would train as written, without a word: the
    check names the row, the role, the nearest allowed one and what is allowed."""
    rows = [{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}] * 3
    rows.append({"messages": [{"role": "user", "content": "hi"}, {"role": "asistant", "content": "yo"}]})
    cfg = DataConfig(path=chat_rows(tmp_path, "typo.jsonl", rows))
    for stdlib in (True, False):  # the check step's reader and the ranks'
        with pytest.raises(ConfigError) as e:
            datafile.check_file(cfg, stdlib=stdlib)
        assert str(e.value).count("\n") == 0 and "row 4 (line 4)" in str(e.value)
        assert "message 2 has the role 'asistant' (did you mean 'assistant'?), not one of " \
               "system, user, assistant, tool" in str(e.value)


def test_a_small_validation_split_is_evaluated_once_on_fewer_ranks(tokenizer):
    """3 validation rows, 2 ranks x batch 2 (too few for DistributedSampler's full batches, which
    used to refuse the run): rank 0 evaluates rows 0 and 2, rank 1 row 1 beside a filler with
    no labels; both run one batch (a sharded forward is collective). A training split that
    small is refused, naming the split and remedies that exist."""
    rows = data.Rows(tokens.encode(tokens.Tokens([f"row {i} says hello" for i in range(3)],
                                                 tokenizer, cut=8), 8))
    got = [data.loader(rows, 2, rank, 2, 0, train=False) for rank in (0, 1)]
    assert [len(batches) for batches in got] == [1, 1]
    assert (got[0][0]["input_ids"] == rows.tensors["input_ids"][[0, 2]]).all()
    assert (got[1][0]["input_ids"][0] == rows.tensors["input_ids"][1]).all()
    assert (got[1][0]["labels"][1] == -100).all()
    labelled = sum(int((b["labels"] != -100).sum()) for batches in got for b in batches)
    assert labelled == int((rows.tensors["labels"] != -100).sum())  # every row once
    with pytest.raises(ConfigError) as e:
        data.loader(rows, 2, 0, 2, 0, train=True)
    assert str(e.value) == ("training.batch_size: 2 is not allowed; the training split has 3 "
                            "rows, which cannot fill 2 ranks x 2; use training.batch_size=1, "
                            "more rows in data.path, or fewer processes")


@pytest.mark.slow
def test_a_one_row_validation_file_trains_on_two_ranks(tmp_path):
    """The case that stopped a first fine-tune: a validation split of one row, 2 processes."""
    from conftest import read_run, torchrun

    val = chat_rows(tmp_path, "val.jsonl", [{"text": "one held-out row of text"}])
    torchrun(tmp_path / "run", "training.steps=2", "training.eval_every=2", f"data.val_path={val}")
    _, metrics = read_run(tmp_path / "run")
    evals = [m["loss"] for m in metrics if m.get("split") == "val"]
    assert len(evals) == 1 and 0 < evals[0] < 20, metrics


@pytest.mark.parametrize("packing", [False, True], ids=["padded", "packed"])
def test_chat_rows_train_on_the_assistants_turns(tmp_path, tokenizer, packing):
    """data.train_on=assistant (the default): the labels of a chat row are its assistant turns
    (each reply, its end of turn and the end-of-sequence token after the last one) and -100
    elsewhere, the user's turn between two replies included; train_on=all trains every token."""
    chat = [{"role": "user", "content": "Add 2 and 3."}, {"role": "assistant", "content": "5"},
            {"role": "user", "content": "And 4?"}, {"role": "assistant", "content": "9"}]
    path = chat_rows(tmp_path, "chat.jsonl", [{"messages": chat}] * 4)
    found, real = {}, {}
    for train_on in ("assistant", "all"):
        cfg = DataConfig(path=path, max_seq_len=40, packing=packing, train_on=train_on, val_fraction=0)
        rows = data.build_datasets(cfg, tokenizer, seed=0)[0]
        found[train_on] = tokenizer.decode(rows[0]["input_ids"][rows[0]["labels"] != -100])
        real[train_on] = data.count_tokens(rows.tensors)
    assert real["assistant"] == real["all"]  # the prompt's tokens still count as real tokens
    assert found["assistant"].startswith(" 5\n 9\n</s>") and "user" not in found["assistant"], found
    assert "<|user|> And 4?" in found["all"] or "user|> And 4?" in found["all"]


def test_kit_sft_says_it_cannot_train_only_the_assistants_turns(tokenizer):
    """kit.sft.trainer hands texts to TRL, which trains every token: with chat rows and the default
    data.train_on it refuses in one line instead of training on the prompts silently."""
    from kit.config import load_config
    from kit.sft import trainer as sft

    cfg = load_config(None, ["data.path=kit:sample-chat"])
    with pytest.raises(ConfigError, match=r"^data.train_on: 'assistant' is not allowed with kit.sft.trainer"):
        sft.text_datasets(cfg, tokenizer, 2)
    train, _ = sft.text_datasets(load_config(None, ["data.path=kit:sample-chat", "data.train_on=all"]),
                                 tokenizer, 2)
    assert "<|user|>" in train[0]["text"]


def test_the_run_says_what_it_will_see_of_its_data(tmp_path, tokenizer):
    """The ranks' one summary line: rows per split and per rank, tokens, what the loss covers,
    and how many epochs the steps make (an epoch: the rows every rank's full batches take)."""
    rows = [{"messages": [{"role": "user", "content": f"Add {i} and 1."},
                          {"role": "assistant", "content": str(i + 1)}]} for i in range(12)]
    cfg = DataConfig(path=chat_rows(tmp_path, "chat.jsonl", rows), max_seq_len=32, val_fraction=0.2)
    train, val = data.build_datasets(cfg, tokenizer, seed=0)
    from kit.config import TrainingConfig

    line = data.summary(train, val, cfg, TrainingConfig(batch_size=2, grad_accum=1, steps=5), 2)
    tokens = data.count_tokens(train.tensors)
    assert line == (f"data: 10 training rows (5 per rank), {tokens:,} tokens; 2 validation rows; "
                    "loss on the assistant's turns; 5 steps x 4 rows = 2.5 epochs (2 steps each)")


# A template that renders only the user's and the assistant's turns, and refuses two user turns in
# a row, as many shipped templates do (raise_exception is transformers' own helper).
PICKY_TEMPLATE = (
    "{% for m in messages %}{% if loop.index0 > 0 and m['role'] == 'user' and "
    "messages[loop.index0 - 1]['role'] == 'user' %}{{ raise_exception('Conversation roles must "
    "alternate user/assistant/user/assistant') }}{% endif %}{% if m['role'] in ['user', "
    "'assistant'] %}<|{{ m['role'] }}|> {{ m['content'] }}\n{% endif %}{% endfor %}")


REPLY = {"role": "assistant", "content": "yo"}  # a row with something to train on (datafile)


@pytest.mark.parametrize("bad, says", [
    ([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}, REPLY],
     "message 1 (role 'system') is not in the text the model's chat template makes of it"),
    ([{"role": "user", "content": "hi"}, {"role": "user", "content": "again"}, REPLY],
     "is refused by the model's chat template: Conversation roles must alternate"),
], ids=["role-the-template-drops", "turns-the-template-refuses"])
def test_roles_are_checked_against_the_models_chat_template(tmp_path, tokenizer, bad, says):
    """A role this model's template does not render would train as nothing, silently, and a
    template's own refusal is a traceback from jinja: both are one line naming the row."""
    import copy

    picky = copy.deepcopy(tokenizer)
    picky.chat_template = PICKY_TEMPLATE
    good = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}
    cfg = DataConfig(path=chat_rows(tmp_path, "chat.jsonl", [good] * 3 + [{"messages": bad}] + [good]))
    with pytest.raises(ConfigError) as e:
        data.build_datasets(cfg, picky, seed=0)
    line = str(e.value)
    assert line.count("\n") == 0 and line.startswith(f"data.path: {cfg.path!r} row 4 (line 4): "
                                                     f"'messages' {says}"), line
    assert line.endswith("allowed: roles and turns this model's chat template renders "
                         "(data.format=text trains on a text column as written)")
    assert data.build_datasets(cfg, tokenizer, seed=0)  # the kit's own template renders them all


@pytest.mark.parametrize("world_after", [1, 2, 3], ids=["2-to-1", "2-to-2", "2-to-3"])
def test_the_data_continues_where_it_stopped_on_any_number_of_ranks(world_after):
    """4 batches of 3 per rank on 2 ranks, then a resume on 1, 2 or 3: the rest of the epoch is
    the shuffled order's next samples, none seen before, none skipped (but the few an incomplete
    last batch drops); on 2 ranks, exactly the batches the ranks would have drawn next."""
    import torch

    rows = data.Rows({"input_ids": torch.arange(50).unsqueeze(1)})
    ids = lambda b: b["input_ids"].flatten().tolist()  # noqa: E731
    before, states = [], []
    for rank in (0, 1):
        batches = data.Batches(data.loader(rows, 3, rank, 2, 7, True))
        before += [i for _ in range(4) for i in ids(next(batches))]
        states.append(batches.state_dict())
    assert states[0] == states[1] == {"epoch": 0, "index": 4, "samples": 24}
    order = torch.randperm(50, generator=torch.Generator().manual_seed(7)).tolist()
    assert sorted(before) == sorted(order[:24])
    after, per_rank = [], []
    for rank in range(world_after):
        batches = data.Batches(data.loader(rows, 3, rank, world_after, 7, True))
        batches.load_state_dict(states[0])
        mine = [ids(next(batches)) for _ in range(len(batches.dl))]
        per_rank.append(mine)
        after += [i for batch in mine for i in batch]
        assert batches.epoch == 0 and batches.seen() == 24 + 3 * world_after * len(batches.dl)
    assert len(set(after)) == len(after) and not set(after) & set(before)
    assert sorted(after) == sorted(order[24:24 + len(after)])  # the order's next samples
    assert len(after) > 50 - 24 - 3 * world_after  # only an incomplete last batch per rank dropped
    if world_after == 2:  # the same ranks: what they would have drawn next, batch for batch
        straight = [data.Batches(data.loader(rows, 3, rank, 2, 7, True)) for rank in (0, 1)]
        for rank, batches in enumerate(straight):
            drawn = [ids(next(batches)) for _ in range(4 + len(per_rank[rank]))]
            assert drawn[4:] == per_rank[rank]


def test_one_split_rule_for_the_check_the_recipe_and_sft(tmp_path):
    """10 rows at data.val_fraction=0.25: 8 train and 2 evaluate in the recipe, and the check
    counts the same 8, so batch 4 on 2 ranks passes it (it counted 7 and refused, once)."""
    from kit.config import load_config
    from kit.run.check import check

    path = tmp_path / "ten.jsonl"
    path.write_text("".join(json.dumps({"text": f"row {i} of ten"}) + "\n" for i in range(10)))
    assert datafile.split_sizes(10, 0.25) == (8, 2) and datafile.split_sizes(10, 0) == (10, 10)
    cfg = load_config(TINY, [f"data.path={path}", "data.val_fraction=0.25", "data.packing=false",
                             "training.batch_size=4"])
    check(cfg, 2)  # no ConfigError: 8 training rows fill 2 ranks x 4
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(builtin.resolve(cfg.model.name))
    train, val = data.build_datasets(cfg.data, tokenizer, seed=cfg.training.seed)
    assert (len(train), len(val)) == (8, 2)


@pytest.mark.parametrize("side", ["right", "left"])
def test_one_tokenization_gives_the_rows_of_the_tokenizers_own_call(tokenizer, side):
    """Each text is tokenized once (kit.recipe.tokens): the rows at any length, cut and padded,
    are what the tokenizer's own padded and truncating call gives, and the longest row is read
    from the same tokens (data.max_seq_len=auto), so a start plans and lists its data from one
    tokenization."""
    import torch

    texts = [" ".join(["word"] * n) for n in (3, 17, 6, 30)]
    tokenizer.pad_token = tokenizer.pad_token or tokenizer.eos_token
    tokenizer.padding_side = side
    once = tokens.Tokens(texts, tokenizer)
    with_eos = [t + tokenizer.eos_token for t in texts]
    assert once.longest() == max(len(ids) for ids in tokenizer(with_eos)["input_ids"])
    for length in (8, 16, once.longest()):
        own = tokenizer(with_eos, max_length=length, truncation=True, padding="max_length",
                        return_tensors="pt")
        got = tokens.encode(once, length)
        assert torch.equal(got["input_ids"], own["input_ids"])
        assert torch.equal(got["attention_mask"], own["attention_mask"])
        assert (got["labels"][own["attention_mask"] == 0] == -100).all()
    assert tokens.encode(once, "auto")["input_ids"].shape == (4, once.longest())
