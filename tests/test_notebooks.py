"""The notebooks: committed without outputs, run headless with injected parameters (papermill),
and re-run against their few stored deterministic outputs (nbval --nbval-lax)."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest
from conftest import ROOT

from kit import tour

ALL = tour.notebooks()
# Notebooks of stages 00-06 and 09 and, for each, parameters that make the papermill run cheaper or
# different from the defaults, plus text its executed copy must then contain (proof the
# injection reached the code).
STAGES = {
    "00-setup-and-hardware": ({"model": "kit:tiny-qwen2", "nproc": 1},
                              ["kit:tiny-qwen2:", "nproc=1"]),
    "01-memory-budget": ({"steps": 2}, ["Llama-3-70B"]),
    "02-quantize-nf4": ({"layer": "model.layers.1.mlp.down_proj"}, ["shape (128, 256)"]),
    "03-lora-adapters": ({"r": 4, "targets": ["q_proj", "v_proj"]}, ["3584"]),
    "04-fsdp-sharding": ({"engines": ["fsdp2"]}, ["fsdp2  layer class"]),
    "05-order-of-operations": ({"reproductions": ["fsdp1_int_storage"]},
                               ["Cannot flatten integer dtype tensors", "observed:     not run"]),
    "06-attention-and-checkpointing": ({"seq_lens": [64, 128],
                                        "implementations": ["sdpa", "sdpa_math", "sdpa_cudnn"],
                                        "recompute_settings": ["training.recompute.enabled=false",
                                                               "training.recompute.every=2"],
                                        "steps": 2},
                                       ["for sequence x2", "sdpa_cudnn         did not run here",
                                        "training.recompute.every=2        peak",
                                        "final loss the same in every setting: True"]),
    "09-benchmarks": ({"only": ["kit"], "batches": [1], "equivalence_steps": 2},
                      ["kit: rc=0", "kit      kit      batches [1]", "(not in only: skipped)"]),
}  # fmt: skip


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
    assert [p.stem for p in ALL if p.stem[:2] <= "06" or p.stem[:2] == "09"] == list(STAGES)


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
    assert "os.chdir" in cells[0].source and "from kit" in cells[1].source
    params = tour.parameters_of(path)  # raises unless literals only
    assert params and "parameters" in cells[2].metadata.get("tags", [])
    checked = [c for c in cells if "# NBVAL_CHECK_OUTPUT" in c.source]
    assert len(checked) >= 1 or path.stem not in STAGES  # the ones nbval re-runs check something
    for c in checked:
        assert "keep_output" in c.metadata.get("tags", []) and c.outputs and c.execution_count
    for c in cells[1:]:
        assert len(c.source.splitlines()) <= 15, c.source
        ast.parse(c.source)  # no magics: every cell is plain Python


@pytest.mark.slow
@pytest.mark.parametrize("name", STAGES)
def test_runs_under_papermill_with_injected_parameters(name, tmp_path):
    parameters, expected = STAGES[name]
    declared = tour.parameters_of(stage(name))
    assert set(parameters) <= set(declared)
    if "out_dir" in declared:
        parameters = {**parameters, "out_dir": str(tmp_path / "launch")}
    outcome = tour.run(stage(name), tmp_path / f"{name}.ipynb", parameters)
    assert outcome.ok, outcome.error
    executed = texts(outcome.output)
    for text in expected:
        assert text in executed, text
    if name == "01-memory-budget":  # the recipe ran with the injected step count
        rows = (tmp_path / "launch" / "metrics.jsonl").read_text().splitlines()
        assert [json.loads(r)["split"] for r in rows] == ["train", "train", "val"]
    if name == "04-fsdp-sharding":
        reports = [p.name for p in (tmp_path / "launch").iterdir() if list(p.glob("rank*.json"))]
        assert reports == ["fsdp2"]
    if name == "06-attention-and-checkpointing":  # one recipe run per injected setting
        assert sorted(p.name for p in (tmp_path / "launch").iterdir()) == [
            "training.recompute.enabled-false", "training.recompute.every-2"]


@pytest.mark.slow
@pytest.mark.parametrize("name", STAGES)
def test_stored_outputs_reproduce_under_nbval(name):
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "--nbval-lax", "-q", "-p", "no:cacheprovider",
         str(stage(name))],
        cwd=ROOT, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-2000:]
    assert " passed" in proc.stdout and "failed" not in proc.stdout


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
