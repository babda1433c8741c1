"""What a training checkpoint holds, checked before anything trusts it. Imports no torch: the
torch-free check before torchrun starts and the ranks' resume read the same manifest.

Rank 0 writes the manifest last, into `checkpoints/step-NNNNNN/COMPLETE.json`, once every rank's
files exist; a folder without it (or still named `step-N.tmp`) was interrupted while saving:

    {"step": 10, "world_size": 2, "bytes": 91234, "format": "sharded", "seconds": 0.42,
     "val_loss": 6.58,                       # held-out loss evaluated at this step, if it was
     "manifest": 1,
     "config": {"model.name": "kit:tiny-llama", "lora.r": 8, ...},      # see RESUME_FIELDS
     "files": {"dcp/__0_0.distcp": {"bytes": 4096, "sha256": "9f2c..."},
               "trainer.json": {...}, "rng-rank0.json": {...}, "rng-rank0.safetensors": {...}, ...}}

It lists every file under the folder, whatever the format wrote (kit.recipe.trainer_state: JSON and
safetensors; an earlier kit's trainer.pt and rng-rank{r}.pt), so `kit checkpoints verify` checks
all of them.

`problem` re-reads every file (size, then sha256) and compares the config an exact resume needs;
a checkpoint written before manifests existed (a COMPLETE.json without "files") is reported as
unverifiable, never resumed. `newest_valid` walks back from the newest checkpoint to the first one
without a problem, with one note per checkpoint it skipped.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from pathlib import Path

from kit.folder.layout import RunFolder

MARKER = "COMPLETE.json"
VERSION = 1
STEP_FOLDER = RunFolder.STEP_FOLDER

# The config fields an exact resume must match ("section.*": every field of that section).
# training.steps is not one: continuing a run to more steps is allowed.
RESUME_FIELDS = (
    "model.name", "model.dtype", "quantization.*",
    "lora.r", "lora.alpha", "lora.dropout", "lora.target_modules", "lora.dtype",
    "sharding.engine", "data.*",
    "training.batch_size", "training.grad_accum", "training.lr", "training.weight_decay",
    "training.warmup_steps", "training.scheduler", "training.max_grad_norm", "training.seed",
)  # fmt: skip


class CheckpointError(RuntimeError):
    """A checkpoint on disk is missing, damaged, empty or does not match the model or the run."""


def first_line(e: BaseException) -> str:
    """`Type: first line` of a library's error (for torch.distributed.checkpoint's multi-line
    CheckpointException: of the first failing rank's error), to quote in a one-line message."""
    failures = getattr(e, "failures", None)
    if isinstance(failures, dict) and failures:
        e = next(iter(failures.values()))[0]
    text = [line.strip() for line in str(e).strip().splitlines()]
    if len(text) > 1 and text[0].endswith(":"):  # "Error(s) in loading state_dict for X:" + why
        text[0] = f"{text[0]} {text[1]}"
    return f"{type(e).__name__}: {text[0][:300]}" if text else type(e).__name__


def checkpoints_root(output_dir) -> Path:
    return RunFolder(output_dir).checkpoints


def resume_fields(config: dict | None) -> dict:
    """{"lora.r": 8, ...}: the RESUME_FIELDS of `config`, a Config.to_dict() tree (or already flat
    with dotted keys), as JSON values. Fields the config does not have are left out."""
    out: dict = {}
    for name in RESUME_FIELDS if config else ():
        section, key = name.split(".", 1)
        tree = config.get(section)
        if key == "*":
            out |= {k: v for k, v in config.items() if k.startswith(section + ".")}
            if isinstance(tree, dict):
                out |= {f"{section}.{k}": v for k, v in tree.items()}
        elif name in config:
            out[name] = config[name]
        elif isinstance(tree, dict) and key in tree:
            out[name] = tree[key]
    return json.loads(json.dumps(out))  # tuples -> lists: compares equal to what was saved


