"""Shared test helpers: real torchrun launches of the recipe on 2 CPU processes (gloo)."""

from __future__ import annotations

import json
import os
import subprocess
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


def torchrun(out: Path, *overrides: str, nproc: int = 2, config: Path = TINY, timeout: int = 600,
             check: bool = True) -> subprocess.CompletedProcess:
    """Run `torchrun -m kit.train CONFIG run.output_dir=OUT overrides...`; fail with its log."""
    cmd = [
        sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}",
        "--standalone", "-m", "kit.train", str(config), f"run.output_dir={out}", *overrides,
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"torchrun failed ({proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}")
    return proc


def read_run(out: Path) -> tuple[dict, list[dict]]:
    result = json.loads((out / "result.json").read_text())
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return result, metrics
