"""Exercises of notebook 12 (capstone): the chat template (12.1). Hands-on (12.2): 50 rows of the
training file in an answer format of the learner's own, made by their function and checked as a
run would take them: the kit's data checks on the written file, one format for every reply with
the answer kept and the question unchanged, and the tokenized rows (SmolLM2's chat template,
kit.recipe.data) still holding reply tokens to learn."""

from __future__ import annotations

import json
import tempfile
from functools import lru_cache
from pathlib import Path

from kit.lab.exercises import Exercise

PRETRAINED = "smollm2-135m-instruct"


def _tokenizer():
    """SmolLM2's tokenizer: from the converted folder when notebook 12 has made it (fast), else
    straight from the GGUF file (no model conversion, a few seconds)."""
    from transformers import AutoTokenizer

    from kit.inputs import builtin

    folder = builtin.folder(PRETRAINED)
    if (folder / "tokenizer_config.json").is_file():
        return AutoTokenizer.from_pretrained(folder)
    path = builtin.gguf_path(*builtin.CONVERTED[PRETRAINED])
    return AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)


@lru_cache(maxsize=1)
def _generation_prompt() -> str:
    """What add_generation_prompt=True appends after the last user turn."""
    tok = _tokenizer()
    messages = [{"role": "user", "content": "What is the capital of Peru?"}]
    without = tok.apply_chat_template(messages, tokenize=False)
    return tok.apply_chat_template(messages, tokenize=False,
                                   add_generation_prompt=True).removeprefix(without)


def _generation_check(answer):
    if not isinstance(answer, str):
        return f"expected a string, got {type(answer).__name__}"
    if answer.strip() == _generation_prompt().strip():
        return None
    if "ANSWER" in answer:
        return "that is what the fine-tune teaches the model to write after it; the template's " \
               "text comes first."
    if "user" in answer or "system" in answer:
        return "the user's (and system's) turn is already rendered; what opens the turn the " \
               "model writes?"
    return "render one question with tokenizer.apply_chat_template(..., tokenize=False), with " \
           "and without add_generation_prompt=True, and compare the ends."


# ---- hands-on: 50 rows in a format of your own ----

ROWS = 50
CONFIG = "kit/configs/smollm2-answer-cpu.yaml"


def course_rows(n: int = ROWS) -> list[dict]:
    """The first n rows of the capstone's training file (data.path of its config)."""
    from kit import ROOT
    from kit.config import load_config

    path = ROOT / load_config(ROOT / CONFIG).data.path
    return [json.loads(line) for line in path.read_text().splitlines()[:n]]


def to_my_format(row):
    """The same question; the reply as a JSON object, {"answer": "99"}, instead of ANSWER: 99."""
    import json

    question, reply = row["messages"]
    answer = reply["content"].removeprefix("ANSWER: ")
    return {"messages": [question, {"role": "assistant", "content": json.dumps({"answer": answer})}]}


def _two_formats(row):
    question, reply = row["messages"]
    answer = reply["content"].removeprefix("ANSWER: ")
    said = f"=> {answer}" if len(answer) % 2 else f"The answer is {answer}."
    return {"messages": [question, {"role": "assistant", "content": said}]}


def _answer_lost(row):
    question, _ = row["messages"]
    return {"messages": [question, {"role": "assistant", "content": "=> (see above)"}]}


def _messages_only(row):
    question, reply = row["messages"]
    return [question, {"role": "assistant", "content": "=> " + reply["content"][8:]}]


def _asks_in_the_format(row):
    question, reply = row["messages"]
    asked = {"role": "user", "content": question["content"] + " Reply in JSON."}
    return {"messages": [asked, to_my_format(row)["messages"][1]]}


def _tokenized_replies(path: Path) -> list[int]:
    """Per row written at `path` (train and validation splits), the tokens its labels train on,
    as the run's ranks tokenize it (kit.recipe.data: the chat template, data.train_on=assistant,
    one sample per row at the config's max_seq_len)."""
    from kit.config import apply_overrides, config_from_dict, load_config
    from kit.recipe import data

    cfg = load_config(CONFIG)
    cfg = config_from_dict(apply_overrides(cfg.to_dict(), [f"data.path={path}",
                                                           "data.packing=false"]))  # fmt: skip
    train, val = data.build_datasets(cfg.data, _tokenizer(), seed=cfg.training.seed)
    return [int((row != -100).sum()) for part in (train, val) for row in part.tensors["labels"]]


def _check_format(fn) -> str | None:
    import copy

    from kit.config import ConfigError, load_config
    from kit.inputs import datafile

    if not callable(fn):
        return "give the function itself: exercises.check(\"12.2\", to_my_format) (no parentheses)"
    rows, made = course_rows(), []
    for i, row in enumerate(rows):
        try:
            made.append(fn(copy.deepcopy(row)))
        except Exception as e:  # the learner's code: its error is the hint
            return f"on row {i} ({row['messages'][0]['content']!r}) it raised {type(e).__name__}: {e}"
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "mine.jsonl"
        try:
            path.write_text("".join(json.dumps(r) + "\n" for r in made))
            datafile.read_checked(str(path), load_config(CONFIG).data)
        except (ConfigError, TypeError, ValueError) as e:
            said = str(e).splitlines()[0].replace(str(path), "mine.jsonl")
            return f"the kit refuses the file your rows make: {said}"
        templates = set()
        for i, (old, new) in enumerate(zip(rows, made, strict=True)):
            (question, reply), (asked, *rest) = old["messages"], new["messages"]
            answer = reply["content"].removeprefix("ANSWER: ")
            said = rest[-1]["content"] if rest and rest[-1].get("role") == "assistant" else None
            if asked != question:
                return (f"row {i}'s question became {asked.get('content')!r}: keep the questions "
                        "as they are, so that the held-out ones are asked as they will be")
            if said is None:
                return f"row {i} has no assistant reply after the question"
            if said.startswith("ANSWER:"):
                return f"row {i}'s reply is still in the course's format ({said!r}): a new one"
            if answer not in said:
                return (f"row {i}'s reply {said!r} lost the answer {answer!r}: the format "
                        "changes how the answer is written, not what it is")
            templates.add(said.replace(answer, "{answer}", 1))
        if len(templates) > 1:
            shown = sorted(templates)[:2]
            return (f"{len(templates)} formats, such as {shown[0]!r} and {shown[1]!r}: one "
                    "format for every reply, so that the model learns that one")
        empty = [i for i, n in enumerate(_tokenized_replies(path)) if n == 0]
    if empty:
        return (f"{len(empty)} rows keep no reply token to train on once tokenized at "
                "data.max_seq_len: shorten what comes before the reply")
    return None


EXERCISES = [
    Exercise(
        key="12.1",
        question=(
            "chat_replies renders a question with add_generation_prompt=True. What text does "
            "that flag append after the user's turn, the point where the model starts writing? "
            "(the answer: a string, as the template writes it)"),
        check=_generation_check,
        solution=_generation_prompt,
        wrong=("ANSWER: ", "<|im_start|>user\n", "assistant"),
    ),
    Exercise(
        key="12.2",
        question=("Hands-on: write to_my_format(row), one row of the training file (a question "
                  "and its reply 'ANSWER: x') in an answer format of your own: the same "
                  "question, the answer x written your way, one format for every reply. The "
                  "check converts the file's first 50 rows, writes them, and runs the kit's data "
                  "checks and tokenization on them as a run would."),
        check=_check_format,
        solution=lambda: to_my_format,
        wrong=(_two_formats, _answer_lost, _messages_only, _asks_in_the_format),
        hands_on=True,
    ),
]
