"""The course's start page (notebooks/00-start-here.ipynb, markdown only) against the notebooks it
maps: every stage notebook on the map and nothing else, its study minutes those the notebooks'
text gives, a core path of about two hours, links that lead somewhere, and every GPU-route
parameter one its notebook declares (and the one the maintainers' GPU script injects)."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
from conftest import ROOT

from kit.run import tour

START = ROOT / "notebooks" / tour.START


def start_text() -> str:
    """The start page's markdown, its cells one after the other."""
    return "\n\n".join(c.source for c in tour._read(START).cells)


def section(text: str, heading: str) -> str:
    """The body of the `## heading` section."""
    start = text.index(f"## {heading}\n")
    end = text.find("\n## ", start + 1)
    return text[start:] if end < 0 else text[start:end]


def mapped(text: str) -> list[str]:
    """The notebooks the map links, in its order."""
    return re.findall(r"\]\((\d\d[a-z]?-[\w-]+)\.ipynb\)", section(text, "The map"))


def gpu_parameters(text: str) -> dict[str, list[str]]:
    """Notebook -> the parameter names its GPU-route row sets (`name=value`)."""
    rows = re.findall(r"^\| `(\d\d[a-z]?-[\w-]+)` \| (.*) \|$", section(text, "Two routes"), re.M)
    return {stem: re.findall(r"`(\w+)=", cell) for stem, cell in rows}


def problems(text: str, notebooks: list[Path]) -> list[str]:
    """What the start page says that the notebooks contradict, one line each."""
    have = {p.stem: p for p in notebooks}
    found = mapped(text)
    out = [f"the map misses {s}" for s in have if s not in found]
    out += [f"the map names {s}, which does not exist" for s in found if s not in have]
    if not out and found != [p.stem for p in notebooks]:
        out.append(f"the map's order {found} is not the notebooks' {[p.stem for p in notebooks]}")
    gpu = gpu_parameters(text)
    out += [f"the GPU route misses {s}" for s in have if s not in gpu]
    for stem, names in gpu.items():
        if stem not in have:
            out.append(f"the GPU route names {stem}, which does not exist")
            continue
        declared = tour.parameters_of(have[stem])
        out += [f"{stem}: {n} is not one of its parameters" for n in names if n not in declared]
    return out


def test_start_page_maps_every_notebook_and_their_gpu_parameters():
    assert problems(start_text(), tour.notebooks()) == []


def test_the_check_finds_a_missing_notebook_a_ghost_and_a_wrong_parameter():
    text, books = start_text(), tour.notebooks()
    without = "\n".join(line for line in text.splitlines()
                        if "(03-lora-adapters.ipynb)" not in line)
    assert problems(without, books) == ["the map misses 03-lora-adapters"]
    ghost = text.replace("(12-capstone-real-model.ipynb) |",
                         "(12-capstone-real-model.ipynb) | 1 | x |\n| [`13-x`](13-x.ipynb) |")
    assert problems(ghost, books) == ["the map names 13-x, which does not exist"]
    wrong = text.replace("| `05-order-of-operations` | `nproc=N`,",
                         "| `05-order-of-operations` | `nprocs=N`,")
    assert problems(wrong, books) == ["05-order-of-operations: nprocs is not one of its parameters"]


def gpu_script() -> dict[str, list[str]]:
    """Notebook -> the parameter names benchmarks/tools/gpu_notebooks.sh injects (-p NAME, -y 'NAME:')."""
    found = {}
    text = (ROOT / "benchmarks" / "tools" / "gpu_notebooks.sh").read_text().replace("\\\n", " ")
    for line in text.splitlines():
        m = re.search(r"\bnb (\d\d[a-z]?-[\w-]+) (.*?);;", line)
        if not m:
            continue
        words = shlex.split(m.group(2).replace("$(", "").replace(")", ""), comments=True)
        names = [words[i + 1] for i, w in enumerate(words) if w == "-p"]
        names += [words[i + 1].split(":")[0] for i, w in enumerate(words) if w == "-y"]
        found[m.group(1)] = names
    return found


def test_the_gpu_script_sets_what_the_start_page_documents():
    """The maintainers' GPU runs and the page's GPU route name the same parameters."""
    script = start_text()
    documented, ran = gpu_parameters(script), gpu_script()
    assert ran, "no notebook found in benchmarks/tools/gpu_notebooks.sh"
    for stem, names in ran.items():
        assert sorted(set(names)) == sorted(set(documented[stem])), stem


@pytest.mark.parametrize("path", tour.notebooks(), ids=lambda p: p.stem)
def test_parameters_cell_comments_the_gpu_route(path):
    """Each GPU-route parameter carries a comment naming its "GPU route" value in the parameters
    cell: on its assignment's lines, or on a comment line right below them."""
    import ast

    import nbformat

    cell = next(c for c in nbformat.read(str(path), as_version=4).cells
                if "parameters" in c.metadata.get("tags", []))  # fmt: skip
    lines = cell.source.splitlines()
    commented = set()
    for node in ast.parse(cell.source).body:
        last = node.end_lineno
        while last < len(lines) and lines[last].lstrip().startswith("#"):
            last += 1  # a comment line continuing this assignment's
        if any("GPU route" in line for line in lines[node.lineno - 1:last]):
            commented.add(node.targets[0].id)
    names = gpu_parameters(start_text())[path.stem]
    assert set(names) <= commented, set(names) - commented


def test_the_repo_readme_starts_with_the_start_page():
    head = (ROOT / "README.md").read_text().splitlines()[:6]
    assert any("Start here: notebooks/00-start-here.ipynb" in line for line in head), head
    folder = (ROOT / "notebooks" / "README.md").read_text()  # what GitHub shows in notebooks/
    assert "(00-start-here.ipynb)" in folder and len(folder.splitlines()) <= 15