def ordinary_modes(folder: Path) -> Path:
    """Give a written folder the modes any file the user writes gets (0o666 / 0o777 less the
    umask): safetensors (>= 0.8) writes its files with mode 0600 and tempfile.mkdtemp makes 0700
    folders, so an adapter or merged model would otherwise be unreadable to the user's group."""
    mask = os.umask(0)
    os.umask(mask)
    folder = Path(folder)
    folder.chmod(0o777 & ~mask)
    for path in folder.rglob("*"):
        path.chmod((0o777 if path.is_dir() else 0o666) & ~mask)
    return folder


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def write(folder: Path, config: dict | None, step: int, world_size: int,
          extra: dict | None = None) -> dict:
    """Record every file under `folder` (relative path, bytes, sha256) and the config that made it
    in folder/COMPLETE.json, written atomically; call it last, once every rank's files exist."""
    folder = Path(folder)
    files = {}
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        rel = path.relative_to(folder).as_posix()
        if rel not in (MARKER, MARKER + ".tmp"):
            files[rel] = {"bytes": path.stat().st_size, "sha256": sha256(path)}
    saved = {"step": step, "world_size": world_size,
                "bytes": sum(f["bytes"] for f in files.values()), **(extra or {}),
                "manifest": VERSION, "config": resume_fields(config), "files": files}
    tmp = folder / (MARKER + ".tmp")
    tmp.write_text(json.dumps(saved, indent=1))
    os.replace(tmp, folder / MARKER)
    return saved


def read(folder: Path) -> dict | None:
    """The parsed COMPLETE.json of `folder`, or None when it is missing or not a JSON object."""
    try:
        marker = json.loads((Path(folder) / MARKER).read_text())
    except (OSError, ValueError):
        return None
    return marker if isinstance(marker, dict) else None


def world_note(folder: Path, world_size: int, per_rank_rows: int | None) -> str | None:
    """One line when checkpoint `folder` was written by another number of ranks than
    `world_size` (per_rank_rows: training.batch_size x grad_accum; None: the batch is the plan's,
    kit.budget.plan), else None."""
    saved = (read(Path(folder)) or {}).get("world_size")
    if saved in (None, world_size):
        return None
    rows = ("a step's rows follow from the new plan" if per_rank_rows is None else
            f"a step now takes {per_rank_rows * world_size} rows, not {per_rank_rows * saved}")
    return (f"{folder} was written by {saved} ranks, this run has {world_size}: the adapter and "
            "optimizer state are resharded and the data continues where it stopped (no sample "
            f"repeated or skipped), but {rows}, and dropout draws from new per-rank streams: the "
            f"losses from here are not those the {saved}-rank run would have had")


def _show(value) -> str:
    return value if isinstance(value, str) else json.dumps(value)


def problem(folder: Path, config: dict | None = None, world_size: int | None = None) -> str | None:
    """None when `folder` is a complete checkpoint whose every file has the size and checksum its
    manifest lists and (when given) the same RESUME_FIELDS as this run; else one line naming the
    folder and the file or field. Another world size is no problem: the sharded state reshards
    (DCP) and the data position is kept in samples (kit.recipe.data.Sampler); `world_note` says what
    differs then."""
    folder = Path(folder)
    if folder.name.endswith(".tmp"):
        return f"{folder}: incomplete (interrupted while saving)"
    if not folder.is_dir():
        return f"{folder}: does not exist"
    if not (folder / MARKER).is_file():
        return (f"{folder}: not a complete checkpoint (no {MARKER}: interrupted while saving, "
                "or not a checkpoint folder)")
    saved = read(folder)
    if saved is None:
        return f"{folder}: {MARKER} is not readable JSON (damaged)"
    files = saved.get("files")
    if not isinstance(files, dict):
        return (f"{folder}: {MARKER} holds no manifest (saved by an older kit): its files cannot be "
                "verified, so it is never resumed")
    made, now = saved.get("config") or {}, resume_fields(config)
    differ = [k for k in made if k in now and now[k] != made[k]]
    if differ:
        k, more = differ[0], differ[1:]
        also = f" (also differs: {', '.join(more)})" if more else ""
        return f"{folder}: made with {k}={_show(made[k])}, this run has {k}={_show(now[k])}{also}"
    for rel, want in files.items():
        path = folder / rel
        try:
            size, expected = path.stat().st_size, int(want["bytes"])
        except FileNotFoundError:
            return f"{folder}: {rel} is missing (the manifest lists it)"
        except (TypeError, KeyError, ValueError):
            return f"{folder}: {MARKER} lists {rel} without its size (damaged manifest)"
        if size != expected:
            how = "truncated" if size < expected else "longer than when it was saved"
            return f"{folder}: {rel} is {size:,} bytes, the manifest says {expected:,} ({how})"
        digest = sha256(path)
        if digest != want.get("sha256"):
            return (f"{folder}: {rel} has sha256 {digest[:12]}..., the manifest says "
                    f"{str(want.get('sha256'))[:12]}... (changed after it was saved)")
    return None


