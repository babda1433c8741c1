"""What a save wrote, read back and checked: the recipe after each save (kit.recipe.checkpoint),
the in-run check of the adapter (kit.recipe.checks), `kit checkpoints verify` after a run
(kit.inference.merge). Every failure is a CheckpointError of one line naming the file.

    verify_adapter(folder, shapes)    # every expected LoRA tensor there, finite, of its shape
    saved_shapes(folder)              # the shapes an adapter file lists (no model at hand)
    verify_checkpoint(folder)         # a training checkpoint's manifest, then its adapter

torch is imported inside the functions: the doctor (kernel side) reads kit.recipe.checks.
"""

from __future__ import annotations

import json
from pathlib import Path

from kit.folder import manifest
from kit.folder.layout import RunFolder
from kit.folder.manifest import CheckpointError, first_line


def verify_adapter(folder: Path, expected: dict[str, tuple[int, ...]]) -> dict:
    """Raise CheckpointError unless `folder` holds every expected LoRA tensor, finite, right shape."""
    import torch
    from safetensors import safe_open

    folder = Path(folder)
    weights = folder / "adapter_model.safetensors"
    if not (folder / "adapter_config.json").is_file() or not weights.is_file():
        raise CheckpointError(f"{folder}: adapter_config.json or adapter_model.safetensors missing")
    try:  # safetensors' own error on a truncated file is a traceback that names no file
        with safe_open(str(weights), "pt") as f:
            found = {k: f.get_tensor(k) for k in f.keys()}
    except Exception as e:
        raise CheckpointError(f"{weights}: cannot be read ({first_line(e)})") from e
    try:
        config = json.loads((folder / "adapter_config.json").read_text())
    except ValueError as e:
        raise CheckpointError(f"{folder / 'adapter_config.json'}: not JSON ({e})") from e
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
    return {"tensors": len(found), "r": config.get("r"), "bytes": weights.stat().st_size}


def saved_shapes(folder: Path) -> dict[str, tuple[int, ...]]:
    """An adapter folder's tensor shapes as its file lists them (what verify_adapter checks a
    folder against when no model is at hand); one-line CheckpointError when there are none."""
    from safetensors import safe_open

    weights = Path(folder) / "adapter_model.safetensors"
    if not weights.is_file():
        raise CheckpointError(f"{weights}: does not exist (no adapter saved there)")
    try:
        with safe_open(str(weights), "pt") as f:
            shapes = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    except Exception as e:
        raise CheckpointError(f"{weights}: cannot be read ({first_line(e)})") from e
    if not shapes:
        raise CheckpointError(f"{weights}: holds 0 tensors (an empty adapter: nothing was saved)")
    return shapes


def verify_checkpoint(folder, cfg_dict: dict | None = None, world_size: int | None = None) -> dict:
    """Raise CheckpointError (one line) unless `folder` is a valid training checkpoint: its manifest
    (every file's size and sha256; the config and world size, when given) and its adapter."""
    why = manifest.problem(Path(folder), cfg_dict, world_size)
    if why:
        raise CheckpointError(why)
    info = manifest.read(folder)
    saved = Path(folder) / RunFolder.ADAPTER  # a checkpoint's adapter, named as a run's
    adapter = verify_adapter(saved, saved_shapes(saved))
    return {"step": info["step"], "files": len(info["files"]), "bytes": info["bytes"],
            "adapter_tensors": adapter["tensors"]}
