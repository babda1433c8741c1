"""The cheat-sheet (notebooks/CHEATSHEET.md) against what it points to: every config key it names
is a key of the kit's config schema (and every `key=value` it writes loads), and every "NN §k"
names a section that notebook NN has (found as tests/test_course.py finds them)."""

from __future__ import annotations

import dataclasses
import re
import typing

import nbformat
import pytest
from conftest import ROOT
from test_course import dangling_sections

from kit.config import Config, ConfigError, load_config
from kit.run import tour

SHEET = ROOT / "notebooks" / "CHEATSHEET.md"
GROUPS = "|".join(f.name for f in dataclasses.fields(Config))
KEY = re.compile(rf"`((?:{GROUPS})\.[\w.]+)(=[^`\s]*)?`")
REF = re.compile(r"\b(\d\d) §(\d+)\b")
FILES = {"run.sh", "run.log"}  # a run folder's files: `run.` is also a config group


def schema_keys(cls: type = Config, prefix: str = "") -> set[str]:
    """Every dotted key the config accepts: the fields of its dataclasses, nested ones walked as
    kit.config._build walks them when it validates a YAML or an override."""
    keys, hints = set(), typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(hints[f.name]):
            keys |= schema_keys(hints[f.name], f"{prefix}{f.name}.")
        else:
            keys.add(prefix + f.name)
    return keys


def named_keys(text: str) -> list[tuple[str, str]]:
    """(key, '=value' or '') of every backticked config key in `text`."""
    return [(m.group(1), m.group(2) or "") for m in KEY.finditer(text) if m.group(1) not in FILES]


def references(text: str) -> list[tuple[str, str]]:
    """(notebook number, section number) of every "NN §k"."""
    return REF.findall(text)


def dangling(text: str, tmp_path) -> list[str]:
    """The references of `text` that name no section, through test_course.dangling_sections: the
    references are written as "notebook NN, section k" into a notebook numbered 99 beside the
    course's own."""
    refs = [f"notebook {nn}, section {k}." for nn, k in references(text)]
    probe = tmp_path / "99-cheatsheet.ipynb"
    nbformat.write(nbformat.v4.new_notebook(cells=[nbformat.v4.new_markdown_cell("\n".join(refs))]),
                   probe)
    return dangling_sections([*tour.notebooks(), probe])


def test_the_schema_walk_agrees_with_the_loader():
    """What schema_keys lists, load_config accepts; a key next to them it refuses by name."""
    keys = schema_keys()
    assert {"lora.r", "training.recompute.keeps", "checkpointing.format"} <= keys
    assert "training.recompute" not in keys  # a group, not a key
    load_config(None, ["lora.r=4", "training.recompute.keeps=matmuls"])
    with pytest.raises(ConfigError, match="unknown key"):
        load_config(None, ["lora.rank=4"])


def test_every_config_key_the_sheet_names_exists_and_every_value_loads():
    text = SHEET.read_text()
    named = named_keys(text)
    assert len({k for k, _ in named}) >= 30, "the sheet's config table went missing"
    assert sorted({k for k, _ in named} - schema_keys()) == []
    for key, value in named:
        if value:
            load_config(None, [key + value])  # a misspelt value raises ConfigError


def test_every_section_the_sheet_points_to_exists(tmp_path):
    text = SHEET.read_text()
    assert len(references(text)) >= 50
    assert {nn for nn, _ in references(text)} >= {f"{n:02d}" for n in range(1, 13)}
    assert dangling(text, tmp_path) == []


def test_a_wrong_key_and_a_wrong_section_are_caught(tmp_path):
    assert [k for k, _ in named_keys("`lora.rank=8` and `training.recompute.keeps`")
            if k not in schema_keys()] == ["lora.rank"]
    found = dangling("| x | y | 01 §2, 08 §9 |", tmp_path)
    assert len(found) == 1 and "section 9" in found[0] and "notebook 08" in found[0]
