"""A number check with a hint for each known mistake, shared by the notebooks' exercise modules
(kit/lab/exercises/nbNN.py): `close_to` gives one hint for every wrong number; a learner who made a
known mistake (forgot the headroom, the scales, grouped-query attention) is better told which."""

from __future__ import annotations

import ast
import inspect
import linecache
import math
import textwrap
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


# ---- hands-on exercises: the learner's function, read as source ----


def source_of(fn: Callable) -> str:
    """The source of a function, dedented: one defined in a notebook cell too (IPython keeps each
    cell's text where inspect finds it)."""
    return textwrap.dedent(inspect.getsource(fn))


def unwritten(answer: Any) -> bool:
    """True for a function whose body is still the exercise's placeholder (`raise
    NotImplementedError`, `...` or `pass`, after an optional docstring): not answered yet."""
    if not callable(answer) or not inspect.isfunction(answer):
        return False
    try:
        (fn,) = ast.parse(source_of(answer)).body
    except (OSError, TypeError, SyntaxError, ValueError):  # a lambda, a built-in, no source
        return False
    if not isinstance(fn, ast.FunctionDef):
        return False
    body = [s for s in fn.body if not (isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant)
                                       and isinstance(s.value.value, str))]  # fmt: skip
    if not body:
        return True
    if len(body) != 1:
        return False
    (only,) = body
    if isinstance(only, ast.Pass) or (isinstance(only, ast.Expr) and isinstance(
            only.value, ast.Constant) and only.value.value is Ellipsis):
        return True
    if isinstance(only, ast.Raise) and only.exc is not None:
        exc = only.exc.func if isinstance(only.exc, ast.Call) else only.exc
        return isinstance(exc, ast.Name) and exc.id == "NotImplementedError"
    return False


def function_from(source: str, name: str, label: str) -> Callable:
    """The function `name` that `source` defines, defined as IPython defines a cell's (its source
    kept where inspect finds it): for a solution or a likely mistake that is code meant to run
    elsewhere (on ranks, among names this module does not have), shown and sent as text."""
    source = textwrap.dedent(source).strip() + "\n"
    filename = f"<exercise {label} {hash(source) & 0xFFFFFFFF:08x}>"  # one entry per text
    linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
    scope: dict = {}
    exec(compile(source, filename, "exec"), scope)  # the kit's own text, defined, not run
    return scope[name]


def same_code(fn: Any, source: str) -> bool:
    """True when function `fn` is `source` as given (comments and layout aside)."""
    if not inspect.isfunction(fn):
        return False
    try:
        return ast.dump(ast.parse(source_of(fn))) == ast.dump(ast.parse(textwrap.dedent(source)))
    except (OSError, TypeError, SyntaxError, ValueError):
        return False


def as_given(answer: Any, given: Any) -> bool:
    """True when the answer is still what a change-it exercise gave: the same code (`given` a
    function's source), or the same value."""
    if given is None:
        return False
    if isinstance(given, str) and inspect.isfunction(answer):
        return same_code(answer, given)
    try:
        return bool(answer == given)
    except Exception:  # an answer whose == is not a bool (a tensor): not the given value
        return False


def calls_of(fn: Callable | str) -> set[str]:
    """The names a function's code calls (`dist.all_reduce(...)` -> 'all_reduce'): what a check
    reads to tell the learner which call the exercise asks them to write without."""
    text = fn if isinstance(fn, str) else source_of(fn)
    return {getattr(node.func, "attr", getattr(node.func, "id", "")) for node in
            ast.walk(ast.parse(text)) if isinstance(node, ast.Call)}  # fmt: skip
