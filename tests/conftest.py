"""Shared test helpers: real torchrun launches of the recipe on 2 CPU processes (gloo)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "kit" / "configs" / "tiny-cpu.yaml"


@pytest.fixture(scope="session", autouse=True)
def kit_home(tmp_path_factory):
    """Kit-built models go to one folder per test session (built once, shared by all tests)."""
    home = os.environ.get("KIT_HOME") or str(tmp_path_factory.mktemp("kit_home"))
    os.environ["KIT_HOME"] = home
    return Path(home)


@pytest.fixture(scope="session", autouse=True)
def notebook_kernel():
    """Notebooks run on this environment's kernel (setup.sh installs it into the environment's
    prefix), as kit.run.tour runs them, even where a user-global python3 kernel points elsewhere."""
    from kit.run import tour

    with tour.this_environments_kernel():
        yield


TORCHRUN_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


@pytest.fixture(autouse=True)
def torchrun_variables_stay_as_they_were():
    """kit.recipe.dist.init sets torchrun's variables when it forms a group of one inside pytest; no test
    hands them on (a later child process would inherit RANK and a port still in use)."""
    before = {k: os.environ.get(k) for k in TORCHRUN_VARIABLES}
    yield
    for k, v in before.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


def alive(pid: int) -> bool:
    """A process that exists and is not a zombie."""
    import psutil

    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


class Finished:
    """What a test reads of a finished run: its exit code and its log (every rank's output and
    torchrun's, in one file: stdout and stderr are the same text)."""

    def __init__(self, run):
        self.run, self.returncode = run, run.exit_code
        self.stdout = self.stderr = run.output()


def torchrun(out: Path, *overrides: str, nproc: int = 2, config: Path = TINY, timeout: int = 600,
             check: bool = True) -> Finished:
    """Train with the recipe into `out` through the kit's captured-run helper (kit.run.launch:
    out/config.yaml + out/run.sh under torchrun, as every run); fail with its log."""
    from kit.run.launch import run_to_end

    run = run_to_end(config, [f"run.output_dir={out}", *overrides], nproc=nproc,
                     timeout=timeout, check=False)
    if check and run.exit_code != 0:
        raise AssertionError(f"run failed ({run.exit_code}):\n{run.output()[-8000:]}")
    return Finished(run)


def read_run(out: Path) -> tuple[dict, list[dict]]:
    from kit.folder import jsonl

    return json.loads((out / "result.json").read_text()), jsonl.read(out / "metrics.jsonl")


# A finished 4-step run with checkpoints at steps 2 and 4 (all kept): what tests that read a real
# run folder share, so that CI trains it once (tests that change it copy it first).
TINY_RUN = ["training.steps=4", "training.eval_every=0", "checkpointing.save_every=2",
            "checkpointing.keep_last=0"]


@pytest.fixture
def group_of_one(monkeypatch):
    """A process group of one, on gloo, for rank-side code run inside pytest."""
    for var in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(var, raising=False)
    from kit.recipe import dist as kdist

    env = kdist.init("cpu")
    yield env
    kdist.cleanup()


@pytest.fixture(scope="session")
def tiny_run(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("tiny_run") / "run"
    torchrun(out, *TINY_RUN)
    return out


# Notebook 11 run once under papermill (its defaults; out_dir in a temporary folder): its test in
# test_doctor.py reads what it printed, test_pitfalls.py the reproductions it ran (every pitfall,
# both sides, one torchrun launch: kit.lab.reproduce.read(out=<folder>/runs)), so CI runs that
# launch once.
@pytest.fixture(scope="session")
def notebook_11(tmp_path_factory) -> Path:
    """The folder holding the executed notebook (11.ipynb) and its run folders (runs/)."""
    papermill = pytest.importorskip("papermill")
    folder = tmp_path_factory.mktemp("notebook_11")
    papermill.execute_notebook(
        str(ROOT / "notebooks" / "11-troubleshooting.ipynb"), str(folder / "11.ipynb"),
        parameters={"out_dir": str(folder / "runs"), "cases": []},  # cases=[]: every pitfall
        cwd=str(ROOT / "notebooks"), kernel_name="python3", progress_bar=False,
    )  # fmt: skip
    return folder


# Notebook 09 run once under papermill, its bench on the tiny matrix plus two cases: the peer
# stack, which a CPU matrix skips (liger's kernels are GPU kernels), and the kit's recipe at the
# batch its setup plans (`batches: [auto]`); each case keeps its own batches and the matrix its
# 8 equivalence steps; an out-of-memory injected from batch 4 on every rank (the notebook's
# default). test_notebooks.py checks the notebook's stored outputs, test_bench.py reads its bench
# folder: CI runs the bench once.
TINY_MATRIX = ROOT / "benchmarks" / "matrices" / "bench-tiny.yaml"
PEER_CASE = {"name": "peer", "recipe": "peer", "role": "peer", "label": "peer stack",
             "batches": [1, 2], "options": {"engine": "fsdp1", "attention": "sdpa"}}
AUTO_CASE = {"name": "kit-auto", "recipe": "kit", "role": "planned", "batches": ["auto"],
             "label": "kit, defaults (no flags)"}


@pytest.fixture(scope="session")
def notebook_09(tmp_path_factory):
    """(folder, tour outcome): the executed notebook is folder/09-benchmarks.ipynb, the bench's
    output folder/bench (results.jsonl, table.md, runs/)."""
    import yaml

    from kit.run import tour

    pytest.importorskip("papermill")
    folder = tmp_path_factory.mktemp("notebook_09")
    matrix = yaml.safe_load(TINY_MATRIX.read_text())
    matrix["cases"] += [PEER_CASE, AUTO_CASE]
    (folder / "matrix.yaml").write_text(yaml.safe_dump(matrix, sort_keys=False))
    parameters = {"matrix": str(folder / "matrix.yaml"), "out_dir": str(folder / "bench"),
                  "batches": [], "equivalence_steps": 0, "inject_oom_at": 4}  # fmt: skip
    outcome = tour.run(ROOT / "notebooks" / "09-benchmarks.ipynb", folder / "09-benchmarks.ipynb",
                       parameters)  # fmt: skip
    return folder, outcome


def reload_in_process(script: str, out: Path) -> dict:
    """Run tests/<script> (a plain-PEFT reload that prints JSON) in this process: the trained run
    came from other processes anyway, and a child's start (torch, transformers, peft imported
    again: ~8 s on 2 cores) is what the family matrices would pay per family (CI time)."""
    import contextlib
    import io
    import runpy

    argv, sys.argv = sys.argv, [script, str(out)]
    printed = io.StringIO()
    try:
        with contextlib.redirect_stdout(printed):
            runpy.run_path(str(ROOT / "tests" / script), run_name="__main__")
    finally:
        sys.argv = argv
    return json.loads(printed.getvalue().strip().splitlines()[-1])
