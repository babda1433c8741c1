"""Exercises of notebook 08 (checkpoints, resume, merge): which checkpoint resume=auto takes
(08.1) and the data position after a restart on fewer processes (08.2). Hands-on: the overrides
that continue a stopped run (08.3), and which single changes resume accepts (08.4, stretch), each
asked of the kit's own resume (kit.recipe.checkpoint.find_resume) on checkpoint folders with real
manifests, written by the stopped run's config."""

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


# ---- hands-on: continue a stopped run, change one thing ----

# The run of section 2 that stopped: 20 steps planned, a checkpoint every 5, stopped after 10.
STOPPED = ["training.steps=20", "checkpointing.save_every=5", "training.stop_at_step=10"]
CONTINUED = ["training.resume=auto", "training.steps=40", "checkpointing.save_every=10",
             "training.stop_at_step=0"]  # fmt: skip
CHANGES = ("training.steps=40", "training.lr=1e-4", "lora.r=16", "checkpointing.save_every=2",
           "data.max_seq_len=128", "training.seed=1", "training.eval_every=5")  # fmt: skip


def resumes(overrides: list[str]) -> dict:
    """What training.resume does for the stopped run started again with `overrides` added to its
    command: its checkpoints (step-000005, step-000010, with manifests written by the stopped
    run's config, 2 ranks) are asked to kit.recipe.checkpoint.find_resume with the new config.
    {"config": the new Config, "resumes_from": a step or None, "notes": why checkpoints were
    skipped}; a ConfigError is raised as load_config raises it."""
    from kit import ROOT
    from kit.config import load_config
    from kit.folder import manifest
    from kit.recipe import checkpoint

    base = ROOT / "kit" / "configs" / "tiny-cpu.yaml"
    made, cfg = load_config(base, STOPPED), load_config(base, STOPPED + list(overrides))
    with tempfile.TemporaryDirectory() as tmp:
        for step in (5, 10):
            folder = Path(tmp) / "checkpoints" / f"step-{step:06d}"
            (folder / "dcp").mkdir(parents=True)
            (folder / "dcp" / "__0_0.distcp").write_bytes(bytes(range(256)) * 4)
            manifest.write(folder, made.to_dict(), step, world_size=2)
        folder, notes = checkpoint.find_resume(cfg.training.resume, tmp, cfg=cfg, world_size=2)
        notes = [n.replace(f"{Path(tmp) / 'checkpoints'}/", "") for n in notes]  # no temp paths
    step = int(folder.name.removeprefix("step-")) if folder else None
    return {"config": cfg, "resumes_from": step, "notes": notes}


def _check_continue(overrides) -> str | None:
    from kit.config import ConfigError

    if not isinstance(overrides, (list, tuple)) or not all(isinstance(o, str) for o in overrides):
        return "continue_with is a list of 'key=value' strings"
    try:
        found = resumes(list(overrides))
    except ConfigError as e:
        return f"the kit refused them: {str(e).splitlines()[0]}"
    t, c = found["config"].training, found["config"].checkpointing
    if not t.resume:
        return ("nothing asks to resume (training.resume is empty): this start would train "
                "from step 0 again")
    if found["resumes_from"] is None:
        why = found["notes"][0] if found["notes"] else "no checkpoint passed its checks"
        return (f"resume would skip every checkpoint: {why}. The manifest records the fields "
                "that shape the run (kit.folder.manifest.RESUME_FIELDS): change one and it is "
                "another run")
    if t.steps != 40:
        return f"it resumes, then trains to step {t.steps}: training.steps is where a run ends"
    if t.stop_at_step and t.stop_at_step < t.steps:
        return (f"training.stop_at_step is still {t.stop_at_step}, from the first command: the "
                "continued run would stop there again (0: never)")
    if c.save_every != 10:
        return f"checkpointing.save_every is {c.save_every}: the question asks for one every 10 steps"
    return None


def accepted() -> dict[str, bool]:
    """For each change of CHANGES alone: does resume=auto still take step-000010?"""
    return {change: resumes([change, "training.resume=auto"])["resumes_from"] == 10
            for change in CHANGES}  # fmt: skip


def _check_predictions(answer) -> str | None:
    if not isinstance(answer, dict) or set(answer) != set(CHANGES):
        return f"predictions is a dict with one True or False for each of {list(CHANGES)}"
    unset = [k for k, v in answer.items() if not isinstance(v, bool)]
    if unset:
        return f"{unset[0]}: predict True (resume takes step-000010) or False (it skips it)"
    truth = accepted()
    wrong = [k for k in CHANGES if answer[k] != truth[k]]
    if not wrong:
        return None
    first = wrong[0]
    if truth[first]:
        return (f"{len(wrong)} of {len(CHANGES)} wrong; the first, {first}: resume takes "
                "step-000010 (it is not one of the fields the manifest compares). "
                "exercises.nb08.resumes([...]) asks the kit for any change")
    note = resumes([first, "training.resume=auto"])["notes"]
    return (f"{len(wrong)} of {len(CHANGES)} wrong; the first, {first}: resume skips the "
            f"checkpoints ({note[0] if note else 'no checkpoint passed'})")


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
    Exercise(
        key="08.3",
        question=("Hands-on, quick: the run that stopped after step 10 (20 steps planned, a "
                  "checkpoint every 5: exercises.nb08.STOPPED) is started again with your "
                  "overrides added to its command. Write continue_with so that it resumes from "
                  "step 10 and trains to step 40, with a checkpoint every 10 steps. The check asks "
                  "the kit's resume, on checkpoints whose manifests the stopped run wrote."),
        check=_check_continue,
        solution=lambda: list(CONTINUED),
        wrong=(["training.steps=40", "checkpointing.save_every=10"],
               CONTINUED[:3], [*CONTINUED, "training.lr=1e-4"], []),
        hands_on=True,
        given=[],
    ),
    Exercise(
        key="08.4",
        question=("Hands-on, stretch: for each single change of exercises.nb08.CHANGES added to "
                  "the stopped run's command with training.resume=auto, predict whether resume "
                  "still takes step-000010 (True) or skips it (False). "
                  "exercises.nb08.resumes([...]) asks the kit, once you have predicted."),
        check=_check_predictions,
        solution=accepted,
        wrong=(dict.fromkeys(CHANGES, True), dict.fromkeys(CHANGES, False),
               dict.fromkeys(CHANGES)),
        hands_on=True,
        given=dict.fromkeys(CHANGES),
    ),
]
