"""Checkpoints are data, not code (issue 57, item 2): whoever can write a checkpoint folder (and so
its manifest) cannot make a resume run anything. A crafted pickle in each file a resume reads is
refused in one line naming that file, and the code in it never runs; an earlier kit's checkpoint
(trainer.pt, rng-rank{r}.pt, full.pt) still resumes, exactly.

In process: real checkpoints written by save_training_state (a PEFT adapter on one Linear, DDP on a
gloo group of one) for both formats. Under torchrun (3 launches): the tiny recipe's own checkpoint,
an earlier kit's copy of it resumed to the same losses, and a crafted DCP metadata file refused."""

from __future__ import annotations

import json
import pickle
import random
import shutil
from collections import OrderedDict
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import read_run, torchrun

from kit.config import Config
from kit.folder import manifest
from kit.recipe import checkpoint, trainer_state, verify

CONFIG = Config().to_dict()


class Payload:
    """Unpickled, it creates `marker`: what a crafted checkpoint file would do with a shell."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return exec, (f"open({self.marker!r}, 'w').close()",)


class Batches:
    """The recipe's data position, as far as a checkpoint sees it."""

    def __init__(self):
        self.state = {"epoch": 0, "index": 0, "samples": 0}

    def state_dict(self):
        return dict(self.state)

    def load_state_dict(self, state):
        self.state = dict(state)


class Trainer:
    """One Linear with a LoRA adapter, DDP-wrapped, an AdamW step taken: what save_training_state
    and load_training_state are handed by kit.train."""

    def __init__(self, env, seed: int = 0):
        from peft import LoraConfig, get_peft_model
        from torch.nn.parallel import DistributedDataParallel
        from transformers import get_scheduler

        torch.manual_seed(0)  # the frozen base, which a checkpoint does not hold, is the same
        base = torch.nn.Sequential(OrderedDict(lin=torch.nn.Linear(8, 8)))
        peft = get_peft_model(base, LoraConfig(r=2, target_modules=["lin"], lora_dropout=0.1))
        torch.manual_seed(seed)
        self.layout = checkpoint.AdapterLayout(peft)
        self.model = DistributedDataParallel(peft)
        self.optimizer = torch.optim.AdamW([p for p in peft.parameters() if p.requires_grad])
        self.scheduler = get_scheduler("cosine", self.optimizer, num_warmup_steps=2,
                                       num_training_steps=10)
        self.batches, self.env = Batches(), env

    def step(self) -> float:
        self.model.train()
        loss = self.model(torch.randn(4, 8)).pow(2).mean()  # dropout draws from the RNG
        loss.backward()
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad()
        self.batches.state["samples"] += 4
        return loss.item()

    def save(self, out: Path, fmt: str, step: int = 3) -> Path:
        from kit.recipe.engines import ENGINES

        return checkpoint.save_training_state(
            wrapped=self.model, engine=ENGINES["ddp"], optimizer=self.optimizer,
            scheduler=self.scheduler, batches=self.batches, step=step, env=self.env, fmt=fmt,
            output_dir=out, layout=self.layout, config=CONFIG)

    def load(self, folder: Path) -> int:
        return checkpoint.load_training_state(
            folder, wrapped=self.model, optimizer=self.optimizer, scheduler=self.scheduler,
            batches=self.batches, env=self.env)


def next_draws(trainer: Trainer) -> list:
    """What the run does next: a training step (its loss: weights, optimizer, dropout) and a draw
    from every generator."""
    return [trainer.step(), trainer.step(), random.random(), float(np.random.rand()),
            torch.rand(3).tolist(), trainer.scheduler.get_last_lr(), trainer.batches.state]


def saved(env, out: Path, fmt: str) -> tuple[Path, list]:
    """A checkpoint after three steps, and what the run did right after saving it."""
    trainer = Trainer(env)
    for _ in range(3):
        trainer.step()
    folder = trainer.save(out, fmt)
    return folder, next_draws(trainer)


def as_an_earlier_kit_wrote_it(folder: Path) -> None:
    """Rewrite a checkpoint in the earlier kit's files (torch.save pickles, as kit/recipe/
    checkpoint.py wrote them up to issue 57), with its manifest, as that kit left it."""
    trainer = checkpoint.read_trainer(folder)
    if trainer["format"] == "full":
        torch.save(trainer_state.read(folder, "full"), folder / "full.pt")
    for rng in folder.glob("rng-rank*.json"):
        state = trainer_state.read(folder, rng.stem)
        torch.save({k: state[k] for k in ("torch", "python", "cuda") if k in state},
                   folder / f"{rng.stem}.pt")
    torch.save(trainer, folder / "trainer.pt")
    for path in [*folder.glob("*.json"), *folder.glob("*.safetensors")]:
        if path.name != manifest.MARKER:
            path.unlink()
    rewrite_manifest(folder)


