"""The course's exercises: each notebook's exercise cells name an exercise that exists, every
exercise is asked in its notebook, every notebook has a hands-on exercise, and every solution
passes its own check while the likely wrong answers get a hint (run, not mocked: the solutions
compute with the kit, and a hands-on check runs the learner's code for real, on 2 gloo processes
where it is distributed)."""

from __future__ import annotations

import ast
import linecache
import re

import nbformat
import pytest

from kit.lab import exercises
from kit.lab.exercises.checks import as_given, unwritten
from kit.run import tour

ALL = exercises.registry()
ASKED = re.compile(r'exercises\.check\("(\d\d[a-z]?\.\d)",\s*(\w+)')


def asked_in(path) -> list[tuple[str, str]]:
    """(key, the name the check cell passes) for every check cell of the notebook."""
    nb = nbformat.read(str(path), as_version=4)
    return [m for c in nb.cells if c.cell_type == "code" for m in ASKED.findall(c.source)]


def exercise_cells(path):
    """(key, the name checked, the exercise cell's source) for every check cell."""
    nb = nbformat.read(str(path), as_version=4)
    for i, c in enumerate(nb.cells):
        for key, name in ASKED.findall(c.source) if c.cell_type == "code" else ():
            yield key, name, nb.cells[i - 1].source


def test_every_exercise_is_asked_in_its_notebook_and_every_check_exists():
    """01.x in 01-..., 05a.x in 05a-..., 00.x in 00b-... and 00c-... (one module for both)."""
    asked = [(p.stem.split("-")[0], k) for p in tour.notebooks() for k, _ in asked_in(p)]
    assert all(prefix.startswith(k.split(".")[0]) for prefix, k in asked), asked
    assert {k for _, k in asked} == set(ALL)


def test_every_notebook_has_a_hands_on_exercise_and_at_most_three_questions():
    """One hands-on exercise a notebook (a quick part, and a stretch where it helps), beside the
    questions worth keeping."""
    counts = {}
    for p in tour.notebooks():
        keys = [k for k, _ in asked_in(p)]
        counts[p.stem] = (sum(ALL[k].hands_on for k in keys), sum(not ALL[k].hands_on for k in keys))
    assert all(1 <= hands_on <= 2 and questions <= 3 for hands_on, questions in counts.values()), counts


def defined_by(before: str, key: str) -> dict:
    """What the exercise cell defines, defined as IPython defines a cell (its source kept where
    inspect finds it)."""
    filename = f"<cell {key}>"
    linecache.cache[filename] = (len(before), None, before.splitlines(True), filename)
    scope = {}
    exec(compile(before, filename, "exec"), scope)
    return scope


def test_each_exercise_cell_is_marked_for_the_learner():
    """A question's cell holds `answer = ...`; a hands-on one the function to write (its body
    still the placeholder) or to change (the code the exercise gives), named as the check cell
    passes it and as the solution names it."""
    for p in tour.notebooks():
        for key, name, before in exercise_cells(p):
            ex = ALL[key]
            assert f"# EXERCISE {key}" in before, (p.name, key)
            if not ex.hands_on or name == "answer":
                assert "answer = ..." in before, (p.name, key)
                continue
            defined = [f.name for f in ast.parse(before).body if isinstance(f, ast.FunctionDef)]
            given = defined_by(before, key)[name]
            assert unwritten(given) or as_given(given, ex.given), (p.name, key)
            right = ex.solution()
            if name in defined:
                assert callable(right) and right.__name__ == name, (p.name, key, right)
            else:  # a value to change, such as a list of settings
                assert not callable(right) and ex.given is not None, (p.name, key)


def test_an_unwritten_hands_on_cell_asks_its_question(capsys):
    """The hands-on cells as they stand in the notebooks, checked, say what is asked and run
    nothing."""
    for p in tour.notebooks():
        for key, name, before in exercise_cells(p):
            if not ALL[key].hands_on or name == "answer":
                continue
            exercises.check(key, defined_by(before, key)[name])
            assert capsys.readouterr().out.startswith(f"exercise {key}: not answered yet."), key


@pytest.mark.parametrize("key", sorted(ALL))
def test_the_solution_is_right_and_the_likely_mistakes_get_a_hint(key, capsys):
    ex = ALL[key]
    assert ex.wrong, f"{key}: name at least one likely wrong answer"
    if ex.prepare:  # the solution and the mistakes run together (one child process for all)
        ex.prepare([ex.solution(), *ex.wrong])
    assert ex.check(ex.solution()) is None
    for bad in ex.wrong:
        hint = ex.check(bad)
        assert isinstance(hint, str) and hint, (key, bad)
    exercises.check(key, ...)
    assert "not answered yet" in capsys.readouterr().out
    exercises.check(key, ex.solution())
    assert capsys.readouterr().out == f"exercise {key}: right.\n"
    exercises.check(key, ex.wrong[0])
    assert capsys.readouterr().out.startswith(f"exercise {key}: not yet. Hint: ")


def test_a_stuck_learner_sees_one_way_to_write_a_hands_on_function(capsys):
    """exercises.solution of a hands-on exercise prints the function's source (a value would show
    as <function ...>); of a question it returns the value."""
    assert exercises.solution("00.5") is None
    shown = capsys.readouterr().out
    assert shown.startswith("def best_pair(topo, busy=()):") and "link_between" in shown
    assert exercises.solution("00.7") == 32


def test_unwritten_knows_the_placeholder_from_code():
    def placeholder(t):
        """Docstring."""
        raise NotImplementedError

    def ellipsis(t):
        ...

    def written(t):
        raise NotImplementedError("only for odd t") if t % 2 else None

    def started(t):
        print(t)
        raise NotImplementedError

    assert unwritten(placeholder) and unwritten(ellipsis)
    assert not any(unwritten(f) for f in (written, started, lambda t: t, len, 3, ...))
