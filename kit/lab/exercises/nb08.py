"""Exercises of notebook 08 (checkpoints, resume, merge)."""

from __future__ import annotations

import tempfile
from pathlib import Path

from kit.lab.exercises import Exercise, close_to, one_of


def _resume_step() -> int:
    """Builds the folder the question describes (small files, real manifests) and asks the kit's
    own resume which checkpoint `training.resume=auto` takes."""
    from kit.config import Config
    from kit.folder import manifest
    from kit.recipe import checkpoint

    this_run = Config().to_dict()  # lora.r=8
    other = Config()
    other.lora.r = 16
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp) / "checkpoints"
        for step, config in ((5, this_run), (10, this_run), (15, None), (20, other.to_dict())):
            folder = root / (f"step-{step:06d}" + (".tmp" if config is None else ""))
            (folder / "dcp").mkdir(parents=True)
            (folder / "dcp" / "__0_0.distcp").write_bytes(bytes(range(256)) * 16)
            if config is not None:
                manifest.write(folder, config, step, world_size=2)
        shard = root / "step-000010" / "dcp" / "__0_0.distcp"
        shard.write_bytes(shard.read_bytes()[:2048])  # cut short, as a full disk leaves it
        folder, _ = checkpoint.find_resume("auto", tmp, cfg=this_run, world_size=2)
        return int(folder.name.removeprefix("step-"))


def _samples_seen() -> int:
    """Samples of the epoch's order seen at step 40: 12 steps on 2 processes, then 28 on 1."""
    from kit import ROOT
    from kit.config import load_config

    t = load_config(ROOT / "kit" / "configs" / "tiny-cpu.yaml").training
    per_rank = t.batch_size * t.grad_accum  # rows one process takes per optimizer step
    return 12 * per_rank * 2 + (40 - 12) * per_rank * 1


EXERCISES = [
    Exercise(
        key="08.1",
        question=(
            "A run folder (this run: lora.r=8, 2 ranks) holds checkpoints/step-000005 and "
            "step-000010, both with their COMPLETE.json, but step-000010's shard was cut short by "
            "a full disk; step-000015.tmp (killed while saving); and step-000020, complete and "
            "intact but written by a run with lora.r=16. From which step does "
            "training.resume=auto continue? (the answer: a step number)"),
        check=one_of(5, {
            20: "step-000020 is intact, but the manifest records the config that made it: "
                "lora.r=16 is another adapter shape, so resume skips it.",
            15: "a folder still named .tmp was never renamed: the save did not finish.",
            10: "COMPLETE.json lists every file's size and sha256; a shard cut short no longer "
                "matches them.",
        }, default="take the newest folder that passes every check of section 3: complete "
                   "(no .tmp, a COMPLETE.json), files as the manifest lists them, same config."),
        solution=_resume_step,
        wrong=(20, 15, 10),
    ),
    Exercise(
        key="08.2",
        question=(
            "Section 7 with numbers: tiny-cpu.yaml (training.batch_size=8, grad_accum=1) is "
            "stopped after step 12 on 2 processes, then restarted on 1 process and trained to "
            "step 40. How many samples of the epoch's shuffled order have been seen at step 40? "
            "(the answer: a number of samples)"),
        check=lambda answer: close_to(_samples_seen(), rel=0, hint=(
            "count in two parts: before the stop every optimizer step takes batch_size x "
            "grad_accum rows on each of the 2 processes; after the restart on the 1 that "
            "remains."))(answer),
        solution=_samples_seen,
        wrong=(640, 320, 224),
    ),
]
