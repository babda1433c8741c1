"""The course's exercises: each notebook's exercise cells name an exercise that exists, every
exercise is asked in its notebook, and every solution passes its own check while the likely wrong
answers get a hint (run, not mocked: the solutions compute with the kit)."""

from __future__ import annotations

import re

import nbformat
import pytest

from kit.lab import exercises
from kit.run import tour

ALL = exercises.registry()
ASKED = re.compile(r'exercises\.check\("(\d\d\.\d)"')


def asked_in(path) -> list[str]:
    nb = nbformat.read(str(path), as_version=4)
    return [k for c in nb.cells if c.cell_type == "code" for k in ASKED.findall(c.source)]


def test_every_exercise_is_asked_in_its_notebook_and_every_check_exists():
    asked = {p.stem[:2] + ":" + k for p in tour.notebooks() for k in asked_in(p)}
    assert all(k.split(":")[0] == k.split(":")[1][:2] for k in asked), asked  # 01.x in 01-...
    assert {k.split(":")[1] for k in asked} == set(ALL)


def test_every_notebook_asks_two_or_three():
    counts = {p.stem: len(asked_in(p)) for p in tour.notebooks()}
    assert all(2 <= n <= 3 for n in counts.values()), counts


def test_each_exercise_cell_is_marked_for_the_learner():
    for p in tour.notebooks():
        nb = nbformat.read(str(p), as_version=4)
        for i, c in enumerate(nb.cells):
            for key in ASKED.findall(c.source):
                before = nb.cells[i - 1].source
                assert f"# EXERCISE {key}" in before and "answer = ..." in before, (p.name, key)


@pytest.mark.parametrize("key", sorted(ALL))
def test_the_solution_is_right_and_the_likely_mistakes_get_a_hint(key, capsys):
    ex = ALL[key]
    assert ex.check(ex.solution()) is None
    assert ex.wrong, f"{key}: name at least one likely wrong answer"
    for bad in ex.wrong:
        hint = ex.check(bad)
        assert isinstance(hint, str) and hint, (key, bad)
    exercises.check(key, ...)
    assert "not answered yet" in capsys.readouterr().out
    exercises.check(key, ex.solution())
    assert capsys.readouterr().out == f"exercise {key}: right.\n"
    exercises.check(key, ex.wrong[0])
    assert capsys.readouterr().out.startswith(f"exercise {key}: not yet. Hint: ")
