"""Exercises of the course. Each stage notebook asks a few questions that the learner answers in a
cell marked `# EXERCISE`, and checks in the next cell:

    answer = ...                                  # EXERCISE 01.1: edit this line
    exercises.check("01.1", answer)               # right, or wrong with a hint

and has one hands-on exercise (`hands_on=True`; often a quick one and a stretch one), where the
learner writes or changes code, a function or a few config values, and the check runs it for real
(on two gloo processes where it is distributed) and says what went wrong:

    def all_reduce_by_parts(t):                   # EXERCISE 00.3: write this function
        raise NotImplementedError
    exercises.check("00.3", all_reduce_by_parts)  # run on 2 processes: right, or what it did

An exercise is a question, a check and a solution, kept together in kit/lab/exercises/nbNN.py (one
module a notebook, each a list `EXERCISES`). The solution is code, not a number: it computes the
answer with the kit's own functions, so that tests/test_exercises.py can run every solution
through its check in CI (and a wrong answer through it for its hint), and no exercise rots when
the kit changes. `check` of `...` (not yet answered), or of a function whose body is still
`raise NotImplementedError`, says what is asked; it never raises, so a notebook with its
exercises unanswered runs through (the tour, CI).

Gap filled: nbgrader and similar graders need a server and a course database; this is the check
cell of a notebook that runs anywhere, headless included.
"""

from __future__ import annotations

import importlib
import math
import pkgutil
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Exercise:
    """One question. `check(answer)` returns None when the answer is right, else a hint (one or
    two sentences that point at the mistake without giving the answer). `solution()` computes the
    right answer. `wrong` holds answers a learner is likely to give, each of which the check must
    refuse with a hint (the tests run them)."""

    key: str  # "NN.k": notebook number, exercise number
    question: str
    check: Callable[[Any], str | None]
    solution: Callable[[], Any]
    wrong: tuple = field(default=())
    hands_on: bool = False  # the learner writes code (a function, config values), not a value
    # What a "change it" exercise starts from (a function's source, or a value such as a list of
    # settings): checked unchanged, it is not answered yet, like a function whose body is still
    # `raise NotImplementedError`.
    given: Any = None
    # Computes several answers' checks at once (one child process for all), so that checking each
    # afterwards costs nothing: the tests call it with the solution and the likely mistakes.
    prepare: Callable[[list], None] | None = None


def close_to(expected: float, rel: float = 0.02, hint: str = "") -> Callable[[Any], str | None]:
    """A check for a number: right within `rel` (relative); the hint otherwise."""

    def check(answer: Any) -> str | None:
        if not isinstance(answer, (int, float)) or isinstance(answer, bool):
            return f"expected a number, got {type(answer).__name__}"
        if math.isclose(float(answer), float(expected), rel_tol=rel):
            return None
        return hint or "not this number; re-read the cell above the exercise"

    return check


def one_of(expected: Any, hints: dict | None = None, default: str = "") -> Callable[[Any], str | None]:
    """A check for a choice (a string, a tuple, a name): right if equal; a specific hint for a
    known wrong choice, else `default`."""

    def check(answer: Any) -> str | None:
        if answer == expected:
            return None
        return (hints or {}).get(answer, default or "not this one; re-read the cell above")

    return check


def registry() -> dict[str, Exercise]:
    """Every exercise of every notebook module (kit/lab/exercises/nbNN.py), by key."""
    found: dict[str, Exercise] = {}
    for info in pkgutil.iter_modules(__path__):
        if not info.name.startswith("nb"):
            continue
        for ex in importlib.import_module(f"{__name__}.{info.name}").EXERCISES:
            if ex.key in found:
                raise ValueError(f"exercise {ex.key} defined twice")
            found[ex.key] = ex
    return found


def check(key: str, answer: Any) -> None:
    """The check cell: prints right, or wrong with a hint, or (answer `...`) the question. Returns
    nothing (a returned value would show under the cell as `False`) and never raises on a wrong
    answer: the notebook runs on."""
    from kit.lab.exercises.checks import as_given, unwritten

    ex = registry()[key]
    if answer is ... or unwritten(answer) or as_given(answer, ex.given):
        print(f"exercise {key}: not answered yet. {ex.question}")
        return
    try:
        hint = ex.check(answer)
    except Exception as e:  # a malformed answer is a hint too, not a traceback
        hint = f"could not check {answer!r}: {e}"
    if hint is None:
        print(f"exercise {key}: right.")
        return
    print(f"exercise {key}: not yet. Hint: {hint}")


def solution(key: str) -> Any:
    """The right answer, computed (what a learner who is stuck can call). A hands-on exercise
    whose answer is a function prints that function's source instead (one way to write it)."""
    right = registry()[key].solution()
    if callable(right):
        from kit.lab.exercises.checks import source_of

        print(source_of(right))
        return None
    return right
