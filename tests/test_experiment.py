"""The experiment harness (kit.bench.experiment), for real under torchrun with 2 CPU processes:
one complete JSON row per case and rank, a case that raises recorded on every rank while the next
case still runs, and the process group destroyed at the end, after a failure too."""

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

SCRIPT = textwrap.dedent('''
    import json, os, sys
    from pathlib import Path

    import torch
    import torch.distributed as dist

    from kit.bench import experiment


    def fine(case):
        return {"world": case.env.world_size, "index": case.index}


    def boom(case):
        case.notes["before"] = "noted"
        raise ValueError(f"on purpose on rank {case.env.rank}\\nsecond line")


    def summed(case):
        t = torch.ones(1)
        dist.all_reduce(t)  # the group still works after a case raised
        return {"sum": t.item()}


    EXPERIMENT = experiment.Experiment(
        prog="probe", cases={"fine": fine, "boom": boom, "summed": summed},
        row_path=lambda out, name, rank: out / name / f"rank{rank}.json",
        failures=os.environ["FAILURES"])
    try:
        code = experiment.main(EXPERIMENT)
    finally:
        Path(sys.argv[2], f"after{os.environ['RANK']}.json").write_text(
            json.dumps({"initialized": dist.is_initialized()}))
    sys.exit(code)
''')


def _launch(tmp_path, failures: str, *cases: str) -> subprocess.CompletedProcess:
    script = tmp_path / "probe.py"
    script.write_text(SCRIPT)
    out = tmp_path / failures
    out.mkdir()
    config = ROOT / "kit" / "configs" / "tiny-cpu.yaml"
    return subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
         str(script), str(config), str(out), *cases, "training.device=cpu"],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
        env={**__import__("os").environ, "FAILURES": failures, "OMP_NUM_THREADS": "1"})


@pytest.mark.slow
def test_rows_per_case_and_rank_a_failure_recorded(tmp_path):
    done = _launch(tmp_path, "record")
    assert done.returncode == 0, done.stderr[-3000:]
    out = tmp_path / "record"
    for rank in (0, 1):
        fine = json.loads((out / "fine" / f"rank{rank}.json").read_text())
        assert fine == {"case": "fine", "rank": rank, "ok": True, "error": "", "traceback": "",
                        "world": 2, "index": 0}
        boom = json.loads((out / "boom" / f"rank{rank}.json").read_text())
        assert boom["ok"] is False and boom["rank"] == rank and boom["before"] == "noted"
        assert boom["error"] == f"ValueError: on purpose on rank {rank}"
        assert "Traceback" in boom["traceback"] and "second line" in boom["traceback"]
        summed = json.loads((out / "summed" / f"rank{rank}.json").read_text())
        assert summed["ok"] and summed["sum"] == 2.0  # the next case ran, collectives work
        assert f"[rank {rank}] boom: ValueError: on purpose" in done.stderr
        assert json.loads((out / f"after{rank}.json").read_text()) == {"initialized": False}
    assert not list(out.rglob("*.tmp"))  # rows are written whole, then renamed


@pytest.mark.slow
def test_a_failure_raises_and_the_group_is_destroyed(tmp_path):
    done = _launch(tmp_path, "raise", "fine", "boom", "summed")
    assert done.returncode != 0
    out = tmp_path / "raise"
    assert sorted(p.parent.name for p in out.rglob("rank*.json")) == ["fine", "fine"]
    for rank in (0, 1):
        assert json.loads((out / f"after{rank}.json").read_text()) == {"initialized": False}
    assert "ValueError: on purpose" in done.stderr


def test_the_harness_is_the_only_rank_side_experiment_main():
    """benchmarks/tools/house_count.py's count: no module but the recipe's entries starts a process
    group under `if __name__ == "__main__"`; the experiments are case tables on the harness."""
    import runpy

    count = runpy.run_path(str(ROOT / "benchmarks" / "tools" / "house_count.py"))["count"]
    assert count(ROOT)["rank-side experiment mains"] == []