def step_folders(output_dir) -> list[tuple[int, Path]]:
    """(step, folder) of every checkpoints/step-N and step-N.tmp folder, oldest first."""
    root = checkpoints_root(output_dir)
    found = [(int(m[1]), p) for p in (root.iterdir() if root.is_dir() else ())
             if p.is_dir() and (m := STEP_FOLDER.fullmatch(p.name))]
    return sorted(found, key=lambda item: (item[0], item[1].name))


def newest_valid(output_dir, config: dict | None = None,
                 world_size: int | None = None) -> tuple[Path | None, int, list[str]]:
    """(folder, step, notes): the newest checkpoint without a problem (None, 0 when there is none)
    and one note per newer checkpoint skipped on the way to it."""
    skipped = []
    for step, folder in reversed(step_folders(output_dir)):
        why = problem(folder, config, world_size)
        if why is None:
            return folder, int((read(folder) or {}).get("step", step)), [
                f"skipping {s}; using {folder.name}" for s in skipped]
        skipped.append(why)
    return None, 0, [f"skipping {s}; no valid checkpoint left to resume from" for s in skipped]


def scan(output_dir) -> tuple[list[tuple[int, Path]], list[Path]]:
    """(checkpoints with a readable COMPLETE.json as (step, folder) oldest first, incomplete
    folders). Only file checks tell a valid one (`problem`); scan reads no file but the marker."""
    complete, incomplete = [], []
    for step, folder in step_folders(output_dir):
        marker = None if folder.name.endswith(".tmp") else read(folder)
        if marker is None:
            incomplete.append(folder)
        else:
            complete.append((int(marker.get("step", step)), folder))
    return sorted(complete), incomplete


def set_aside(output_dir) -> list[Path]:
    """Checkpoints a later save of the same step moved aside (step-N.replaced-K): never resumed,
    never pruned; the kit does not delete them."""
    root = checkpoints_root(output_dir)
    return sorted(root.glob("step-*.replaced-*")) if root.is_dir() else []


def best(output_dir) -> dict | None:
    """The complete checkpoint with the lowest held-out loss its manifest records (the run
    evaluated at its step), as {"step", "val_loss", "path"}; of equal ones the earliest; None when
    no checkpoint records one. What checkpointing.keep_best keeps past keep_last."""
    scored = [(marker["val_loss"], step, folder) for step, folder in scan(output_dir)[0]
              if isinstance((marker := read(folder) or {}).get("val_loss"), (int, float))
              and math.isfinite(marker["val_loss"])]
    if not scored:
        return None
    loss, step, folder = min(scored, key=lambda item: item[:2])
    return {"step": step, "val_loss": loss, "path": str(folder)}


def summary(output_dir) -> list[dict]:
    """One row per checkpoint folder: step, format, bytes, seconds to write, held-out loss (where
    evaluated at its step), files in the manifest, complete or not; the lowest held-out loss's is
    marked "best". Cheap: reads only the markers (`problem` checks the files)."""
    complete, incomplete = scan(output_dir)
    rows, lowest = [], best(output_dir)
    for _, folder in complete:
        marker = read(folder) or {}
        row = {k: v for k, v in marker.items() if k not in ("files", "config", "manifest")}
        rows.append({"folder": folder.name, **row, "complete": True,
                     **({"files": len(marker["files"])} if isinstance(marker.get("files"), dict)
                        else {"verifiable": False}),
                     **({"best": True} if lowest and lowest["path"] == str(folder) else {})})
    rows += [{"folder": f.name, "complete": False} for f in incomplete]
    return rows + [{"folder": f.name, "complete": False, "set_aside": True}
                   for f in set_aside(output_dir)]
