"""unsloth as a bench baseline (kit.bench.unsloth): where it cannot run, one line before any
process starts; where it can, its case's processes see its own folder of packages first. It
trains on a CUDA GPU only: its rows come from the device (benchmarks/records/)."""

from __future__ import annotations

import pytest
import yaml

from kit.bench import runner, unsloth
from kit.bench.matrix import load_matrix


def _matrix(tmp_path, device: str, **case) -> dict:
    path = tmp_path / "m.yaml"
    path.write_text(yaml.safe_dump({
        "model": "kit:tiny-llama", "seq_len": 64, "nproc": 1, "device": device,
        "cases": [{"name": "uns", "recipe": "unsloth", "role": "unsloth", "batches": [2, 4],
                   **case}]}))
    return load_matrix(path)


def test_on_a_cpu_matrix_the_unsloth_case_is_skipped_in_one_line(tmp_path):
    m = _matrix(tmp_path, "cpu")
    assert runner.skipped(m, m["cases"][0]) == (
        "unsloth trains on a CUDA GPU only; this matrix runs on cpu")


def test_unsloth_runs_on_one_process_only(tmp_path):
    m = _matrix(tmp_path, "cuda", nproc=2)
    why = unsloth.unavailable(__import__("torch").device("cuda"), 2)
    assert why == "unsloth is measured on one process; this case runs 2"
    assert runner.skipped(m, m["cases"][0])  # a line either way (no GPU here, or two processes)


def test_without_its_folder_the_line_says_how_to_get_it(tmp_path, monkeypatch):
    import torch

    monkeypatch.delenv(unsloth.PATH_VARIABLE, raising=False)
    why = unsloth.unavailable(torch.device("cuda"), 1)
    assert why.startswith("unsloth is not installed apart (KIT_UNSLOTH_PATH names no folder")
    assert "benchmarks/tools/fetch_unsloth_wheels.sh" in why
    monkeypatch.setenv(unsloth.PATH_VARIABLE, str(tmp_path))  # a folder without unsloth in it
    assert unsloth.unavailable(torch.device("cuda"), 1) == why
    (tmp_path / "unsloth").mkdir()
    (tmp_path / "unsloth" / "__init__.py").write_text("")
    assert unsloth.unavailable(torch.device("cuda"), 1) is None


def test_its_processes_get_its_folder_first_and_no_hub(tmp_path, monkeypatch):
    monkeypatch.setenv(unsloth.PATH_VARIABLE, str(tmp_path))
    monkeypatch.setenv("PYTHONPATH", "/repo")
    env = runner.case_env({"recipe": "unsloth"})
    assert env["PYTHONPATH"].split(":") == [str(tmp_path), "/repo"]
    assert env["HF_HUB_OFFLINE"] == "1"
    assert "PYTHONPATH" not in runner.case_env({"recipe": "kit"})  # the kit's own packages


def test_only_the_kit_plans_its_batch(tmp_path):
    with pytest.raises(ValueError, match=r"cases\.uns\.batches: \['auto'\] is not allowed for "
                                         r"recipe 'unsloth'"):
        _matrix(tmp_path, "cuda", batches=["auto"])
