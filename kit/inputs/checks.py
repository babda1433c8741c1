"""What a config points at, checked in one order from every path: the check step (kit.run.check,
transformers read in a child process) and rank 0 of a start nobody checked (bare torchrun,
python -m kit.train: read in the rank's own process). One function, so both refuse alike.

    check(cfg, read)               # model.name, then what `read` found, the weights, the data
    read(name, trust_remote_code)  # transformers' view of the model (imports torch)
    step(cfg, nproc_per_node, nnodes)  # the whole check step (kit.run.check), in a child process:
                                       # rank 0 of a start nobody checked, before it plans
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

from kit import ROOT
from kit.config import Config, ConfigError
from kit.inputs import datafile, model_folder, sources


def check(cfg: Config, read: Callable[[], dict]) -> None:
    """The model (kit.inputs.sources: where model.name points; kit.inputs.model_folder: its
    config.json, what transformers makes of it, its weights' headers and sizes, its tokenizer)
    and the data, row by row (kit.inputs.datafile). `read` returns what `read` below returns for
    cfg's model (a child process's answer, or this process's own)."""
    sources.check_model(cfg.model.name)
    found = read()
    if found["config"]:
        raise ConfigError(found["config"])
    sources.check_with_model(cfg, found["facts"])  # what the model allows, against the config
    model_folder.check_weights(cfg.model.name)
    if found["tokenizer"]:
        raise ConfigError(found["tokenizer"])
    datafile.check_file(cfg.data, stdlib=True)


def read(name: str, trust_remote_code: bool = False) -> dict:
    """transformers' view of model.name: {"facts": sources.model_facts (None: unreadable),
    "config": a refusal of config.json or None, "tokenizer": a refusal of the tokenizer or None}.
    The refusals are for a local folder only (a kit model is built by the kit; a hub id's cache
    is the hub's). Imports transformers and torch."""
    found = {"facts": None, "config": None, "tokenizer": None}
    if sources.kind(name) == "local":
        path = str(Path(name).expanduser())
        found["config"] = model_folder.config_refusal(name, path, trust_remote_code)
        if found["config"] is None:
            found["tokenizer"] = model_folder.tokenizer_refusal(name, path, trust_remote_code)
    if found["config"] is None:
        found["facts"] = sources.model_facts(name, trust_remote_code)
    return found


# What torchrun gives a rank: the check step's process is none (it forms no group).
RANK_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                  "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID")


def step(cfg: Config, nproc_per_node: int, nnodes: int) -> None:
    """The check step run.sh runs before torchrun (`python -m kit.run.check`, every refusal it
    knows: the config, its inputs, this machine, the run folder), run by rank 0 of a start that
    nobody checked (bare torchrun, python -m kit.train) as run.sh would: in a child process, so
    the rank side imports nothing of the kernel side. Its refusals raise one ConfigError (a line
    each); a finished run (exit 3) and a go (0) return; anything else raises RuntimeError."""
    with tempfile.TemporaryDirectory(prefix="kit-check-") as tmp:
        path = Path(tmp) / "config.yaml"
        path.write_text(cfg.to_yaml())
        env = {k: v for k, v in os.environ.items() if k not in RANK_VARIABLES}
        proc = subprocess.run([sys.executable, "-m", "kit.run.check", str(path), "--nproc",
                               str(nproc_per_node), "--nnodes", str(nnodes), "--refusals-only"],
                              cwd=ROOT, env=env, capture_output=True, text=True)  # fmt: skip
    if proc.returncode in (0, 3):
        return
    lines = [line.removeprefix("ConfigError: ") for line in proc.stderr.splitlines()
             if line.startswith("ConfigError: ")]
    if proc.returncode == 2 and lines:
        raise ConfigError("\n".join(lines))
    raise RuntimeError(f"the check step (python -m kit.run.check) ended with exit code "
                       f"{proc.returncode}:\n{proc.stderr[-4000:]}")
