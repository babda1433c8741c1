"""Exercises of notebook 12 (capstone): the chat template, and rows per optimizer step."""

from __future__ import annotations

from functools import lru_cache

from kit.lab.exercises import Exercise, one_of

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


def _rows_per_step() -> int:
    from kit import ROOT
    from kit.config import load_config

    t = load_config(ROOT / "kit" / "configs" / "smollm2-answer-cpu.yaml",
                    ["training.grad_accum=4"]).training
    return t.batch_size * 4 * t.grad_accum


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
        question=(
            "The same config on the GPU route with 4 GPUs (nproc=4) and training.grad_accum=4: "
            "how many packed rows make one optimizer step? (the answer: a number of rows)"),
        check=lambda answer: one_of(_rows_per_step(), {
            4: "count all three factors: rows per micro-step per process, processes, and "
               "micro-steps per optimizer step.",
            8: "that is 2 processes (this CPU's nproc); the question has 4.",
        }, default="batch_size x processes x grad_accum, the question's numbers.")(answer),
        solution=_rows_per_step,
        wrong=(4, 8),
    ),
]
