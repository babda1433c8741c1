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
