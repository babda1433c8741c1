"""kit.bench for real: one invocation, two recipes each in its own torchrun (2 CPU processes, gloo),
started through kit.run.launch's run folders."""

from __future__ import annotations

import subprocess
import sys

import pytest
import yaml
from conftest import ROOT, TINY_MATRIX

from kit.bench import runner as bench
from kit.bench.report import best_by_case
from kit.config import ConfigError
from kit.folder import jsonl
from kit.run.launch import Run


@pytest.fixture(scope="module")
def tiny_bench(notebook_09):
    """The bench notebook 09 ran (conftest.notebook_09: the tiny matrix, plus a peer case and a
    kit case with `batches: [auto]`, an out-of-memory injected at batch 4 on every rank); what
    the notebook printed of the runner's lines in OUT/stdout.txt."""
    import nbformat

    folder, outcome = notebook_09
    assert outcome.ok, outcome.error
    out = folder / "bench"
    printed = [o.get("text", "") for c in nbformat.read(str(outcome.output), as_version=4).cells
               if c.cell_type == "code" for o in c.outputs if o.get("output_type") == "stream"]
    (out / "stdout.txt").write_text("".join(printed))
    return out, jsonl.read(out / "results.jsonl")


@pytest.mark.slow
def test_a_peer_case_that_cannot_run_is_skipped_in_one_line_and_the_rest_runs(tiny_bench):
    out, rows = tiny_bench
    why = "liger-kernel's kernels are Triton GPU kernels; this matrix runs on cpu"
    said = [ln for ln in (out / "stdout.txt").read_text().splitlines() if ln.startswith("peer:")]
    assert said == [f"peer: skipped: {why}"]
    assert [r for r in rows if r["case"] == "peer"] == [
        {"case": "peer", "recipe": "peer", "label": "peer stack", "role": "peer", "cap_gib": None,
         "table": "", "kind": "skipped", "why": why}]
    assert not (out / "runs" / "peer").exists()  # no process started, no run folder
    assert any(r["kind"] == "done" for r in rows if r["case"] == "kit")
    table = (out / "table.md").read_text()
    row = next(ln for ln in table.splitlines() if ln.startswith("| - |"))  # the cap of no cap
    assert row.split(" | ")[2] == "skipped" and row.endswith("x | - |"), row  # no ratio over peer
    assert f"peer stack: skipped: {why} (peer)" in table
    assert f"| peer stack | peer | - | - | - | - | skipped: {why} |" in table


@pytest.mark.slow
def test_batches_auto_trains_the_batch_the_kit_recipe_planned(tiny_bench):
    _, rows = tiny_bench
    setup = next(r for r in rows if r["case"] == "kit-auto" and r["kind"] == "setup")
    tried = [r for r in rows if r["case"] == "kit-auto" and r["kind"] == "batch"]
    assert isinstance(setup["auto_batch"], int) and setup["auto_batch"] > 0, setup
    assert [r["batch"] for r in tried] == [setup["auto_batch"]]
    assert any(r["kind"] == "done" for r in rows if r["case"] == "kit-auto")


@pytest.mark.slow
def test_each_case_measures_batches_until_one_does_not_fit(tiny_bench):
    _, rows = tiny_bench
    for case in ("article", "kit"):
        batches = [(r["batch"], r["status"]) for r in rows
                   if r["case"] == case and r["kind"] == "batch"]
        # Ascending, an OOM is a result, and the search stops there.
        assert batches == [(1, "ok"), (2, "ok"), (4, "oom")], (case, batches)
        oom = next(r for r in rows if r["case"] == case and r.get("status") == "oom")
        # the whole error line, the step it stopped at and the peak so far: what tracing needs
        assert oom["error"].startswith("injected") and oom["step"] == 0, oom
        assert oom["peak_alloc_gib"] > 0, oom
        ok = [r for r in rows if r["case"] == case and r.get("status") == "ok"]
        assert all(r["tokens_per_s_gpu"] > 0 and r["step_s"] > 0 for r in ok)
        assert all(r["peak_alloc_gib"] > 0 and r["world"] == 2 for r in ok)
        assert all(r["graph_breaks"] == 0 for r in ok)  # counted per batch (uncompiled: none)
        assert any(r["kind"] == "done" for r in rows if r["case"] == case)
        # Loading and sharding alone, and each rank's peak host memory by then.
        setup = next(r for r in rows if r["case"] == case and r["kind"] == "setup")
        assert 0 < setup["load_s"] <= setup["seconds"] + 0.05, setup  # seconds: 0.1 s steps
        assert len(setup["peak_host_mib"]) == 2 and min(setup["peak_host_mib"]) > 100, setup


