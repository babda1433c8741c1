"""Saving what was trained: the LoRA adapter in PEFT format, checked after writing.

One path for every engine: `get_model_state_dict` (torch.distributed.checkpoint.state_dict) gathers
the trainable parameters with clean names from FSDP2, FSDP1 or DDP alike. PEFT decides which of
them form the adapter and under which file keys by walking the module tree, and FSDP1 renames that
tree (`_fsdp_wrapped_module.` inside every wrapped layer): asked after wrapping, PEFT finds no
adapter keys and `save_pretrained(state_dict=...)` writes a file with no tensors, without an error
(the first article's recipe does exactly that). So the kit asks PEFT for the key mapping once,
before wrapping, writes the file in PEFT's format, reads it back and compares it with the adapter
the model really has, or fails loudly.

Training checkpoints (save every N steps, resume) are the second half. Their manifest, checked
before any resume trusts a folder, is `kit.folder.manifest` (torch-free); what verifies a saved
adapter or checkpoint is kit.recipe.verify; reading back, merging and the command line
`kit checkpoints` are kit.inference.merge.
"""

from __future__ import annotations

import copy
import errno
import hashlib
import os
import shutil
from pathlib import Path

import torch

from kit.folder import manifest
from kit.folder.layout import RunFolder
from kit.folder.manifest import CheckpointError, first_line, scan
from kit.recipe import trainer_state
from kit.recipe.verify import verify_adapter


