"""kit.folder.layout.RunFolder: the names it gives are the files the kit writes. A real run on 2 CPU
processes (resumed once, so that earlier/ is written too) and the files kit.run.jobs writes hold
nothing RunFolder does not name; its readers read what the recipe wrote."""

from __future__ import annotations

import json
import shutil

from conftest import torchrun

from kit.folder import jsonl, runfolder
from kit.folder.layout import RunFolder
from kit.run import jobs
from kit.run.launch import Run

# --------------------------------------------------------------------------- no launch


def test_paths_and_step_folders(tmp_path):
    f = RunFolder(tmp_path)
    assert f.config == tmp_path / "config.yaml" and f.run_sh == tmp_path / "run.sh"
    assert (f.metrics.name, f.result.name, f.log.name, f.adapter.name) == (
        "metrics.jsonl", "result.json", "run.log", "adapter")
    assert f.step_folder(10) == tmp_path / "checkpoints" / "step-000010"
    for name in (f.step_name(10), f.step_name(10) + ".tmp", f.step_name(1234567)):
        assert RunFolder.STEP_FOLDER.fullmatch(name)
    assert f.node_dir(0) == tmp_path and f.node_dir(2) == tmp_path / "logs" / "node-2"
    # What kit.folder.runfolder decides about is named here, nothing beside it.
    assert {*runfolder.PLUMBING, *runfolder.LIVE, *runfolder.END, runfolder.EARLIER} <= f.names()
    assert set(jobs.FILES) == runfolder.LAUNCHERS == set(RunFolder.LAUNCHERS)


def test_readers(tmp_path):
    f = RunFolder(tmp_path)
    assert f.read_result() is None and f.read_metrics() == []
    f.write_result({"status": "completed", "steps": 2})
    assert f.result.read_text() == json.dumps({"status": "completed", "steps": 2}, indent=2)
    assert f.read_result() == {"status": "completed", "steps": 2}
    for damaged in ("{", "[1, 2]"):  # half-written, or not an object
        f.result.write_text(damaged)
        assert f.read_result() is None
    f.append_metrics({"step": 1})
    with open(f.metrics, "a") as out:
        out.write('{"step": 2')  # a row still being written
    assert f.read_metrics() == [{"step": 1}] == jsonl.read(f.metrics)


def test_jobs_write_only_named_files(tmp_path):
    folder = jobs.write("tiny-cpu", nnodes=2, nproc_per_node=1, out=tmp_path / "job")
    assert {p.name for p in folder.iterdir()} == {
        RunFolder.CONFIG, RunFolder.RUN_SH, RunFolder.LOGS, *RunFolder.LAUNCHERS}


# --------------------------------------------------------------------------- a real run


def test_every_file_a_run_writes_is_named(tiny_run, tmp_path):
    """The shared 4-step run (checkpoints at 2 and 4), copied and continued to step 6: the resume
    keeps what it replaces in earlier/. Every name at the top is RunFolder's."""
    out = tmp_path / "run"
    shutil.copytree(tiny_run, out)
    torchrun(out, "training.steps=6", "training.eval_every=0", "checkpointing.save_every=2",
             "checkpointing.keep_last=0", "training.resume=auto")
    f = RunFolder(out)
    present = {p.name for p in out.iterdir()}
    assert present <= f.names(), present - f.names()
    for path in (f.config, f.run_sh, f.pid, f.exit_code, f.log, f.metrics, f.result, f.probe):
        assert path.is_file(), path
    for path in (f.logs, f.adapter, f.checkpoints, f.earlier):
        assert path.is_dir(), path
    assert not f.stop_requested.exists() and f.exit_code.read_text().strip() == "0"
    assert "Loading weights" not in f.log.read_text()  # no library bar per rank in run.log

    steps = sorted(p.name for p in f.checkpoints.iterdir())
    assert steps == [f.step_name(s) for s in (2, 4, 6)]
    assert all((f.step_folder(s) / RunFolder.ADAPTER).is_dir() for s in (2, 4, 6))
    (kept,) = f.earlier.iterdir()  # what the resume replaced: the run's end, the copy's record
    moved = {p.name for p in kept.iterdir()} - {"why.txt"}
    assert set(runfolder.END) <= moved <= f.names(), moved

    run = Run(out)
    assert f.read_result() == run.result() and f.read_result()["status"] == "completed"
    assert f.read_result()["steps"] == 6
    assert f.read_metrics() == run.metrics()
    assert [r["step"] for r in f.read_metrics() if r["split"] == "train"] == list(range(1, 7))
