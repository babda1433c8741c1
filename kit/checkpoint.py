"""Saving what was trained: the LoRA adapter in PEFT format, checked after writing.

One path for every engine: `get_model_state_dict` (torch.distributed.checkpoint.state_dict) gathers
the trainable parameters with clean names from FSDP2, FSDP1 or DDP alike. PEFT decides which of
them form the adapter and under which file keys by walking the module tree, and FSDP1 renames that
tree (`_fsdp_wrapped_module.` inside every wrapped layer): asked after wrapping, PEFT finds no
adapter keys and `save_pretrained(state_dict=...)` writes a file with no tensors, without an error
(the first article's recipe does exactly that). So the kit asks PEFT for the key mapping once,
before wrapping, writes the file in PEFT's format, reads it back and compares it with the adapter
the model really has, or fails loudly.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import torch


class CheckpointError(RuntimeError):
    """A checkpoint on disk is missing, empty or does not match the model."""


class AdapterLayout:
    """Which model parameters form the adapter, their file keys and shapes. Build it from the PEFT
    model before sharding: PEFT's own key selection needs the unwrapped module tree."""

    def __init__(self, peft_model, adapter_name: str = "default"):
        from peft import get_peft_model_state_dict

        named = [(n, p) for n, p in peft_model.named_parameters() if p.requires_grad]
        # Hand PEFT a state dict of indices: what it returns tells which key each parameter gets.
        probe = {n: torch.tensor(i) for i, (n, _) in enumerate(named)}
        saved = get_peft_model_state_dict(peft_model, state_dict=probe, adapter_name=adapter_name)
        self.file_key = {named[int(v)][0]: k for k, v in saved.items()}
        self.shapes = {self.file_key[n]: tuple(p.shape) for n, p in named if n in self.file_key}
        self.config = peft_model.peft_config[adapter_name]
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
    shutil.rmtree(folder, ignore_errors=True)
    os.replace(tmp, folder)
    return folder


def verify_adapter(folder: Path, expected: dict[str, tuple[int, ...]]) -> dict:
    """Raise CheckpointError unless `folder` holds every expected LoRA tensor, finite, right shape."""
    from safetensors import safe_open

    folder = Path(folder)
    weights = folder / "adapter_model.safetensors"
    if not (folder / "adapter_config.json").is_file() or not weights.is_file():
        raise CheckpointError(f"{folder}: adapter_config.json or adapter_model.safetensors missing")
    with safe_open(str(weights), "pt") as f:
        found = {k: f.get_tensor(k) for k in f.keys()}
    missing = sorted(set(expected) - set(found))
    if missing:
        raise CheckpointError(
            f"{weights}: {len(missing)} of {len(expected)} LoRA tensors missing "
            f"(holds {len(found)}), e.g. {missing[0]}"
        )
    for k, shape in expected.items():
        t = found[k]
        if tuple(t.shape) != tuple(shape):
            raise CheckpointError(f"{weights}: {k} has shape {tuple(t.shape)}, expected {shape}")
        if not torch.isfinite(t.float()).all():
            raise CheckpointError(f"{weights}: {k} holds NaN or inf")
    config = json.loads((folder / "adapter_config.json").read_text())
    return {"tensors": len(found), "r": config.get("r"), "bytes": weights.stat().st_size}


# --------------------------------------------------------------------------- training checkpoints
#
# <output_dir>/checkpoints/step-000010/
#     adapter/            PEFT adapter of that step (verified), usable for inference as is
#     dcp/  | full.pt     trainable weights + optimizer: sharded (one file per rank, DCP) or gathered
#     trainer.pt          step, LR scheduler, data position, format, world size (rank 0)
#     rng-rank{r}.pt      every rank's RNG states (dropout differs per rank)
#     COMPLETE.json       written last; a folder without it was interrupted and is never resumed
#
# Each checkpoint is written into step-N.tmp and renamed when complete, so a process killed mid-save
# leaves a .tmp folder that resume reports and skips.

MARKER = "COMPLETE.json"


def checkpoints_root(output_dir) -> Path:
    return Path(output_dir) / "checkpoints"


def scan(output_dir) -> tuple[list[tuple[int, Path]], list[Path]]:
    """(complete checkpoints as (step, folder) oldest first, incomplete folders)."""
    root = checkpoints_root(output_dir)
    complete, incomplete = [], []
    for folder in sorted(root.glob("step-*")) if root.is_dir() else []:
        if folder.name.endswith(".tmp") or not (folder / MARKER).is_file():
            incomplete.append(folder)
        else:
            complete.append((json.loads((folder / MARKER).read_text())["step"], folder))
    return sorted(complete), incomplete