def rewrite_manifest(folder: Path) -> None:
    """What whoever changed a checkpoint can do: make its manifest match again."""
    info = manifest.read(folder)
    manifest.write(folder, info["config"], info["step"], info["world_size"],
                   {"format": info["format"]})


def plant(folder: Path, rel: str, marker: Path, trainer: Trainer) -> Path:
    """A crafted pickle in folder/rel, the manifest rewritten to match."""
    path = folder / rel
    if rel.endswith(".distcp"):  # a value inside a real shard: DCP saves it with torch.save
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_model_state_dict,
            get_optimizer_state_dict,
        )

        options = StateDictOptions(ignore_frozen_params=True)
        state = {"model": get_model_state_dict(trainer.model, options=options),
                 "optim": get_optimizer_state_dict(trainer.model, trainer.optimizer,
                                                   options=options)}
        state["optim"]["param_groups"][0]["lr"] = Payload(marker)
        shutil.rmtree(folder / "dcp")
        dcp.save(state, checkpoint_id=str(folder / "dcp"))
    elif rel.endswith(".pt"):
        torch.save({"step": Payload(marker), "format": "full", "world_size": 1}, path)
    else:
        path.write_bytes(pickle.dumps(Payload(marker)))
    rewrite_manifest(folder)
    return path


def refused_without_running(trainer: Trainer, folder: Path, path: Path, marker: Path) -> str:
    assert checkpoint.find_resume(str(folder), folder.parent.parent, CONFIG, 1) == (folder, [])
    with pytest.raises(checkpoint.CheckpointError) as raised:
        trainer.load(folder)
    said = str(raised.value)
    assert said.startswith(f"{path}: ") and "\n" not in said, said
    assert "training.resume=PATH" in said and "weights_only=False" not in said
    assert not marker.exists()
    return said


# --------------------------------------------------------------------------- in process

FILES = {"sharded": ["trainer.json", "rng-rank0.json", "rng-rank0.safetensors", "dcp/.metadata",
                     "dcp/__0_0.distcp"],
         "full": ["trainer.json", "rng-rank0.json", "rng-rank0.safetensors", "full.json",
                  "full.safetensors"]}
EARLIER = {"sharded": ["trainer.pt", "rng-rank0.pt", "dcp/.metadata", "dcp/__0_0.distcp"],
           "full": ["trainer.pt", "rng-rank0.pt", "full.pt"]}


@pytest.mark.parametrize("fmt", ["sharded", "full"])
def test_a_checkpoint_is_json_safetensors_and_dcp_and_resumes_exactly(group_of_one, tmp_path,
                                                                      fmt):
    folder, after = saved(group_of_one, tmp_path, fmt)
    files = sorted(manifest.read(folder)["files"])
    assert [f for f in files if not f.startswith(("adapter/", "dcp/"))] == sorted(
        FILES[fmt][:3] + FILES[fmt][3:] * (fmt == "full"))
    assert not [f for f in files if f.endswith(".pt")]
    assert verify.verify_checkpoint(folder, CONFIG, 1)["files"] == len(files)
    assert json.loads((folder / "trainer.json").read_text())["state"]["step"] == 3
    other = Trainer(group_of_one, seed=1)  # other weights, other generators' states
    random.seed(1), np.random.seed(1)
    assert other.load(folder) == 3
    assert next_draws(other) == after


@pytest.mark.parametrize("fmt", ["sharded", "full"])
def test_an_earlier_kits_checkpoint_resumes_exactly(group_of_one, tmp_path, fmt):
    folder, after = saved(group_of_one, tmp_path, fmt)
    as_an_earlier_kit_wrote_it(folder)
    assert sorted(p.name for p in folder.glob("*.pt")) == sorted(
        Path(f).name for f in EARLIER[fmt] if f.endswith(".pt"))
    other = Trainer(group_of_one, seed=1)
    assert other.load(folder) == 3
    draws = next_draws(other)
    del draws[3], after[3]  # the earlier kit kept no NumPy state
    assert draws == after


@pytest.mark.parametrize("fmt, rel", [(fmt, rel) for fmt in FILES for rel in FILES[fmt]] + [
    (fmt, rel) for fmt in EARLIER for rel in EARLIER[fmt] if rel.endswith(".pt")])