@pytest.mark.slow
def test_both_recipes_learn_the_same_from_the_same_data(tiny_bench):
    _, rows = tiny_bench
    curves = {r["case"]: r["losses"] for r in rows if r["kind"] == "curve"}
    assert set(curves) == {"article", "kit"}
    a, k = curves["article"], curves["kit"]
    assert len(a) == len(k) == 8
    assert a[-1] < a[0] - 0.1 and k[-1] < k[0] - 0.1  # both learn
    # Same data, same adapter initialisation and dropout masks (kit.bench seeds the article recipe
    # as the kit's recipe seeds itself), same optimizer: the curves differ only by rounding (bf16
    # against fp32 adapters, the loss kernel): measured within 0.001.
    assert max(abs(x - y) for x, y in zip(a, k, strict=True)) < 0.01, (a, k)
    # The tiny matrix trains on the bundled sample text (equivalence.data: sample) and then
    # measures the held-out rows: both adapters learned the same.
    val = {r["case"]: r["val_loss"] for r in rows if r["kind"] == "curve"}
    assert val["article"] < a[0] and abs(val["article"] - val["kit"]) < 0.01, val


@pytest.mark.slow
def test_report_names_the_oom_and_compares_recipes(tiny_bench):
    out, rows = tiny_bench
    table = (out / "table.md").read_text()
    assert "### The article's table" in table and "OOM at batch 4" in table
    assert "### Kit vs the article recipe" in table and "x |" in table
    assert (out / "bench.png").stat().st_size > 10_000
    best = best_by_case(rows)
    assert set(best) == {"article", "kit", "kit-1", "kit-context"}
    assert all(r["batch"] in (1, 2) for r in best.values())


@pytest.mark.slow
def test_a_context_sweep_trains_each_length_and_names_the_longest(tiny_bench):
    out, rows = tiny_bench
    sweep = [r for r in rows if r["case"] == "kit-context" and r["kind"] == "batch"]
    assert [(r["seq_len"], r["batch"], r["status"]) for r in sweep] == [(64, 1, "ok"), (256, 1, "ok")]
    assert sweep[1]["flops_per_token"] > sweep[0]["flops_per_token"]  # attention grows with length
    table = (out / "table.md").read_text()
    assert "### Context: the longest sequence that trains" in table
    line = next(ln for ln in table.splitlines() if ln.startswith("| kit: fsdp2 + fused loss"))
    assert line.endswith("| 256 |")


@pytest.mark.slow
def test_each_case_is_a_run_folder_with_its_config_and_log(tiny_bench):
    out, _ = tiny_bench
    for case in ("article", "kit"):
        run = Run(out / "runs" / case)
        assert run.status == "completed" and run.exit_code == 0
        assert run.config.data.max_seq_len == 64 and run.config.training.device == "cpu"
        assert "kit.bench.worker" in (run.folder / "run.sh").read_text()
        assert (out / "logs" / f"{case}.log").read_text() == run.output()
    # The kit's recipe trains with the case's overrides; the runner's settings underneath.
    kit = Run(out / "runs" / "kit").config
    assert (kit.training.loss, kit.lora.r, kit.training.scheduler) == ("chunked", 16, "constant")


