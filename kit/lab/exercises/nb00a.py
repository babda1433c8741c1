"""Notebook 00a's exercise (hands-on): write the rule that says whether a reply is in the form the
run taught, `ANSWER: <answer>` on one line. The check runs the learner's function on replies of
every kind the notebook shows and compares it with the kit's own rule (kit.recipe.data.ANSWER_FORM,
what data.score counts), imported when a check runs (the kernel side imports no torch before)."""

from __future__ import annotations

import re

from kit.lab.exercises import Exercise

# (reply, what goes wrong when a rule misjudges it)
CASES = [
    ("ANSWER: Paris", "a reply of exactly the form"),
    ("ANSWER: 12", "a number is an answer too"),
    ("The capital of France is Paris.", "a sentence, as the base model replies, is not the form"),
    ("Sure! ANSWER: Paris", "the form is the whole reply: it starts with ANSWER"),
    ("ANSWER: Paris\nThe capital of France is Paris.",
     "the form is one line: a second line (the model going on after its answer) breaks it"),
    ("answer: Paris", "the run taught ANSWER in capitals; another case is not the form"),
    ("ANSWER:", "ANSWER: with nothing after it answers nothing"),
    ("ANSWER:  ", "spaces after ANSWER: are not an answer"),
]


def in_form(reply: str) -> bool:
    """True when the reply is one line `ANSWER: <answer>`, something after the colon and space."""
    return re.fullmatch(r"ANSWER: \S[^\n]*", reply) is not None


def _check(fn) -> str | None:
    if not callable(fn):
        return "answer with the function in_form(reply) you wrote (its name, no call)"
    from kit.recipe.data import ANSWER_FORM

    for reply, why in CASES:
        want = ANSWER_FORM.fullmatch(reply) is not None
        got = fn(reply)
        if not isinstance(got, bool):
            return f"in_form({reply!r}) returned {got!r}; return True or False"
        if got != want:
            return f"in_form({reply!r}) is {got}, the kit's rule says {want}: {why}"
    return None


def _starts_with(reply: str) -> bool:
    return reply.startswith("ANSWER:")


def _anywhere(reply: str) -> bool:
    return "ANSWER: " in reply


def _any_case(reply: str) -> bool:
    return re.fullmatch(r"answer: \S[^\n]*", reply, re.IGNORECASE) is not None


EXERCISES = [
    Exercise(
        key="00a.1",
        question=("Hands-on, quick: write in_form(reply), True when a reply is in the form the run "
                  "taught (one line, `ANSWER: <answer>`), else False: the rule behind the table's "
                  "'in the form' column. Try it on the replies above (before and after); the check "
                  "runs it on replies of every kind and compares it with the kit's rule."),
        check=_check,
        solution=lambda: in_form,
        wrong=(_starts_with, _anywhere, _any_case),
        hands_on=True,
    ),
]