def test_a_crafted_pickle_in_any_file_a_resume_reads_runs_nothing(group_of_one, tmp_path, fmt,
                                                                  rel):
    folder, _ = saved(group_of_one, tmp_path, fmt)
    if rel.endswith(".pt"):
        as_an_earlier_kit_wrote_it(folder)
    marker, trainer = tmp_path / "ran", Trainer(group_of_one, seed=1)
    path = plant(folder, rel, marker, trainer)
    said = refused_without_running(trainer, folder, path, marker)
    if rel.endswith((".pt", ".distcp", ".metadata")):  # a pickle, read by an allow-list
        assert ": refused: " in said and "exec" in said, said


# --------------------------------------------------------------------------- the recipe, torchrun

ARGS = ["model.dtype=float32", "quantization.method=none", "training.steps=8",  # exact on CPU
        "training.eval_every=0", "checkpointing.save_every=4", "checkpointing.keep_last=0"]


@pytest.fixture(scope="module")
def straight(tmp_path_factory) -> Path:
    """The tiny recipe on 2 ranks (FSDP2, sharded checkpoints at steps 4 and 8), never stopped."""
    out = tmp_path_factory.mktemp("trust") / "straight"
    torchrun(out, *ARGS)
    return out


def step4_copy(straight: Path, to: Path) -> Path:
    folder = to / "step-000004"
    shutil.copytree(straight / "checkpoints" / "step-000004", folder)
    return folder


def train_losses(out: Path, after: int) -> list[tuple[int, float]]:
    return [(m["step"], m["loss"]) for m in read_run(out)[1] if m["split"] == "train"
            and m["step"] > after]


@pytest.mark.full  # CI time: test_an_earlier_kits_checkpoint_resumes_exactly reads both formats as the earlier kit wrote them and resumes exactly, in process; notebook 08's test resumes the recipe's own under torchrun
def test_the_recipe_resumes_an_earlier_kits_checkpoint_exactly(straight, tmp_path):
    """The recipe's own checkpoint holds no pickle and verifies; rewritten as the earlier kit wrote
    it (trainer.pt, rng-rank{r}.pt), a run resumed from it repeats steps 5-8 bit for bit."""
    own = straight / "checkpoints" / "step-000004"
    files = manifest.read(own)["files"]
    assert {"trainer.json", "rng-rank0.json", "rng-rank1.safetensors",
            "dcp/.metadata"} <= set(files)
    assert not [f for f in files if f.endswith(".pt")]
    assert verify.verify_checkpoint(own)["files"] == len(files)
    folder = step4_copy(straight, tmp_path)
    as_an_earlier_kit_wrote_it(folder)
    assert {"trainer.pt", "rng-rank0.pt", "rng-rank1.pt"} <= set(manifest.read(folder)["files"])
    out = tmp_path / "resumed"
    run = torchrun(out, *ARGS, f"training.resume={folder}")
    assert f"resumed from {folder} at step 4" in run.stdout
    assert train_losses(out, 4) == train_losses(straight, 4) and len(train_losses(out, 4)) == 4
    assert read_run(out)[0]["lora_checksums"] == read_run(straight)[0]["lora_checksums"]


@pytest.mark.slow
def test_the_recipe_refuses_crafted_dcp_metadata_and_runs_nothing(straight, tmp_path):
    """DCP unpickles its .metadata: a crafted one, its manifest made to match, ends the run in one
    line naming the file, before any step, and its code never runs."""
    folder = step4_copy(straight, tmp_path)
    marker = tmp_path / "ran"
    (folder / "dcp" / ".metadata").write_bytes(pickle.dumps(Payload(marker)))
    rewrite_manifest(folder)
    out = tmp_path / "crafted"
    run = torchrun(out, *ARGS, f"training.resume={folder}", check=False)
    assert run.returncode != 0 and not marker.exists()
    ranks = [line for line in run.stdout.splitlines() if line.startswith("[default")]
    said = [line for line in ranks if line.endswith(
        f"CheckpointError: {folder / 'dcp' / '.metadata'}: refused: builtins.exec is not part of "
        "a checkpoint's metadata, which could run code; it was not loaded: resume from another "
        "checkpoint (training.resume=PATH) or start the run afresh")]
    assert len(said) == 2, run.stdout[-3000:]  # one line from each rank
    assert "Traceback" not in "\n".join(ranks), run.stdout[-3000:]  # (torchrun's own follows)
    assert not (out / "metrics.jsonl").is_file() or not train_losses(out, 0)
