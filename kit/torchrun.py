"""Start a kit module under torchrun from the notebook kernel and wait for it.

    proc = torchrun("kit.sharding", "--report", "launch/nb04", nproc=2)

For the short demonstrations of notebooks 01, 04 and 05 (seconds, output captured and shown
afterwards). Full training runs with live progress go through kit/launch.py. Kernel side: the
ranks are separate processes; the kernel creates no process group.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


class TorchrunFailed(RuntimeError):
    """torchrun exited non-zero; the message ends with the tail of its output."""


def torchrun(module: str, *args: str, nproc: int = 2, timeout: int = 900, check: bool = True,
             env: dict | None = None) -> subprocess.CompletedProcess:  # fmt: skip
    """Run `torchrun --standalone --nproc_per_node=NPROC -m MODULE ARGS...` in the checkout."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc_per_node={nproc}", "-m", module, *map(str, args)]  # fmt: skip
    # One thread per rank: the ranks share the machine's cores (and a CPU run's are few).
    env = {"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", **os.environ, **(env or {})}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        lines = (proc.stdout + proc.stderr).splitlines()
        # The ranks' own messages ("[rank N] ..." from the recipe, "[rankN]:" from torch) name
        # the cause; torchrun's closing summary often only says that a rank exited.
        ranks = [line for line in lines if line.startswith("[rank")][-30:]
        tail = "\n".join(ranks + ["..."] + lines[-15:])
        raise TorchrunFailed(f"{' '.join(cmd[2:])} exited with {proc.returncode}:\n{tail}")
    return proc


def run_recipe(out, *overrides: str, nproc: int = 2,
               config: str = "kit/configs/tiny-cpu.yaml") -> tuple[dict, list[dict]]:  # fmt: skip
    """Train with the recipe (kit.train) into folder `out`; return (result.json, metrics rows)."""
    import json

    out = Path(out).resolve()
    torchrun("kit.train", config, f"run.output_dir={out}", *overrides, nproc=nproc)
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return json.loads((out / "result.json").read_text()), metrics
