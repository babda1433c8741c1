"""start.json: a start as it was checked and planned before any rank, handed to the ranks.

    begun = kit.run.check.check(cfg, nproc_per_node=2)   # builds it (kit train, launch, run.sh)
    begun.write(folder)                  # the run folder's start.json
    begun = for_ranks(cfg, world_size)   # rank 0: the start KIT_START names, if it is this one

Plain JSON, data only: the config as given ("auto" kept, run.output_dir the run folder), the
processes, what the start does to its run folder (kit.folder.runfolder.Decision), the plan of the
values left at auto (kit.budget.plan.Planned.to_json; null where the start could not plan: a
notebook's start with data.max_seq_len=auto, whose kernel tokenizes nothing, leaves it to rank 0)
and the data line a person was shown. Rank 0 reads it instead of checking, planning and reading
the data again, and gives every rank its plan (kit.train).

A start names its file to its ranks in KIT_START (kit train and launch set it for run.sh; run.sh's
check step exports it after writing it). Without it, or with one made for another config or
another number of processes, rank 0 checks and plans for itself, as a bare `torchrun -m
kit.train CONFIG` does. A restart of the same run (kit.folder.runfolder.restart) keeps the start's
plan and plans its run folder again (the folder holds newer checkpoints by then).

Kernel side, no torch: both sides read it (the rank side's plan object is made by kit.recipe).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

from kit.config import Config
from kit.folder import runfolder
from kit.folder.layout import RunFolder

VARIABLE = "KIT_START"  # the start's file, for run.sh and the ranks


@dataclass
class Start:
    config: dict  # the resolved config, as given ("auto" kept)
    nproc_per_node: int
    nnodes: int
    folder: runfolder.Decision | None  # what it does to its run folder; None: plan it again (restart)
    plan: dict | None = None  # kit.budget.plan.Planned.to_json(); None: rank 0 plans
    data: str | None = None  # the data line (kit.recipe.planning.Planning.data_line)
    # What the pre-flight found below an error (kit.doctor), for the one who started it to print.
    findings: list = field(default_factory=list, repr=False, compare=False)

    @property
    def world_size(self) -> int:
        return self.nproc_per_node * self.nnodes

    def to_json(self) -> dict:
        return {"config": self.config, "nproc_per_node": self.nproc_per_node,
                "nnodes": self.nnodes, "folder": self.folder.to_json() if self.folder else None,
                "plan": self.plan, "data": self.data}

    @classmethod
    def from_json(cls, found: dict) -> Start:
        folder = found["folder"]
        return cls(found["config"], found["nproc_per_node"], found["nnodes"],
                   runfolder.Decision.from_json(folder) if folder else None, found["plan"],
                   found["data"])

    def write(self, folder: Path) -> Path:
        """start.json in `folder`, written whole (a rename: a rank reads all of it or none)."""
        path = RunFolder(folder).start
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(self.to_json(), indent=1) + "\n")
        os.replace(tmp, path)
        return path

    @classmethod
    def read(cls, path: Path) -> Start | None:
        try:
            return cls.from_json(json.loads(Path(path).read_text()))
        except (OSError, ValueError, KeyError, TypeError):
            return None


def environment(folder: Path) -> dict:
    """What a start checked here gives run.sh: no check step (it ran here, once) and its file."""
    return {"KIT_CHECK": "0", VARIABLE: str(RunFolder(folder).start)}


def _same(config: dict, cfg: Config) -> bool:
    """The start's config is `cfg` (its run folder compared as the folder it names)."""
    def folder(tree: dict) -> dict:
        run = dict(tree.get("run") or {})
        run["output_dir"] = str(Path(run.get("output_dir") or ".").resolve())
        return {**tree, "run": run}

    return folder(config) == folder(cfg.to_dict())


def for_ranks(cfg: Config, world_size: int, environ=os.environ) -> Start | None:
    """The start KIT_START names when it was made for `cfg` on `world_size` processes, else None
    (rank 0 checks and plans for itself). For a restart of the run its folder is None: rank 0
    plans the folder again (its plan of the values left at auto stands)."""
    path = environ.get(VARIABLE)
    begun = Start.read(Path(path)) if path else None
    if begun is None or begun.world_size != world_size or not _same(begun.config, cfg):
        return None
    if runfolder.restart(environ):
        begun.folder = None
    return begun
