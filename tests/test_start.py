"""One start (kit.run.check.check), handed down in start.json (kit.folder.start): a real `kit train`
of 2 processes plans once, reads its data file at most once in each process, and the 10-row
case (data.val_fraction=0.25, training.batch_size=4 on 2 processes: 8 training rows, what the
check used to count as 7 and refuse) trains.

The counts come from the processes themselves: a sitecustomize on PYTHONPATH (Python imports it
at start-up in every process: the door, run.sh's torchrun, each rank) wraps the planner, the
data file's readers and the tokenization, by the names the test imports, and appends one line per
call to a file: the pid, the process's program and what ran. Nothing is replaced or faked.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter
from importlib.util import find_spec
from pathlib import Path

import pytest
from conftest import ROOT

from kit.budget import plan as kplan
from kit.config import load_config
from kit.folder import runfolder, start
from kit.inputs import datafile
from kit.recipe import tokens

SPY = r'''
import importlib.abc, json, os, sys

WATCH, LOG = json.loads(os.environ["KIT_SPY"]), os.environ["KIT_SPY_LOG"]


def note(what):
    with open(LOG, "a") as f:
        f.write(json.dumps({"pid": os.getpid(), "program": sys.argv[0], "what": what}) + "\n")


class Spy(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name not in WATCH:
            return None
        for finder in sys.meta_path:
            spec = None if finder is self else finder.find_spec(name, path, target)
            if spec is not None:
                break
        else:
            return None
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            note(f"import {name}")
            for dotted in WATCH[name]:
                *owner, attr = dotted.split(".")
                holder = getattr(module, owner[0]) if owner else module
                real = getattr(holder, attr)

                def counted(*args, _real=real, _what=f"{name}.{dotted}", **kwargs):
                    note(_what)
                    return _real(*args, **kwargs)

                setattr(holder, attr, counted)

        spec.loader.exec_module = exec_module
        return spec


sys.meta_path.insert(0, Spy())
'''


def ten_rows(tmp_path: Path) -> Path:
    path = tmp_path / "ten.jsonl"
    path.write_text("".join(json.dumps({"text": f"row {i} says {'hello ' * (i + 1)}"}) + "\n"
                            for i in range(10)))
    return path


def test_one_kit_train_plans_once_and_reads_its_data_once_per_process(tmp_path):
    spy, log, out = tmp_path / "spy", tmp_path / "calls.jsonl", tmp_path / "run"
    spy.mkdir()
    (spy / "sitecustomize.py").write_text(SPY)
    # Without datasets (some GPU images) read_rows hands every file to read_rows_stdlib: one read.
    readers = ["read_rows", "read_rows_stdlib"] if find_spec("datasets") else ["read_rows_stdlib"]
    plan, read, tokenize = (f"{kplan.plan.__module__}.plan",
                            [f"{datafile.read_rows.__module__}.{f}" for f in readers],
                            f"{tokens.Tokens.__module__}.Tokens._tokenize")
    watch = {kplan.plan.__module__: ["plan"], datafile.read_rows.__module__:
             ["read_rows", "read_rows_stdlib"], tokens.Tokens.__module__: ["Tokens._tokenize"]}
    env = {**os.environ, "KIT_SPY": json.dumps(watch), "KIT_SPY_LOG": str(log),
           "PYTHONPATH": os.pathsep.join([str(spy), str(ROOT), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run(
        [sys.executable, "-m", "kit", "train", "tiny-cpu", f"data.path={ten_rows(tmp_path)}",
         "data.val_fraction=0.25", "training.batch_size=4", "data.max_seq_len=auto",
         "training.steps=2", "training.eval_every=2", f"run.output_dir={out}", "--nproc", "2"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    # The 10-row case is not refused and trains: 8 training rows, 2 held out, 4 per rank.
    assert "8 training rows (4 per rank)" in proc.stdout and "2 validation rows" in proc.stdout
    result = json.loads((out / "result.json").read_text())
    assert result["status"] == "completed" and result["steps"] == 2 and result["world_size"] == 2
    calls = [json.loads(line) for line in log.read_text().splitlines()]
    door = {c["pid"] for c in calls if c["program"].endswith(os.path.join("kit", "__main__.py"))}
    ranks = {c["pid"] for c in calls if c["program"].endswith(os.path.join("kit", "train.py"))}
    assert len(door) == 1 and len(ranks) == 2, calls  # the spy ran in the door and both ranks
    counts = Counter((c["pid"], c["what"]) for c in calls)
    # One plan per launch: the door's; the ranks read it from start.json.
    assert sum(n for (_, what), n in counts.items() if what == plan) == 1
    assert counts[(next(iter(door)), plan)] == 1
    for pid in door | ranks:  # the data file read and tokenized once in each process
        assert sum(counts[(pid, r)] for r in read) == 1, (pid, calls)
        assert counts[(pid, tokenize)] == 1, (pid, calls)
    handed = json.loads((out / "start.json").read_text())
    assert handed["nproc_per_node"] == 2 and handed["folder"]["start"] == 0
    planned = kplan.Planned.from_json(handed["plan"])
    assert planned.cfg.training.batch_size == 4 and result["plan"] == planned.as_dict()
    assert handed["data"].startswith("data: 8 training rows (4 per rank)")


def test_a_start_is_read_back_only_for_its_own_config_and_processes(tmp_path):
    """start.json round-trips; the ranks take it only for the config and the number of
    processes it was made for (else rank 0 checks and plans for itself), and a restart keeps its
    plan but plans its run folder again."""
    cfg = load_config("tiny-cpu", [f"run.output_dir={tmp_path}"])
    planned = kplan.plan(cfg, kplan.Hardware("cpu", 2), 32)
    begun = start.Start(cfg.to_dict(), 2, 1, runfolder.Decision(0, message="new"),
                        planned.to_json(), "data: 1 row")
    path = begun.write(tmp_path)
    assert start.Start.read(path) == begun
    env = start.environment(tmp_path)
    assert env == {"KIT_CHECK": "0", "KIT_START": str(path)}
    assert start.for_ranks(cfg, 2, env) == begun
    assert start.for_ranks(cfg, 4, env) is None  # another number of processes
    other = load_config("tiny-cpu", [f"run.output_dir={tmp_path}", "training.steps=3"])
    assert start.for_ranks(other, 2, env) is None  # another config
    assert start.for_ranks(cfg, 2, {}) is None  # a bare start names none
    again = start.for_ranks(cfg, 2, {**env, "KIT_RESTART_COUNT": "1"})
    assert again.folder is None and again.plan == begun.plan
    path.write_text("{not json")
    assert start.for_ranks(cfg, 2, env) is None


@pytest.mark.parametrize("here", [False, True], ids=["kernel", "own process"])
def test_every_start_raises_one_error_with_a_line_per_problem(tmp_path, here):
    """A notebook's start (no torch in the kernel) and kit train's (in its own process) refuse
    alike: kit.run.check.Refused, a ConfigError whose lines are one problem each."""
    from kit.config import ConfigError
    from kit.run.check import Refused, check

    cfg = load_config("tiny-cpu", [f"run.output_dir={tmp_path / 'run'}", "training.device=cuda",
                                   "lora.target_modules=[q_proj,v_prj]"])
    with pytest.raises(Refused) as e:
        check(cfg, 2, here=here)
    assert isinstance(e.value, ConfigError) and len(e.value.problems) >= 2
    assert all("\n" not in line for line in e.value.problems)
    assert any("v_prj" in line for line in e.value.problems)
    assert any("training.device" in line for line in e.value.problems)
    assert not (tmp_path / "run").exists()
