"""The notebooks: committed without outputs, run headless with injected parameters (papermill),
and re-run against their few stored deterministic outputs (nbval --nbval-lax)."""

from __future__ import annotations

import ast
import json
import re
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest
from conftest import ROOT

from kit.run import tour

ALL = tour.notebooks()
# The stage notebooks whose checked cells (tagged nbval-check-output and keep_output) are compared
# with a fresh run of their defaults. 07, 08, 10 and 11 run in their modules' tests
# (test_launch, test_checkpoint, test_jobs, test_doctor); 05a's two torchrun launches and its
# checked cell are test_plain_recipe's (CI time: not the same two runs twice); 00a's fine-tune is
# test_whole_game's.
ELSEWHERE = {"00a-whole-game", "05a-plain-recipe"}
STAGES = ["00b-primer-ranks-and-collectives", "00c-setup-and-hardware", "01-memory-budget",
          "02-quantize-nf4", "03-lora-adapters", "04-fsdp-sharding", "05-order-of-operations",
          "06-attention-and-checkpointing", "09-benchmarks"]  # fmt: skip


# CI time: notebook 06's recompute sweep with two of its four settings (one torchrun each): the
# one that recomputes nothing and the selective one. The test below checks what the sweep ran
# (recompute_sweep's own test, test_attention's, is `-m full`: the same two runs again).
SWEEP = ["training.recompute.enabled=false", "training.recompute.keeps=matmuls"]
FEWER = {"06-attention-and-checkpointing": {"recompute_settings": SWEEP}}
# papermill's injection end to end on a stage notebook, with values a GPU run would change
# (another model, one process): notebook 00c-setup's checked cells do not read them, so its one
# run carries them (CI time: not a second run of the notebook).
INJECTED = {"00c-setup-and-hardware": {"model": "kit:tiny-qwen2", "nproc": 1}}


def stage(name: str) -> Path:
    return ROOT / "notebooks" / f"{name}.ipynb"


def code_cells(path: Path):
    return [c for c in nbformat.read(str(path), as_version=4).cells if c.cell_type == "code"]


def texts(path: Path) -> str:
    out = []
    for cell in code_cells(path):
        for o in cell.outputs:
            out.append(o.get("text", "") or json.dumps(o.get("data", {}).get("text/plain", "")))
    return "".join(out)


def test_stage_notebooks_exist():
    assert [p.stem for p in ALL if (p.stem[:2] <= "06" or p.stem[:2] == "09")
            and p.stem not in ELSEWHERE] == list(STAGES)


@pytest.mark.parametrize("path", ALL, ids=lambda p: p.stem)
def test_committed_without_outputs_unless_tagged_keep_output(path):
    assert tour.stored_outputs(path) == [], (
        f"{path.name}: cells {tour.stored_outputs(path)} carry outputs; clear them "
        f"(python -m kit strip {path.relative_to(ROOT)}) or tag the cell {tour.KEEP_OUTPUT!r}"
    )


@pytest.mark.parametrize("path", ALL, ids=lambda p: p.stem)
def test_notebook_shape(path):
    """House style, every notebook: bootstrap, kit import, one literal parameters cell, short
    cells, and checked cells that nbval can compare (stored output + execution count)."""
    cells = code_cells(path)
    assert cells[0].source.startswith("from kit.lab.course import begin; begin()")
    assert "from kit" in cells[1].source
    params = tour.parameters_of(path)  # raises unless literals only
    assert params and "parameters" in cells[2].metadata.get("tags", [])
    checked = [c for c in cells if tour.CHECK_OUTPUT in c.metadata.get("tags", [])]
    assert not any("NBVAL_CHECK_OUTPUT" in c.source for c in cells)  # the tag, out of sight
    assert len(checked) >= 1 or path.stem not in STAGES  # the ones nbval re-runs check something
    for c in checked:
        assert "keep_output" in c.metadata.get("tags", []) and c.outputs and c.execution_count
    for c in cells[1:]:
        assert len(c.source.splitlines()) <= 15, c.source
        ast.parse(c.source)  # no magics: every cell is plain Python
    # nbformat 4.5 cells carry an id (without one nbformat warns, and will refuse the file).
    raw = json.loads(path.read_text())
    assert all("id" in c for c in raw["cells"]), path.name


def outputs_of_checked_cells(path: Path) -> dict[str, str]:
    """Source -> text output of each cell nbval compares (tagged nbval-check-output)."""
    found = {}
    for cell in code_cells(path):
        if tour.CHECK_OUTPUT in cell.metadata.get("tags", []):
            found[cell.source] = "".join(
                o.get("text", "") or o.get("data", {}).get("text/plain", "") for o in cell.outputs)
    return found