@pytest.mark.slow
def test_a_scaling_case_runs_the_same_setup_on_its_own_processes(tiny_bench):
    out, rows = tiny_bench
    ok = [r for r in rows if r["case"] == "kit-1" and r.get("status") == "ok"]
    assert [(r["batch"], r["world"]) for r in ok] == [(1, 1), (2, 1)]
    # The scaled case's recipe and overrides: the same config but for the processes.
    one, two = Run(out / "runs" / "kit-1").config, Run(out / "runs" / "kit").config
    assert (one.training.loss, one.quantization.method) == (two.training.loss, "nf4")
    best = best_by_case(rows)
    k1, k2 = best["kit-1"], best["kit"]
    row = next(x for x in (out / "table.md").read_text().splitlines() if x.startswith("| kit-1 |"))
    total = k2["tokens_per_s_gpu"] * 2 / k1["tokens_per_s_gpu"]
    assert row.startswith(f"| kit-1 | 1 | {k1['batch']} |"), row
    assert f"| kit | 2 | {k2['batch']} |" in (out / "table.md").read_text()
    assert f"| {total:.2f}x |" in (out / "table.md").read_text()
    # No part in the per-cap comparison of baseline and kit.
    assert bench.load_matrix(TINY_MATRIX)["cases"][2]["role"] == "scaling"


def test_a_bad_scaling_case_is_one_line(tmp_path):
    path = tmp_path / "m.yaml"
    path.write_text("model: kit:tiny-llama\nseq_len: 8\ncases:\n  - {name: a, recipe: kit}\n"
                    "  - {name: b, scales: c, nproc: 1}\n")
    with pytest.raises(ValueError, match=r"^cases\.b\.scales: 'c' is not allowed; expected the "
                                         r"name of a case that scales no other, one of \['a'\]$"):
        bench.load_matrix(path)
    path.write_text("model: kit:tiny-llama\nseq_len: 8\ncases:\n  - {name: a, recipe: kit}\n"
                    "  - {name: b, scales: a, nproc: 0}\n")
    with pytest.raises(ValueError, match=r"^cases\.b\.nproc: 0 is not allowed; expected a "
                                         r"positive whole number"):
        bench.load_matrix(path)


@pytest.mark.slow
def test_a_case_past_its_timeout_is_stopped_and_recorded(tmp_path, monkeypatch):
    """A hang costs one case: its whole process tree is stopped, a failed row names it. A case that
    hangs after its last row (KIT_HANG_AFTER_DONE: a teardown that never ends) is stopped the same
    way, but keeps its measurements: its status says how it ended, not "failed"."""
    matrix = yaml.safe_load(TINY_MATRIX.read_text())
    done = {"name": "kit-done", "recipe": "kit", "role": "tuned", "batches": [1], "nproc": 1,
            "timeout_s": 30, "overrides": ["training.loss=chunked"]}  # ~15 s to its last row
    matrix["cases"] = [{**matrix["cases"][1], "timeout_s": 3, "equivalence": False}, done]
    path = tmp_path / "m.yaml"
    path.write_text(yaml.safe_dump(matrix))
    monkeypatch.setenv("KIT_HANG_AFTER_DONE", "300")
    rows = bench.run(path, tmp_path / "out")
    assert [(r["kind"], r["rc"]) for r in rows if r["kind"] == "failed"] == [("failed", -9)]
    assert [(r["case"], r["rc"]) for r in rows if r["kind"] == "ended"] == [("kit-done", -9)]
    assert [r["status"] for r in rows if r["case"] == "kit-done" and r["kind"] == "batch"] == ["ok"]
    for name in ("kit", "kit-done"):
        assert Run(tmp_path / "out" / "runs" / name).processes() == []
    table = (tmp_path / "out" / "table.md").read_text()
    assert "failed (see logs/kit.log)" in table
    assert "ok; then rc -9 at the timeout, after its last row (see logs/kit-done.log)" in table


def test_bad_recipe_is_one_line(tmp_path):
    path = tmp_path / "m.yaml"
    path.write_text("model: kit:tiny-llama\nseq_len: 8\ncases:\n  - {name: a, recipe: trl}\n")
    with pytest.raises(ValueError, match=r"^cases\.a\.recipe: 'trl' is not allowed; expected "
                                         r"'article', 'kit', 'peer' or 'unsloth'$"):
        bench.load_matrix(path)
    path.write_text("model: kit:tiny-llama\nseq_len: 8\ncases:\n"
                    "  - {name: a, recipe: peer, role: peer, batches: [1, 2]}\n")
    assert bench.load_matrix(path)["cases"][0]["recipe"] == "peer"