def summary(output_dir) -> list[dict]:
    """One row per checkpoint folder: step, format, bytes, seconds to write, complete or not."""
    complete, incomplete = scan(output_dir)
    rows = [{"folder": f.name, **json.loads((f / MARKER).read_text()), "complete": True}
            for _, f in complete]
    return rows + [{"folder": f.name, "complete": False} for f in incomplete]


def find_resume(resume: str, output_dir) -> tuple[Path | None, list[str]]:
    """The checkpoint folder that `training.resume` names, plus notes on what was skipped."""
    if not resume:
        return None, []
    if resume != "auto":
        folder = Path(resume)
        if not (folder / MARKER).is_file():
            raise CheckpointError(
                f"training.resume: {resume!r} is not a complete checkpoint (no {MARKER}); "
                "use 'auto' or a checkpoints/step-N folder"
            )
        return folder, []
    complete, incomplete = scan(output_dir)
    notes = [f"skipping {f}: incomplete (interrupted while saving)" for f in incomplete]
    return (complete[-1][1] if complete else None), notes


def _rng_state(device) -> dict:
    import random

    state = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def _set_rng_state(state: dict, device) -> None:
    import random

    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state and device.type == "cuda":
        torch.cuda.set_rng_state(state["cuda"], device)


def _trainable_only(wrapped, state: dict) -> dict:
    names = {clean_name(n) for n, p in wrapped.named_parameters() if p.requires_grad}
    return {k: v for k, v in state.items() if k in names}


def save_training_state(*, wrapped, engine, optimizer, scheduler, batches, step, env, fmt,
                        output_dir, layout: AdapterLayout, keep_last: int = 0,
                        tokenizer=None) -> Path:
    """Write checkpoint `step` (a collective: every rank calls it). Returns the folder."""
    import time

    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    from kit import faults

    started = time.perf_counter()
    folder = checkpoints_root(output_dir) / f"step-{step:06d}"
    tmp = folder.with_name(folder.name + ".tmp")
    if env.is_main:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    dist.barrier()
    full = fmt == "full"
    options = engine.state_dict_options(full=full, device=env.device)  # kit.engines
    model_state = _trainable_only(wrapped, get_model_state_dict(wrapped, options=options))
    optim_state = get_optimizer_state_dict(wrapped, optimizer, options=options)
    if full:
        if env.is_main:
            to_cpu = lambda t: t.cpu() if isinstance(t, torch.Tensor) else t  # noqa: E731
            state = torch.utils._pytree.tree_map(to_cpu, {"model": model_state, "optim": optim_state})
            torch.save(state, tmp / "full.pt")
    else:
        dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=str(tmp / "dcp"))
    torch.save(_rng_state(env.device), tmp / f"rng-rank{env.rank}.pt")
    adapter_state = gather_trainable(wrapped)
    faults.maybe_fail_in_save(step, env.rank)
    dist.barrier()
    if env.is_main:
        save_adapter(layout, adapter_state, tmp / "adapter", tokenizer)
        torch.save(
            {"step": step, "scheduler": scheduler.state_dict(), "batches": batches.state_dict(),
             "format": fmt, "world_size": env.world_size},
            tmp / "trainer.pt",
        )
        missing = [f"rng-rank{r}.pt" for r in range(env.world_size) if not (tmp / f"rng-rank{r}.pt").is_file()]
        if missing:
            raise CheckpointError(f"{tmp}: {', '.join(missing)} not written")
        size = sum(f.stat().st_size for f in tmp.rglob("*") if f.is_file())
        info = {"step": step, "format": fmt, "world_size": env.world_size, "bytes": size,
                "seconds": round(time.perf_counter() - started, 3)}
        (tmp / MARKER).write_text(json.dumps(info))
        shutil.rmtree(folder, ignore_errors=True)
        os.replace(tmp, folder)
        prune(output_dir, keep_last)
    dist.barrier()
    return folder


def prune(output_dir, keep_last: int) -> list[Path]:
    """Delete complete checkpoints beyond the newest `keep_last` (0 keeps all)."""
    complete, _ = scan(output_dir)
    doomed = [f for _, f in complete[:-keep_last]] if keep_last else []
    for folder in doomed:
        shutil.rmtree(folder)
    return doomed