@pytest.mark.parametrize("path", ALL, ids=lambda p: p.stem)
def test_every_parameter_reaches_the_code(path):
    """A parameter papermill injects is read by a later cell (an unused one would be injected
    into nothing): statically, so that each notebook runs once in CI."""
    cells = code_cells(path)
    at = next(i for i, c in enumerate(cells) if "parameters" in c.metadata.get("tags", []))
    later = "\n".join(c.source for c in cells[at + 1:])
    read = {n.id for n in ast.walk(ast.parse(later)) if isinstance(n, ast.Name)}
    assert set(tour.parameters_of(path)) <= read, set(tour.parameters_of(path)) - read


@pytest.mark.slow
@pytest.mark.parametrize("name", STAGES)
def test_runs_once_and_reproduces_its_checked_outputs(name, tmp_path, request):
    """One headless run of the defaults (papermill, as `python -m kit tour` runs it) proves the
    notebook runs and that its checked cells reproduce what is stored (what `pytest --nbval-lax`
    compares): run once, not twice. Notebook 09's run is conftest.notebook_09, whose bench
    test_bench.py reads too (its checked cells read recorded GPU runs, not the bench it runs).
    Notebook 06 runs fewer settings (FEWER), notebook 00c-setup two injected values (INJECTED)."""
    if name == "09-benchmarks":
        _, outcome = request.getfixturevalue("notebook_09")
    else:
        declared = tour.parameters_of(stage(name))
        parameters = {"out_dir": str(tmp_path / "launch")} if "out_dir" in declared else {}
        parameters.update({**FEWER.get(name, {}), **INJECTED.get(name, {})})
        outcome = tour.run(stage(name), tmp_path / f"{name}.ipynb", parameters)
    assert outcome.ok, outcome.error
    stored, got = outputs_of_checked_cells(stage(name)), outputs_of_checked_cells(outcome.output)
    assert stored and got == stored
    if name in INJECTED:  # the injected values reached the cells that read them
        executed = texts(outcome.output)
        assert "kit:tiny-qwen2:" in executed and "nproc=1" in executed
    if name == "06-attention-and-checkpointing":
        sweep_ran_each_setting(texts(outcome.output), tmp_path / "launch")


def sweep_ran_each_setting(printed: str, out: Path) -> None:
    """Notebook 06's recompute sweep (kit.lab.recompute_sweep, one torchrun per setting):
    recomputing changes what is kept, not what is computed, so the final losses match; each
    setting's run folder holds the config it ran with."""
    from kit.lab import recompute_sweep

    for setting in SWEEP:
        assert re.search(rf"{re.escape(setting)} +peak ", printed), printed  # none failed
        config = (out / recompute_sweep.folder_name(setting) / "config.yaml").read_text()
        assert "recompute:" in config and (out / recompute_sweep.folder_name(setting)
                                           / "metrics.jsonl").is_file()
    same = re.search(r"final loss the same in every setting: (True|False) \[(.*)\]", printed)
    losses = [float(x) for x in same[2].split(",")]
    assert len(losses) == 2 and losses[0] == pytest.approx(losses[1], rel=1e-5), same[0]


def test_nbval_reads_the_checked_cells_the_same_way(tmp_path):
    """The comparison above is nbval's: a committed notebook whose checked output is altered
    fails `pytest --nbval-lax` (on a one-cell notebook, in seconds)."""
    cell = nbformat.v4.new_code_cell("print(6 * 7)", execution_count=1)
    cell.metadata["tags"] = [tour.CHECK_OUTPUT]
    cell.outputs = [nbformat.v4.new_output("stream", name="stdout", text="41\n")]
    nb = nbformat.v4.new_notebook(cells=[cell])
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nbformat.write(nb, str(tmp_path / "bad.ipynb"))
    proc = subprocess.run([sys.executable, "-m", "pytest", "--nbval-lax", "-q", "-p",
                           "no:cacheprovider", str(tmp_path / "bad.ipynb")],
                          cwd=tmp_path, capture_output=True, text=True, timeout=300)  # fmt: skip
    assert proc.returncode == 1 and "Cell outputs differ" in proc.stdout
    assert outputs_of_checked_cells(tmp_path / "bad.ipynb") == {cell.source: "41\n"}


def write_notebook(path: Path, source: str, parameters: str = "x = 1") -> None:
    cells = [nbformat.v4.new_code_cell(parameters), nbformat.v4.new_code_cell(source)]
    cells[0].metadata["tags"] = ["parameters"]
    nb = nbformat.v4.new_notebook(cells=cells)
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nbformat.write(nb, str(path))