def test_the_start_page_is_markdown_only_and_its_links_lead_somewhere():
    """It opens rendered in JupyterLab and runs nothing (the tour leaves it out); every relative
    link names a file of the repository."""
    cells = tour._read(START).cells
    assert cells and all(c.cell_type == "markdown" for c in cells)
    assert START not in tour.notebooks()
    links = re.findall(r"\]\(([^)#\s]+)\)", start_text())
    assert links and all((START.parent / link).exists() for link in links if "://" not in link), \
        [link for link in links if not (START.parent / link).exists()]


def study_column(text: str) -> dict[str, int]:
    """Notebook -> the study minutes its row on the map states."""
    rows = re.findall(r"^\| (★?) \| \[`(\d\d[a-z]?-[\w-]+)`\]\([^)]+\) \| (\d+) \|",
                      section(text, "The map"), re.M)
    return {stem: int(minutes) for _, stem, minutes in rows}


def test_study_minutes_are_the_notebooks_estimate_and_the_core_path_about_two_hours():
    """The map's study minutes stay near kit.run.tour.study_minutes of each notebook as it is
    (within 5 minutes or a quarter): a notebook that grows or shrinks moves its row. The core
    path (★) is about two hours, as its heading says."""
    text = start_text()
    stated = study_column(text)
    off = {p.stem: (stated.get(p.stem), tour.study_minutes(p)) for p in tour.notebooks()
           if p.stem not in stated
           or abs(stated[p.stem] - tour.study_minutes(p)) > max(5, tour.study_minutes(p) / 4)}
    assert off == {}, f"(stated, estimated) minutes: {off}"
    core = re.findall(r"^\| ★ \| \[`(\d\d[a-z]?-[\w-]+)`\]", section(text, "The map"), re.M)
    assert 90 <= sum(stated[s] for s in core) <= 150, core
    assert "about 2 hours" in section(text, "The core path: about 2 hours")


SECTION_REF = re.compile(r"(?:[Nn]otebook (\d\d[a-z]?)[,']?s?\s+)?\b[Ss]ection (\d+)\b")


def dangling_sections(notebooks: list[Path]) -> list[str]:
    """Every "section N" / "notebook NN, section N" in a notebook's markdown whose target notebook
    has no heading "## N · ...": one line each."""
    import nbformat

    cells = {p.stem.split("-")[0]: [c for c in nbformat.read(str(p), as_version=4).cells
                                    if c.cell_type == "markdown"] for p in notebooks}  # fmt: skip
    headings = {nn: {m.group(1) for c in cs for m in re.finditer(r"^## (\d+) ·", c.source, re.M)}
                for nn, cs in cells.items()}  # fmt: skip
    out = []
    for nn, cs in cells.items():
        for i, c in enumerate(cs):
            for m in SECTION_REF.finditer(c.source):
                target = m.group(1) or nn
                if m.group(2) not in headings.get(target, set()):
                    out.append(f"notebook {nn}, markdown cell {i}: {m.group(0)!r} names no "
                               f"section of notebook {target}")
    return out


def test_every_section_a_notebook_points_to_exists():
    assert dangling_sections(tour.notebooks()) == []


def test_a_section_reference_to_nowhere_is_found(tmp_path):
    import nbformat

    nb = nbformat.v4.new_notebook(cells=[
        nbformat.v4.new_markdown_cell("## 1 · One\n\nSee section 1, then section 2."),
        nbformat.v4.new_markdown_cell("As notebook 98, section 1 shows; notebook 98 section 3."),
    ])
    nbformat.write(nb, tmp_path / "99-a.ipynb")
    nbformat.write(nbformat.v4.new_notebook(cells=[nbformat.v4.new_markdown_cell(
        "## 1 · Only")]), tmp_path / "98-b.ipynb")
    found = dangling_sections(sorted(tmp_path.glob("*.ipynb")))
    assert found == ["notebook 99, markdown cell 0: 'section 2' names no section of notebook 99",
                     "notebook 99, markdown cell 1: 'notebook 98 section 3' names no section "
                     "of notebook 98"]


def test_papermill_reads_every_parameter_the_notebooks_declare():
    """papermill's own reading of each parameters cell (what `papermill --help-notebook` lists
    and what `-p` is checked against) finds every name the cell assigns. papermill skips any line
    holding two `=`, so a comment such as `# scale = alpha / r` hides its parameter ("Passed
    unknown parameter" at every run). Only a value that itself holds `=` (06's list of config
    overrides, `key=value` strings) may stay hidden: -p and -y still set it."""
    from papermill.translators import PythonTranslator

    hidden = {}
    for path in tour.notebooks():
        cell = next(c for c in tour._read(path).cells if "parameters" in c.metadata.get("tags", []))
        read = {p.name for p in PythonTranslator.inspect({"source": cell.source})}
        values = tour.parameters_of(path)
        if missing := sorted(n for n in set(values) - read if "=" not in repr(values[n])):
            hidden[path.stem] = missing
    assert hidden == {}


@pytest.mark.parametrize("name, most", [("01-memory-budget", 1800), ("09-benchmarks", 1500)])
def test_the_distilled_lessons_stay_within_their_words(name, most):
    """Notebooks 01 and 09 are lessons, not records: their markdown (words split on whitespace,
    the frame included) stays under the length they were distilled to."""
    import nbformat

    nb = nbformat.read(ROOT / "notebooks" / f"{name}.ipynb", as_version=4)
    words = sum(len(c.source.split()) for c in nb.cells if c.cell_type == "markdown")
    assert words < most, f"{name}: {words} words of markdown, expected under {most}"