def load_training_state(folder, *, wrapped, optimizer, scheduler, batches, env) -> int:
    """Restore a checkpoint written by save_training_state (collective); returns its step."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    folder = Path(folder)
    trainer = torch.load(folder / "trainer.pt", weights_only=False)
    full = trainer["format"] == "full"
    # strict=False: the checkpoint holds only the trainable weights, not the frozen 4-bit base.
    options = StateDictOptions(full_state_dict=full, ignore_frozen_params=True, strict=False)
    if full:
        saved = torch.load(folder / "full.pt", weights_only=False)
        model_state, optim_state = saved["model"], saved["optim"]
    else:
        model_state = _trainable_only(wrapped, get_model_state_dict(wrapped, options=options))
        optim_state = get_optimizer_state_dict(wrapped, optimizer, options=options)
        state = {"model": model_state, "optim": optim_state}
        dcp.load(state, checkpoint_id=str(folder / "dcp"))
        model_state, optim_state = state["model"], state["optim"]
    set_model_state_dict(wrapped, model_state, options=options)
    set_optimizer_state_dict(wrapped, optimizer, optim_state, options=options)
    scheduler.load_state_dict(trainer["scheduler"])
    batches.load_state_dict(trainer["batches"])
    rng = folder / f"rng-rank{env.rank}.pt"
    if rng.is_file() and trainer["world_size"] == env.world_size:
        _set_rng_state(torch.load(rng, weights_only=False), env.device)
    return trainer["step"]


# --------------------------------------------------------------------------- inference and merge


def load_for_inference(run_dir, adapter: str | Path | None = None, merged: bool = False):
    """(model, tokenizer) of a finished run in one process, no FSDP: the base exactly as trained
    (quantized per the run's config) plus the adapter. `adapter`: another adapter folder (e.g. a
    checkpoint's); `merged`: fold the adapter in (see merge_adapter)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from kit import builtin, quantize
    from kit.config import load_config

    cfg = load_config(Path(run_dir) / "config.yaml")
    adapter = Path(adapter or Path(run_dir) / "adapter")
    model = AutoModelForCausalLM.from_pretrained(
        builtin.resolve(cfg.model.name),
        dtype=quantize.DTYPES[cfg.model.dtype],
        quantization_config=quantize.bnb_config(cfg),
        **({"device_map": {"": 0}} if torch.cuda.is_available() else {}),
    )
    if merged and cfg.quantization.method != "none":
        # bf16 Linear layers holding exactly the 4-bit values the adapter was trained against.
        model = model.dequantize()
    model = PeftModel.from_pretrained(model, adapter)
    if merged:
        model = model.merge_and_unload()
    return model.eval(), AutoTokenizer.from_pretrained(adapter)


def merge_adapter(run_dir, out_dir, adapter: str | Path | None = None) -> Path:
    """Fold a run's adapter into its base weights (dequantized to model.dtype) and export a
    standalone model with save_pretrained: loadable by plain AutoModelForCausalLM, no PEFT."""
    model, tokenizer = load_for_inference(run_dir, adapter, merged=True)
    out_dir = Path(out_dir)
    tmp = out_dir.with_name(out_dir.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    config = json.loads((tmp / "config.json").read_text())
    if "quantization_config" in config or not list(tmp.glob("*.safetensors")):
        raise CheckpointError(f"{tmp}: merged export is still quantized or holds no weights")
    shutil.rmtree(out_dir, ignore_errors=True)
    os.replace(tmp, out_dir)
    return out_dir


@torch.no_grad()
def generate(model, tokenizer, prompt: str, max_new_tokens: int = 24) -> str:
    """Greedy continuation of `prompt` (deterministic, so before/after comparisons are fair)."""
    inputs = tokenizer(prompt, return_tensors="pt").to(model.device)
    out = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False,
                         pad_token_id=tokenizer.pad_token_id)
    return tokenizer.decode(out[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True)


def main(argv: list[str] | None = None) -> int:
    """python -m kit.checkpoint {list,verify,merge} RUN_DIR [...]"""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m kit.checkpoint", description=main.__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("list", help="checkpoints of a run, complete and incomplete").add_argument("run")
    v = sub.add_parser("verify", help="check an adapter folder against its config")
    v.add_argument("adapter")
    m = sub.add_parser("merge", help="fold the adapter into the base; export with save_pretrained")
    m.add_argument("run")
    m.add_argument("out")
    m.add_argument("--adapter", default=None)
    args = parser.parse_args(argv)
    if args.command == "list":
        for row in summary(args.run):
            print(row if row["complete"] else f"{row['folder']}: INCOMPLETE (never resumed)")
    elif args.command == "verify":
        from safetensors import safe_open

        with safe_open(str(Path(args.adapter) / "adapter_model.safetensors"), "pt") as f:
            shapes = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
        print(verify_adapter(args.adapter, shapes) if shapes else "EMPTY adapter")
        return 0 if shapes else 1
    else:
        print(merge_adapter(args.run, args.out, args.adapter))
    return 0


if __name__ == "__main__":
    import sys

    sys.exit(main())