class AdapterLayout:
    """Which model parameters form the adapter, their file keys and shapes. Build it from the PEFT
    model before sharding: PEFT's own key selection needs the unwrapped module tree."""

    def __init__(self, peft_model, adapter_name: str = "default", base: str | None = None):
        """base: the base model as adapter_config.json names it (the config's model.name: a hub id,
        a folder as given, a kit: model), instead of the folder it was loaded from, which for a
        kit: model is under this machine's KIT_HOME. The live model keeps its folder: PEFT reads
        it (a local config.json, else the hub) when it selects the adapter's keys."""
        from peft import get_peft_model_state_dict

        named = [(n, p) for n, p in peft_model.named_parameters() if p.requires_grad]
        # Hand PEFT a state dict of indices: what it returns tells which key each parameter gets.
        probe = {n: torch.tensor(i) for i, (n, _) in enumerate(named)}
        saved = get_peft_model_state_dict(peft_model, state_dict=probe, adapter_name=adapter_name)
        self.file_key = {named[int(v)][0]: k for k, v in saved.items()}
        self.shapes = {self.file_key[n]: tuple(p.shape) for n, p in named if n in self.file_key}
        self.config = copy.deepcopy(peft_model.peft_config[adapter_name])
        if base is not None:
            self.config.base_model_name_or_path = base
        if not self.file_key:
            raise CheckpointError("the model has no trainable adapter parameters to save")

    def select(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Model state (clean names) -> adapter-file tensors."""
        missing = sorted(set(self.file_key) - set(state))
        if missing:
            raise CheckpointError(
                f"gathered state lacks {len(missing)} adapter params, e.g. {missing[0]}"
            )
        return {key: state[name].contiguous() for name, key in self.file_key.items()}


def gather_trainable(wrapped) -> dict[str, torch.Tensor]:
    """Full (unsharded) trainable parameters on every rank. A collective: all ranks call it."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    options = StateDictOptions(full_state_dict=True, ignore_frozen_params=True)
    state = get_model_state_dict(wrapped, options=options)
    # ignore_frozen_params keeps bitsandbytes' quantization buffers (absmax, quant_map...): drop them.
    trainable = {n for n, p in wrapped.named_parameters() if p.requires_grad}
    trainable = {clean_name(n) for n in trainable}
    return {k: v.detach().to("cpu") for k, v in state.items() if k in trainable}


def clean_name(name: str) -> str:
    """Parameter name without the wrappers' prefixes (DDP `module.`, FSDP1 `_fsdp_wrapped_module.`,
    activation checkpointing's `_checkpoint_wrapped_module.`)."""
    for prefix in ("_fsdp_wrapped_module.", "_checkpoint_wrapped_module.", "_orig_mod."):
        name = name.replace(prefix, "")
    return name.removeprefix("module.")


def checksum(state: dict[str, torch.Tensor]) -> str:
    h = hashlib.sha256()
    for k in sorted(state):
        h.update(k.encode())
        h.update(state[k].float().contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


def save_adapter(layout: AdapterLayout, state, folder: Path, tokenizer=None) -> Path:
    """Write the adapter part of `state` in PEFT format (rank 0 only), atomically, verified."""
    from safetensors.torch import save_file

    folder = Path(folder)
    tmp = folder.with_name(folder.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    layout.config.save_pretrained(tmp)
    save_file(
        layout.select(state), str(tmp / "adapter_model.safetensors"), metadata={"format": "pt"}
    )
    if tokenizer is not None:
        tokenizer.save_pretrained(tmp)
    verify_adapter(tmp, layout.shapes)
    manifest.ordinary_modes(tmp)
    shutil.rmtree(folder, ignore_errors=True)
    os.replace(tmp, folder)
    return folder


# --------------------------------------------------------------------------- training checkpoints
#
# <output_dir>/checkpoints/step-000010/
#     adapter/            PEFT adapter of that step (verified), usable for inference as is
#     dcp/ | full.*       trainable weights + optimizer: sharded (one file per rank, DCP) or
#                         gathered (full.safetensors: the tensors; full.json: the rest)
#     trainer.json        step, LR scheduler, data position, format, world size (rank 0)
#     rng-rank{r}.*       every rank's RNG states (dropout differs per rank): .safetensors torch's,
#                         .json Python's and NumPy's
#     COMPLETE.json       the manifest (kit.folder.manifest): every file's size and sha256 and the config
#                         that made it, written last; a folder without it is never resumed
#
# Each checkpoint is written into step-N.tmp and renamed when complete, so a process killed mid-save
# leaves a .tmp folder that resume reports and skips. Resume checks the manifest first (a truncated
# or changed file, another model or LoRA shape) and falls back to the newest
# checkpoint without a problem. No file is read as code (kit.recipe.trainer_state): JSON,
# safetensors, DCP through an unpickler that builds only its metadata; an earlier kit's .pt files
# with torch.load(weights_only=True).


def find_resume(resume: str, output_dir, cfg=None, world_size: int | None = None
                ) -> tuple[Path | None, list[str]]:
    """The checkpoint folder `training.resume` names, plus one note per newer checkpoint skipped.
    With `cfg` (a Config or its to_dict()) and `world_size`, a checkpoint must also have been made
    with the same resume fields (kit.folder.manifest.RESUME_FIELDS) (any world size); without: files only.
    "auto" with no valid checkpoint: (None, notes); the caller decides. A path: it must be valid."""
    if not resume:
        return None, []
    config = cfg.to_dict() if hasattr(cfg, "to_dict") else cfg
    if resume != "auto":
        why = manifest.problem(Path(resume), config, world_size)
        if why:
            raise CheckpointError(f"training.resume: {why}")
        return Path(resume), []
    folder, _, notes = manifest.newest_valid(output_dir, config, world_size)
    return folder, notes


def _trainable_only(wrapped, state: dict) -> dict:
    names = {clean_name(n) for n, p in wrapped.named_parameters() if p.requires_grad}
    return {k: v for k, v in state.items() if k in names}


def _run_config(output_dir) -> dict:
    """The resolved config the recipe wrote into the run folder ({} when there is none)."""
    import yaml

    try:
        return yaml.safe_load(RunFolder(output_dir).config.read_text()) or {}
    except (OSError, yaml.YAMLError):
        return {}


def _set_aside(folder: Path) -> Path | None:
    """A checkpoint of this step from an earlier attempt (the run resumed from an older one, e.g.
    because this one was damaged): renamed step-N.replaced-K, never deleted."""
    if not folder.exists():
        return None
    n = 1
    while (aside := folder.with_name(f"{folder.name}.replaced-{n}")).exists():
        n += 1
    os.replace(folder, aside)
    print(f"checkpoint: kept the earlier {folder.name} as {aside} (never resumed; delete it "
          "yourself when it is not needed)", flush=True)
    return aside


def save_training_state(**kwargs) -> Path:
    """Write checkpoint `step` (a collective: every rank calls it; the arguments of
    `_write_training_state`). Returns the folder. A disk that fills up during the save (or a
    file-size or quota limit) ends it with one line, a CheckpointError naming the step and what a
    restart does; the save in progress stays step-N.tmp, which no resume takes."""
    from kit.recipe import faults

    faults.maybe_fill_disk(kwargs["step"])
    try:
        return _write_training_state(**kwargs)
    except BaseException as e:  # DCP's CheckpointException is a BaseException
        why = _no_space(e)
        if why is None:
            raise
        name = RunFolder.step_name(kwargs["step"])
        raise CheckpointError(
            f"checkpoint {name} cannot be written ({why}); it stays "
            f"{name}.tmp, which no resume takes; with space again, "
            "training.resume=auto (or any restart) resumes from the checkpoint before") from None


def _no_space(error: BaseException) -> str | None:
    """What failed when `error`, or what caused it on any rank (DCP gathers each rank's), is a
    write refused for space (a full disk, a quota, a file-size limit); else None."""
    todo, seen = [error], set()
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
            return f"[Errno {e.errno}] {e.strerror}"
        if isinstance(e, RuntimeError) and "file write failed" in str(e):  # torch.save's writer
            return str(e).splitlines()[0]
        failures = getattr(e, "failures", None) or {}
        todo += [e.__cause__, e.__context__,
                 *(f[0] if isinstance(f, tuple) else f for f in failures.values())]
    return None


def _write_training_state(*, wrapped, engine, optimizer, scheduler, batches, step, env, fmt,
                          output_dir, layout: AdapterLayout, keep_last: int = 0,
                          keep_best: bool = False, val_loss: float | None = None,
                          tokenizer=None, config: dict | None = None) -> Path:
    """save_training_state's work. `config`: the run's config tree for the manifest (default: the
    run folder's config.yaml); `val_loss`: the held-out loss evaluated at this step, recorded in
    the manifest (what keep_best, kit.folder.manifest.best, compares)."""
    import time

    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    from kit.recipe import faults

    started = time.perf_counter()
    folder = RunFolder(output_dir).step_folder(step)
    tmp = folder.with_name(folder.name + ".tmp")
    if env.is_main:
        shutil.rmtree(tmp, ignore_errors=True)  # this step's own unfinished save, if one was killed
        tmp.mkdir(parents=True)
    dist.barrier()
    full = fmt == "full"
    options = engine.state_dict_options(full=full, device=env.device)  # kit.recipe.engines
    model_state = _trainable_only(wrapped, get_model_state_dict(wrapped, options=options))
    optim_state = get_optimizer_state_dict(wrapped, optimizer, options=options)
    if full:
        if env.is_main:
            to_cpu = lambda t: t.cpu() if isinstance(t, torch.Tensor) else t  # noqa: E731
            state = torch.utils._pytree.tree_map(to_cpu, {"model": model_state, "optim": optim_state})
            trainer_state.write(tmp, trainer_state.FULL, state)
    else:
        dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=str(tmp / "dcp"))
    trainer_state.write(tmp, trainer_state.rng_name(env.rank), trainer_state.rng_state(env.device))
    adapter_state = gather_trainable(wrapped)
    faults.maybe_fail_in_save(step, env.rank)
    faults.maybe_slow_save()
    dist.barrier()  # every rank's files exist from here on
    if env.is_main:
        save_adapter(layout, adapter_state, tmp / RunFolder.ADAPTER, tokenizer)
        trainer_state.write(tmp, trainer_state.TRAINER, {
            "step": step, "scheduler": scheduler.state_dict(), "batches": batches.state_dict(),
            "format": fmt, "world_size": env.world_size})
        missing = [f"{trainer_state.rng_name(r)}.json" for r in range(env.world_size)
                   if not (tmp / f"{trainer_state.rng_name(r)}.json").is_file()]
        if missing:
            raise CheckpointError(f"{tmp}: {', '.join(missing)} not written")
        seconds = round(time.perf_counter() - started, 3)
        manifest.write(tmp, _run_config(output_dir) if config is None else config, step,
                       env.world_size, {"format": fmt, "seconds": seconds,
                                        **({} if val_loss is None else {"val_loss": val_loss})})
        _set_aside(folder)
        os.replace(tmp, folder)
        prune(output_dir, keep_last, keep_best)
    dist.barrier()
    return folder


def prune(output_dir, keep_last: int, keep_best: bool = False) -> list[Path]:
    """Delete complete checkpoints beyond the newest `keep_last` (0 keeps all); keep_best: all
    but the one with the lowest held-out loss (kit.folder.manifest.best)."""
    complete, _ = scan(output_dir)
    kept = manifest.best(output_dir) if keep_best else None
    doomed = [f for _, f in complete[:-keep_last] if not kept or str(f) != kept["path"]
              ] if keep_last else []
    for folder in doomed:
        shutil.rmtree(folder)
    return doomed


def read_trainer(folder) -> dict:
    """A checkpoint's trainer state (step, scheduler, batches, format, world_size), read as data
    (kit.recipe.trainer_state), from this kit's trainer.json or an earlier kit's trainer.pt."""
    path = Path(folder) / f"{trainer_state.TRAINER}.json"
    trainer = trainer_state.read_either(Path(folder), trainer_state.TRAINER)
    if not isinstance(trainer, dict) or not {"step", "format", "world_size"} <= set(trainer):
        raise CheckpointError(f"{path if path.is_file() else path.with_suffix('.pt')}: holds no "
                              f"step, format and world size (damaged); {trainer_state.AFTER}")
    return trainer


def load_training_state(folder, *, wrapped, optimizer, scheduler, batches, env) -> int:
    """Restore a checkpoint written by save_training_state (collective); returns its step. Resume
    checks the manifest first; a file that still cannot be read, or weights that do not fit this
    model, raise CheckpointError naming the file. Every file is read before anything is restored,
    none as code (kit.recipe.trainer_state)."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    folder = Path(folder)
    trainer = read_trainer(folder)
    rng = None
    if trainer["world_size"] == env.world_size:  # another world size: new per-rank streams
        rng = trainer_state.read_either(folder, trainer_state.rng_name(env.rank), required=False)
    full = trainer["format"] == "full"
    # strict=False: the checkpoint holds only the trainable weights, not the frozen 4-bit base.
    options = StateDictOptions(full_state_dict=full, ignore_frozen_params=True, strict=False)
    if full:
        saved = trainer_state.read_either(folder, trainer_state.FULL)
        model_state, optim_state = saved["model"], saved["optim"]
    else:
        model_state, optim_state = _read_sharded(folder, wrapped, optimizer, options)
    try:
        set_model_state_dict(wrapped, model_state, options=options)
        set_optimizer_state_dict(wrapped, optimizer, optim_state, options=options)
    except Exception as e:  # another model or LoRA shape: a size mismatch per tensor
        raise CheckpointError(f"{folder}: its weights do not fit this model, made with another "
                              f"model or LoRA shape? ({first_line(e)})") from e
    scheduler.load_state_dict(trainer["scheduler"])
    batches.load_state_dict(trainer["batches"])
    if rng is not None:
        trainer_state.set_rng_state(rng, env.device)
    return trainer["step"]


def _read_sharded(folder: Path, wrapped, optimizer, options) -> tuple[dict, dict]:
    """(model state, optimizer state) from folder/dcp, in this run's sharding (collective)."""
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    model_state = _trainable_only(wrapped, get_model_state_dict(wrapped, options=options))
    optim_state = get_optimizer_state_dict(wrapped, optimizer, options=options)
    state = {"model": model_state, "optim": optim_state}
    try:
        trainer_state.dcp_metadata(folder / "dcp")  # a crafted one refused before DCP opens it
        trainer_state.load_dcp(state, folder / "dcp")
    except (Exception, CheckpointException) as e:  # CheckpointException is a BaseException
        # The manifest, when there is one, names the damaged shard; DCP's error names none.
        why = manifest.problem(folder) if manifest.read(folder) else None
        refused = trainer_state.refusal(e)
        if why is None and refused is not None:
            raise CheckpointError(str(refused)) from None
        raise CheckpointError(why or f"{folder / 'dcp'}: cannot be loaded ({first_line(e)})") from e
    return state["model"], state["optim"]

