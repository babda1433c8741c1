"""kit.bench.report: the tables and plot of a recorded run, rendered without torch."""

from __future__ import annotations

import subprocess
import sys

from conftest import ROOT

from kit.bench import records
from kit.bench import report as bench_report
from kit.bench.matrix import load_matrix

RECORDED = "2026-11-23-speed-8b-2xh200"  # benchmarks/records/: its rows and its matrix as it ran


def test_recorded_run_renders_the_numbers_its_results_file_cites():
    """The record's report.md quotes these from the same rows."""
    rows, matrix = records.rows(RECORDED), records.matrix(RECORDED)
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
    rows, matrix = records.rows(RECORDED), records.matrix(RECORDED)
    some = [r for r in rows if r["case"] in ("article-40", "kit-40-matmuls")]
    table = bench_report.render(some, matrix)
    assert "| 40 | 6,686 (8, 21.4%) | 12,208 (4, 39.0%) |" in table and "| 1.83x |" in table
    assert [x for x in table.splitlines() if x.startswith(("| 24 |", "| 80 |"))] == []


def test_plot_writes_a_png_without_pyplot_or_torch(tmp_path):
    """What notebook 09's kernel does with recorded rows: neither torch nor pyplot's global
    state (a notebook's backend stays as it is)."""
    code = ("import sys; from kit.bench import records, report as bench_report\n"
            f"bench_report.plot(records.rows({RECORDED!r}), {str(tmp_path / 'r.png')!r})\n"
            "print(sorted(m for m in ('torch', 'matplotlib.pyplot') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                         timeout=120, check=True).stdout  # fmt: skip
    assert out.strip() == "[]"
    assert (tmp_path / "r.png").stat().st_size > 10_000


def _batch(case: str, role: str, cap, batch: int, tps: float, mfu: float) -> dict:
    return {"case": case, "recipe": {"baseline": "article"}.get(role, role), "label": case,
            "role": role, "cap_gib": cap, "kind": "batch", "status": "ok", "batch": batch,
            "seq_len": 2048, "tokens_per_s_gpu": tps, "mfu": mfu, "peak_alloc_gib": 20.0,
            "device": "NVIDIA H100 80GB HBM3", "world": 1, "flops_per_token": 5.0e10}


def test_a_peer_column_shows_the_kits_speed_over_each_baseline(tmp_path):
    """Synthetic rows: at 24 GiB all three ran; at 40 GiB the peer stack was skipped."""
    path = tmp_path / "m.yaml"
    path.write_text("model: kit:llama-8b\nseq_len: 2048\nnproc: 1\ndevice: cuda\ncases:\n"
                    "  - {name: article-24, recipe: article, role: baseline, cap_gib: 24, batches: [4]}\n"
                    "  - {name: peer-24, recipe: peer, role: peer, cap_gib: 24, batches: [8, 10]}\n"
                    "  - {name: kit-24, recipe: kit, role: kit, cap_gib: 24, batches: [auto],\n"
                    "     label: 'kit, defaults (no flags)'}\n"
                    "  - {name: article-40, recipe: article, role: baseline, cap_gib: 40, batches: [8]}\n"
                    "  - {name: peer-40, recipe: peer, role: peer, cap_gib: 40, batches: [12]}\n"
                    "  - {name: kit-40, recipe: kit, role: kit, cap_gib: 40, batches: [auto]}\n")
    matrix = load_matrix(path)
    why = "liger-kernel is not installed: pip install --no-deps liger-kernel==0.8.5"
    rows = [_batch("article-24", "baseline", 24, 4, 6000.0, 0.2),
            _batch("peer-24", "peer", 24, 8, 8000.0, 0.25),
            {**_batch("peer-24", "peer", 24, 10, 0, 0), "status": "oom"},
            {**_batch("kit-24", "kit", 24, 6, 12000.0, 0.4), "label": "kit, defaults (no flags)"},
            {**_batch("article-40", "baseline", 40, 8, 6500.0, 0.21), "graph_breaks": 0},
            {"case": "peer-40", "recipe": "peer", "label": "peer-40", "role": "peer",
             "cap_gib": 40, "table": "", "kind": "skipped", "why": why},
            {**_batch("kit-40", "kit", 40, 12, 13000.0, 0.42), "graph_breaks": 64}]
    table = bench_report.render(rows, matrix)
    assert "| article recipe tokens/s/GPU (batch, MFU) | peer stack tokens/s/GPU (batch, MFU) |" in table
    assert ("| 24 | 6,000 (4, 20.0%) | 8,000 (8, 25.0%) | 12,000 (6, 40.0%) | "
            "kit, defaults (no flags) | 2.00x | 1.50x |") in table
    assert "| 40 | 6,500 (8, 21.0%) | skipped | 13,000 (12, 42.0%) | kit-40 | 2.00x | - |" in table
    assert f"\npeer stack: skipped: {why} (peer-40)\n" in table
    assert f"| peer-40 | peer | 40 | - | - | - | skipped: {why} |" in table
    assert "| peer-24 | peer | 24 | - | 8: 8,000 (20.0), 10: OOM | 8,000 | OOM at batch 10 |" in table
    # compiled code that ran in pieces is said beside the case's status (kit.bench.worker's count)
    assert "| 13,000 | ok; 64 graph breaks |" in table and "| 6,500 | ok |" in table
    assert bench_report.fastest(bench_report.best_by_case(rows), matrix, "peer", 24)["batch"] == 8
    bench_report.plot(rows, tmp_path / "p.png")  # a skipped case draws nothing, and no crash


def test_an_old_record_keeps_its_table():
    """A matrix without peer cases: the two-column comparison, its header and ratio as before."""
    table = bench_report.render(records.rows(RECORDED), records.matrix(RECORDED))
    assert ("| cap GiB/GPU | baseline tokens/s/GPU (batch, MFU) | kit best tokens/s/GPU "
            "(batch, MFU) | kit config | speed-up |\n|---|---|---|---|---|\n") in table
    assert "peer" not in table and "skipped" not in table


def test_unsloth_is_a_baseline_column_and_its_skip_is_said(tmp_path):
    """A MoE matrix of the kit and unsloth only: one baseline column, the kit's speed over it, and
    a skipped unsloth case (no CUDA GPU) said in one line and marked in its cap's row."""
    path = tmp_path / "m.yaml"
    path.write_text("model: kit:llama-8b\nseq_len: 2048\nnproc: 1\ndevice: cuda\ncases:\n"
                    "  - {name: uns-none, recipe: unsloth, role: unsloth, batches: [8, 16]}\n"
                    "  - {name: kit-none, recipe: kit, role: kit, batches: [auto]}\n"
                    "  - {name: uns-24, recipe: unsloth, role: unsloth, cap_gib: 24, batches: [8]}\n"
                    "  - {name: kit-24, recipe: kit, role: kit, cap_gib: 24, batches: [auto]}\n")
    matrix = load_matrix(path)
    why = "unsloth trains on a CUDA GPU only; no CUDA GPU here (no nvidia-smi)"
    rows = [_batch("uns-none", "unsloth", None, 8, 20000.0, 0.2),
            {**_batch("uns-none", "unsloth", None, 16, 0, 0), "status": "oom"},
            _batch("kit-none", "kit", None, 6, 26000.0, 0.26),
            {"case": "uns-24", "recipe": "unsloth", "label": "uns-24", "role": "unsloth",
             "cap_gib": 24, "table": "", "kind": "skipped", "why": why},
            _batch("kit-24", "kit", 24, 10, 21000.0, 0.21)]
    table = bench_report.render(rows, matrix)
    assert "### Kit vs unsloth, per memory cap (best batch of each)" in table
    assert ("| cap GiB/GPU | unsloth tokens/s/GPU (batch, MFU) | kit best tokens/s/GPU "
            "(batch, MFU) | kit config | over unsloth |\n|---|---|---|---|---|\n") in table
    assert "| 24 | skipped | 21,000 (10, 21.0%) | kit-24 | - |" in table
    assert "| - | 20,000 (8, 20.0%) | 26,000 (6, 26.0%) | kit-none | 1.30x |" in table
    assert f"\nunsloth: skipped: {why} (uns-24)\n" in table
    assert "article" not in table.split("### Every case")[0]


def test_a_scaling_run_names_every_number_of_gpus_it_ran_on():
    """A matrix of one setup on one and two GPUs: the header says both (it said the first row's),
    and the scaling table gives the total against the fewest GPUs."""
    name = "2026-11-29-moe-scaling-gpt-oss-2xh200"
    rows = records.rows(name, "scaling")
    matrix = load_matrix(records.path(name, "moe-30b-a3b-2gpu.yaml"))
    table = bench_report.render(rows, matrix)
    assert table.startswith("Device: NVIDIA H200 x 1 and 2;"), table.splitlines()[0]
    assert "| kit-24 | 2 | 20 | 24,789 | 49,578 | 20.3 | 2.04x | 1.02 |" in table