def test_batches_auto_is_the_kit_recipes_alone(tmp_path):
    """`batches: [auto]`: the batch the kit's recipe plans in setup; the baselines plan none."""
    path = tmp_path / "m.yaml"
    head = "model: kit:tiny-llama\nseq_len: 8\ncases:\n"
    path.write_text(head + "  - {name: a, recipe: kit, batches: [auto]}\n"
                    "  - {name: b, scales: a, nproc: 1}\n")
    assert [c["batches"] for c in bench.load_matrix(path)["cases"]] == [["auto"], ["auto"]]
    for recipe in ("article", "peer"):
        path.write_text(head + f"  - {{name: a, recipe: {recipe}, batches: [auto]}}\n")
        with pytest.raises(ValueError, match=rf"^cases\.a\.batches: \['auto'\] is not allowed for "
                                             rf"recipe '{recipe}'; expected whole numbers in "
                                             r"ascending order \(only the kit's recipe plans its "
                                             r"own batch\)$"):
            bench.load_matrix(path)
    path.write_text(head + "  - {name: a, recipe: kit, batches: [auto, 8]}\n")
    with pytest.raises(ValueError, match=r"^cases\.a\.batches: \['auto', 8\] is not allowed; "
                                         r"expected \['auto'\] alone"):
        bench.load_matrix(path)


def test_the_peer_stack_says_in_one_line_why_it_cannot_run_without_torch():
    """What the runner asks before starting a peer case (kernel side: no torch)."""
    code = ("import sys; from kit.bench import peer, runner\n"
            "print(peer.unavailable('cpu')); print(peer.unavailable('mps'))\n"
            "import shutil; print(shutil.which('nvidia-smi') is not None or peer.unavailable('cuda'))\n"
            "print(runner.skipped({'device': 'cpu'}, {'recipe': 'peer'}))\n"
            "print(runner.skipped({'device': 'cpu'}, {'recipe': 'article'}))\n"
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                         timeout=120, check=True).stdout.splitlines()
    gpu = "liger-kernel's kernels are Triton GPU kernels"
    assert out == [f"{gpu}; this matrix runs on cpu", f"{gpu}; device 'mps' is not cuda",
                   out[2], f"{gpu}; this matrix runs on cpu", "None", "False"]
    # Asked with the matrix's "cuda" on a machine without a GPU: says so (with one: True).
    assert out[2] in ("True", f"{gpu}; no CUDA GPU here (no nvidia-smi)")


def test_a_bad_equivalence_data_is_one_line(tmp_path):
    matrix = yaml.safe_load(TINY_MATRIX.read_text())
    matrix["equivalence"]["data"] = "wikitext"
    path = tmp_path / "m.yaml"
    path.write_text(yaml.safe_dump(matrix))
    with pytest.raises(ValueError, match=r"^equivalence.data: 'wikitext' is not allowed; expected "
                                         r"'sample' .* or nothing \(synthetic tokens\)$"):
        bench.load_matrix(path)


def test_a_bad_context_sweep_is_one_line(tmp_path):
    path = tmp_path / "m.yaml"
    path.write_text("model: kit:tiny-llama\nseq_len: 8\ncases:\n"
                    "  - {name: a, recipe: kit, seq_lens: [256, 64]}\n")
    with pytest.raises(ValueError, match=r"cases\.a\.seq_lens: \[256, 64\] is not allowed"):
        bench.load_matrix(path)


def test_a_bad_override_stops_the_matrix_before_any_case_runs(tmp_path):
    matrix = yaml.safe_load(TINY_MATRIX.read_text())
    matrix["cases"][1]["overrides"] = ["training.loss=fast"]
    path = tmp_path / "m.yaml"
    path.write_text(yaml.safe_dump(matrix))
    with pytest.raises(ConfigError, match=r"cases\.kit: training\.loss: 'fast'"):
        bench.run(path, tmp_path / "out")
    assert not (tmp_path / "out" / "runs").exists()


