"""The run folder's names: every file the two sides exchange through ``launch/<run>/``, spelled
here once, so the kernel side (kit.run, kit.doctor, kit.bench.runner) and the rank side
(kit.train, kit.recipe) cannot drift apart.

    folder = RunFolder("launch/try1")
    folder.config, folder.run_sh, folder.metrics, folder.result, folder.adapter, folder.log
    folder.read_result()          # result.json's dict, None while there is none (or it is damaged)
    folder.read_metrics()         # metrics.jsonl's complete rows (kit.folder.jsonl)
    folder.step_folder(10)        # checkpoints/step-000010

Imports nothing of the kit but kit.folder.jsonl, and no torch: both sides use it.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from kit.folder import jsonl


class RunFolder:
    """A run folder and the names of its files (the class attributes: plain names, relative)."""

    # In: what a start writes (kit.run.launch.prepare; the ranks write config.yaml again).
    CONFIG = "config.yaml"  # the resolved config: the ranks' only input
    RUN_SH = "run.sh"  # the bash torchrun script that starts the ranks
    START = "start.json"  # the start as checked and planned before any rank (kit.folder.start)
    # Launcher files kit.run.jobs writes beside run.sh: other ways to start the same run.
    LAUNCHERS = ("accelerate.yaml", "job.sbatch", "trainjob.yaml", "pytorchjob.yaml")
    # The running start: run.sh's process, its end, a stop asked for (kit.run.runs.Run).
    PID = "pid"
    EXIT_CODE = "exit_code"
    STOP_REQUESTED = "stop_requested"
    CLAIM = ".claim"  # the start writing the folder now (runfolder.claim), until run.sh runs
    LOG = "run.log"  # every rank's output (lines prefixed [defaultN]:), torchrun's, run.sh's
    LOGS = "logs"  # torchrun's per-rank logs; node N's pid, exit_code and run.log in node-N/
    # Out: what rank 0 writes.
    METRICS = "metrics.jsonl"  # one row per train step and evaluation
    RESULT = "result.json"  # the run's summary, when it ends or stops
    ADAPTER = "adapter"  # the trained PEFT adapter (a checkpoint holds one of the same name)
    PROBE = "probe.pt"  # logits on a fixed batch (checkpointing.save_probe_logits)
    CHECKPOINTS = "checkpoints"  # step-NNNNNN/ each (kit.folder.manifest)
    EARLIER = "earlier"  # what a later start replaced, byte for byte (kit.folder.runfolder)
    TRAINER = "trainer"  # kit.sft.trainer: the Trainer's own output_dir (its checkpoints)
    # run.report_to's trackers (kit.recipe.trackers): TensorBoard's event files, trackio's project.
    TENSORBOARD = "tensorboard"
    TRACKIO = "trackio"
    # A checkpoint's folder: step-N, or step-N.tmp while it is written.
    STEP_FOLDER = re.compile(r"step-(\d+)(\.tmp)?")

    def __init__(self, path: str | Path):
        self.path = Path(path)

    def __repr__(self) -> str:
        return f"RunFolder({str(self.path)!r})"

    @classmethod
    def names(cls) -> set[str]:
        """Every name the folder may hold directly (LAUNCHERS included)."""
        return {cls.CONFIG, cls.RUN_SH, cls.START, *cls.LAUNCHERS, cls.PID, cls.EXIT_CODE, cls.STOP_REQUESTED,
                cls.CLAIM, cls.LOG, cls.LOGS, cls.METRICS, cls.RESULT, cls.ADAPTER, cls.PROBE,
                cls.CHECKPOINTS, cls.EARLIER, cls.TRAINER, cls.TENSORBOARD, cls.TRACKIO}

    @staticmethod
    def step_name(step: int) -> str:
        """The folder name of the checkpoint at `step`: step-000010."""
        return f"step-{step:06d}"

    # ------------------------------------------------------------------ paths
    @property
    def config(self) -> Path:
        return self.path / self.CONFIG

    @property
    def run_sh(self) -> Path:
        return self.path / self.RUN_SH

    @property
    def start(self) -> Path:
        return self.path / self.START

    @property
    def pid(self) -> Path:
        return self.path / self.PID

    @property
    def exit_code(self) -> Path:
        return self.path / self.EXIT_CODE

    @property
    def stop_requested(self) -> Path:
        return self.path / self.STOP_REQUESTED

    @property
    def log(self) -> Path:
        return self.path / self.LOG

    @property
    def logs(self) -> Path:
        return self.path / self.LOGS

    @property
    def metrics(self) -> Path:
        return self.path / self.METRICS

    @property
    def result(self) -> Path:
        return self.path / self.RESULT

    @property
    def adapter(self) -> Path:
        return self.path / self.ADAPTER

    @property
    def probe(self) -> Path:
        return self.path / self.PROBE

    @property
    def checkpoints(self) -> Path:
        return self.path / self.CHECKPOINTS

    @property
    def earlier(self) -> Path:
        return self.path / self.EARLIER

    @property
    def trainer(self) -> Path:
        return self.path / self.TRAINER

    def step_folder(self, step: int) -> Path:
        return self.checkpoints / self.step_name(step)

    def node_dir(self, node: int) -> Path:
        """Where run.sh keeps a node's pid, exit_code and run.log: node 0 in the folder itself,
        node N in logs/node-N/ (nodes may share one folder)."""
        return self.path if node == 0 else self.logs / f"node-{node}"

    # ------------------------------------------------------------------ reading and writing
    def read_result(self) -> dict | None:
        """result.json's dict; None when there is none yet or it is not a JSON object."""
        try:
            result = json.loads(self.result.read_text())
        except (OSError, ValueError):
            return None
        return result if isinstance(result, dict) else None

    def write_result(self, result: dict, indent: int | None = 2) -> None:
        self.result.write_text(json.dumps(result, indent=indent))

    def read_metrics(self, strict: bool = True) -> list[dict]:
        """metrics.jsonl's complete rows (kit.folder.jsonl; strict=False skips damaged lines)."""
        return jsonl.read(self.metrics, strict=strict)

    def append_metrics(self, row: dict) -> None:
        jsonl.append(self.metrics, row)
