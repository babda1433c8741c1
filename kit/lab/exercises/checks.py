"""A number check with a hint for each known mistake, shared by the notebooks' exercise modules
(kit/lab/exercises/nbNN.py): `close_to` gives one hint for every wrong number; a learner who made a
known mistake (forgot the headroom, the scales, grouped-query attention) is better told which."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any


def number(expected: float | Callable[[], float], mistakes: dict | Callable[[], dict],
           default: str, rel: float = 0.01, whole: bool = False) -> Callable[[Any], str | None]:
    """Right within `rel` of `expected` (exactly, if `whole`); a known wrong value (within the
    same tolerance) gets its own hint; any other number `default`. `expected` and `mistakes` may
    be functions, called at check time: a module of exercises imports without computing (no
    torch in a kernel that asks another notebook's question)."""

    def near(a: float, b: float) -> bool:
        return a == b if whole else math.isclose(a, b, rel_tol=rel)

    def check(answer: Any) -> str | None:
        if not isinstance(answer, (int, float)) or isinstance(answer, bool):
            return f"expected a number, got {type(answer).__name__}"
        right = expected() if callable(expected) else expected
        if near(float(answer), float(right)):
            return None
        known = mistakes() if callable(mistakes) else mistakes
        return next((hint for bad, hint in known.items() if near(float(answer), float(bad))),
                    default)

    return check
