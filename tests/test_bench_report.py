"""kit.bench.report: the tables and plot of a recorded run, rendered without torch."""

from __future__ import annotations

import subprocess
import sys

from conftest import ROOT

from kit.bench import report as bench_report
from kit.bench.matrix import load_matrix
from kit.folder import jsonl

RECORDED = ROOT / "benchmarks" / "results" / "bench-8b-2xh200-run4.jsonl"
MATRIX = ROOT / "benchmarks" / "matrices" / "bench-8b.yaml"


def test_recorded_run_renders_the_numbers_its_results_file_cites():
    """benchmarks/results/bench-8b-2xh200-run4.md quotes these from the same rows."""
    rows, matrix = jsonl.read(RECORDED), load_matrix(MATRIX)
    table = bench_report.render(rows, matrix)
    assert "| 24 | 7,142 (4, 22.8%) | 10,866 (5, 34.8%) |" in table and "| 1.52x |" in table
    assert "| 1.83x |" in table and "| 1.69x |" in table
    assert "| FSDP + QLoRA + checkpointing (eager) | 24 | 4 | 18.9 | 4,812 | OOM at batch 8 |" in table
    best, largest = bench_report.best_by_case(rows), bench_report.largest_by_case(rows)
    assert best["kit-24-attention"]["batch"] == largest["kit-24-attention"]["batch"] == 5
    assert "article-ddp" not in largest  # OOM at its only batch: nothing fitted
    kit24 = bench_report.fastest(best, matrix, "kit", 24)
    assert kit24["case"] == "kit-24-attention" and bench_report.fastest(best, matrix, "kit", 1) is None


def test_a_run_of_some_cases_shows_only_their_caps():
    """--only (notebook 09's `only`): caps whose cases did not run get no row of dashes."""
    rows, matrix = jsonl.read(RECORDED), load_matrix(MATRIX)
    some = [r for r in rows if r["case"] in ("article-40", "kit-40-matmuls")]
    table = bench_report.render(some, matrix)
    assert "| 40 | 6,686 (8, 21.4%) | 12,208 (4, 39.0%) |" in table and "| 1.83x |" in table
    assert [x for x in table.splitlines() if x.startswith(("| 24 |", "| 80 |"))] == []


def test_plot_writes_a_png_without_pyplot_or_torch(tmp_path):
    """What notebook 09's kernel does with recorded rows: neither torch nor pyplot's global
    state (a notebook's backend stays as it is)."""
    code = ("import sys; from kit.bench import report as bench_report; from kit.folder import jsonl\n"
            f"bench_report.plot(jsonl.read({str(RECORDED)!r}), {str(tmp_path / 'r.png')!r})\n"
            "print(sorted(m for m in ('torch', 'matplotlib.pyplot') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                         timeout=120, check=True).stdout  # fmt: skip
    assert out.strip() == "[]"
    assert (tmp_path / "r.png").stat().st_size > 10_000