@pytest.mark.slow
def test_tour_runs_in_order_injects_and_fails_loudly(tmp_path):
    books = tmp_path / "books"
    books.mkdir()
    write_notebook(books / "00-ok.ipynb", "assert x == 5, x\nprint('seen', x)")
    write_notebook(books / "01-broken.ipynb", "raise RuntimeError('boom')", "y = 2")
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "kit", "tour", "--notebooks", str(books), "--out", str(out)]
    proc = subprocess.run([*cmd, "-p", "x", "5"], cwd=ROOT, capture_output=True, text=True,
                          timeout=600)  # fmt: skip
    lines = [line for line in proc.stdout.splitlines() if line.strip()]
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert lines[0].startswith("ok") and "00-ok.ipynb" in lines[0]
    assert lines[1].startswith("FAILED") and "01-broken.ipynb" in lines[1] and "boom" in lines[1]
    assert lines[2] == "1/2 notebooks ran in " + lines[2].split(" ran in ")[1]
    assert "seen 5" in texts(out / "00-ok.ipynb")  # injected, not the default x = 1
    unknown = subprocess.run([*cmd, "-p", "nope", "1"], cwd=ROOT, capture_output=True, text=True,
                             timeout=120)  # fmt: skip
    assert unknown.returncode == 2 and "unknown parameter(s) ['nope']" in unknown.stderr


def test_strip_clears_outputs_but_keeps_checked_cells(tmp_path):
    path = tmp_path / "00-x.ipynb"
    write_notebook(path, "print(2)")
    nb = nbformat.read(str(path), as_version=4)
    for i, cell in enumerate(nb.cells):
        cell.outputs = [nbformat.v4.new_output("stream", name="stdout", text=f"{i}\n")]
        cell.execution_count = i + 1
    nb.cells[1].metadata["tags"] = [tour.KEEP_OUTPUT]
    nbformat.write(nb, str(path))
    assert tour.stored_outputs(path) == [0]
    proc = subprocess.run([sys.executable, "-m", "kit", "strip", str(path)], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert proc.returncode == 0 and "1 cell(s) cleared" in proc.stdout
    assert tour.stored_outputs(path) == []
    kept = nbformat.read(str(path), as_version=4).cells[1]
    assert kept.outputs[0]["text"] == "1\n" and kept.execution_count == 2


def test_keep_records_only_the_checked_cells_of_an_executed_copy(tmp_path):
    """python -m kit keep: the executed copy's outputs land in the cells tagged keep_output and
    nowhere else; a second call changes nothing."""
    checked = nbformat.v4.new_code_cell("print(6 * 7)")
    checked.metadata["tags"] = [tour.CHECK_OUTPUT, tour.KEEP_OUTPUT]
    plain = nbformat.v4.new_code_cell("print('not kept')")
    committed = tmp_path / "nb.ipynb"
    nbformat.write(nbformat.v4.new_notebook(cells=[checked, plain]), str(committed))
    ran = nbformat.read(str(committed), as_version=4)
    for i, cell in enumerate(ran.cells):
        cell.outputs = [nbformat.v4.new_output("stream", name="stdout", text=f"out {i}\n")]
        cell.execution_count = i + 1
    nbformat.write(ran, str(tmp_path / "ran.ipynb"))
    proc = subprocess.run([sys.executable, "-m", "kit", "keep", str(committed),
                           str(tmp_path / "ran.ipynb")], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)  # fmt: skip
    assert proc.returncode == 0 and "1 checked cell(s) recorded" in proc.stdout, proc.stderr
    assert outputs_of_checked_cells(committed) == {checked.source: "out 0\n"}
    assert tour.stored_outputs(committed) == []  # the plain cell stays clear
    assert tour.keep_outputs(committed, tmp_path / "ran.ipynb") == 0


def test_keep_joins_one_cells_stream_chunks(tmp_path):
    """A kernel may flush one cell's prints in two chunks: the kept cell holds them as one output
    (as Jupyter shows them), so its shape does not change from run to run."""
    cell = nbformat.v4.new_code_cell("print(1); print(2)")
    cell.metadata["tags"] = [tour.CHECK_OUTPUT, tour.KEEP_OUTPUT]
    committed = tmp_path / "nb.ipynb"
    nbformat.write(nbformat.v4.new_notebook(cells=[cell]), str(committed))
    ran = nbformat.read(str(committed), as_version=4)
    ran.cells[0].outputs = [nbformat.v4.new_output("stream", name="stdout", text=t)
                            for t in ("1\n", "2\n")] + [
        nbformat.v4.new_output("stream", name="stderr", text="warn\n")]
    nbformat.write(ran, str(tmp_path / "ran.ipynb"))
    assert tour.keep_outputs(committed, tmp_path / "ran.ipynb") == 1
    kept = nbformat.read(str(committed), as_version=4).cells[0].outputs
    assert [(o["name"], o["text"]) for o in kept] == [("stdout", "1\n2\n"), ("stderr", "warn\n")]
    assert tour.keep_outputs(committed, tmp_path / "ran.ipynb") == 0