def test_a_case_may_bring_its_own_seed(tmp_path):
    """Two seeds of one recipe: the noise a lever's loss difference is held against."""
    matrix = yaml.safe_load(TINY_MATRIX.read_text())
    seeded = {**matrix["cases"][0], "name": "article-seed43", "seed": 43}
    assert bench.case_config(matrix, matrix["cases"][0], tmp_path).training.seed == 42
    assert bench.case_config(matrix, seeded, tmp_path).training.seed == 43


def test_a_kit_case_with_set_batches_is_planned_for_the_largest(tmp_path):
    """The recipe plans recompute and offload for the batch the case runs, not its own choice."""
    m = bench.load_matrix(ROOT / "benchmarks" / "matrices" / "bench-moe-235b-4gpu.yaml")
    assert bench.case_config(m, m["cases"][0], tmp_path).training.batch_size == 2
    swept = {**m["cases"][0], "batches": [2, 8, 4]}
    assert bench.case_config(m, swept, tmp_path).training.batch_size == 8
    own = {**swept, "overrides": ["training.batch_size=4"]}
    assert bench.case_config(m, own, tmp_path).training.batch_size == 4
    auto = {**swept, "batches": ["auto"]}
    assert bench.case_config(m, auto, tmp_path).training.batch_size == "auto"


def test_the_planned_matrix_holds_three_recipes_per_cap(tmp_path):
    m = bench.load_matrix(ROOT / "benchmarks" / "matrices" / "bench-8b-planned.yaml")
    by_cap = {}
    for c in m["cases"]:
        if c["role"] in ("baseline", "peer", "kit"):  # the per-cap comparison's cases
            by_cap.setdefault(c["cap_gib"], []).append((c["recipe"], c["role"]))
        bench.case_config(m, c, tmp_path)  # every case's config loads
    assert by_cap == {cap: [("article", "baseline"), ("peer", "peer"), ("kit", "kit")]
                      for cap in (24, 40, 80)}
    assert all(c["batches"] == ["auto"] and "overrides" not in c
               for c in m["cases"] if c["role"] == "kit")


def test_a_planned_batch_is_not_swept_to_other_lengths(tmp_path):
    """batches: [auto] plans at setup for the matrix's seq_len: a sweep to other lengths is
    refused in one line (it once trained 131,072-token rows at a batch planned for 2,048)."""
    from kit.bench.matrix import load_matrix

    f = tmp_path / "m.yaml"
    f.write_text("model: kit:tiny-llama\nseq_len: 64\ncases:\n"
                 "  - {name: a, recipe: kit, batches: [auto], seq_lens: [128]}\n")
    with pytest.raises(ValueError, match=r"cases\.a\.seq_lens: \[128\] is not allowed with batches "
                                         r"\['auto'\]; expected \[64\]"):
        load_matrix(f)
    f.write_text(f.read_text().replace("[128]", "[64]"))
    assert load_matrix(f)["cases"][0]["seq_lens"] == [64]


def test_a_length_past_the_models_positions_is_one_line(tmp_path):
    """The bench refuses what the recipe refuses: a length (the matrix's, or a sweep's) beyond
    the model's max_position_embeddings (kit:tiny-llama: 512)."""
    from kit.bench.matrix import load_matrix

    path = tmp_path / "m.yaml"
    path.write_text("model: kit:tiny-llama\nseq_len: 64\ncases:\n"
                    "  - {name: long, recipe: kit, batches: [1], seq_lens: [64, 1024]}\n")
    with pytest.raises(ValueError) as e:
        load_matrix(path)
    assert str(e.value) == ("cases.long.seq_lens: 1024 is not allowed; expected at most 512 "
                            "(kit:tiny-llama has max_position_embeddings=512)")
    path.write_text("model: kit:tiny-llama\nseq_len: 512\ncases:\n"
                    "  - {name: ok, recipe: kit, batches: [1], seq_lens: [256, 512]}\n")
    assert load_matrix(path)["cases"][0]["seq_lens"] == [256, 512]
