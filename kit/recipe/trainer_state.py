"""A training checkpoint's files as data, never code: whoever can write a checkpoint folder (a
run folder copied from a colleague, downloaded, shared) must not be able to run anything on resume.

What the kit writes (kit.recipe.checkpoint):

    trainer.json                 step, LR scheduler, data position, format, world size
    rng-rank{r}.json / .safetensors   a rank's Python and NumPy RNG states (JSON) and its torch
                                 (and CUDA) generator states (uint8 tensors)
    full.json / full.safetensors     format "full": the optimizer's plain values (param groups)
                                 and every tensor of the trainable weights and optimizer state
    dcp/                         format "sharded": torch.distributed.checkpoint, read through
                                 `load_dcp` below

Each NAME.json holds the state as JSON with tuples and tensors tagged ({"__tuple__": [...]},
{"__tensor__": key}); the tensors themselves are in NAME.safetensors. Floats go through JSON as
Python's repr, which reads back to the same bits, so resume stays exact.

torch.distributed.checkpoint unpickles its `.metadata` with plain pickle and the non-tensor values
of a shard with `torch.load`, its weights-only check off: `load_dcp` reads the first with an
unpickler that builds only DCP's own metadata classes, the second with `weights_only=True`.

Checkpoints of earlier kits (trainer.pt, rng-rank{r}.pt, full.pt: torch.save pickles) hold only
tensors and plain values, so they are read with `torch.load(weights_only=True)`; a file that needs
anything more is refused, never loaded.
"""

from __future__ import annotations

import functools
import json
import pickle
import re
from pathlib import Path

import torch

from kit.folder.manifest import CheckpointError, first_line

TENSOR, TUPLE = "__tensor__", "__tuple__"
VERSION = 1
TRAINER, FULL = "trainer", "full"
AFTER = "resume from another checkpoint (training.resume=PATH) or start the run afresh"


def rng_name(rank: int) -> str:
    return f"rng-rank{rank}"


# --------------------------------------------------------------------------- the codec


def _encode(value, path: str, tensors: dict):
    if isinstance(value, torch.Tensor):
        if path in tensors:
            raise ValueError(f"two tensors would be stored as {path!r}")
        tensors[path] = value.detach().to("cpu").contiguous()
        return {TENSOR: path}
    if isinstance(value, dict):
        if not all(isinstance(k, str) for k in value) or {TENSOR, TUPLE} & set(value):
            raise TypeError(f"{path or 'state'}: only dicts with string keys are stored")
        return {k: _encode(v, f"{path}/{k}" if path else k, tensors) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        items = [_encode(v, f"{path}/{i}", tensors) for i, v in enumerate(value)]
        return {TUPLE: items} if isinstance(value, tuple) else items
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise TypeError(f"{path or 'state'}: a {type(value).__name__} is not stored in a checkpoint")


def _decode(value, tensors: dict):
    if isinstance(value, list):
        return [_decode(v, tensors) for v in value]
    if not isinstance(value, dict):
        return value
    if set(value) == {TENSOR}:
        return tensors[value[TENSOR]]
    if set(value) == {TUPLE}:
        return tuple(_decode(v, tensors) for v in value[TUPLE])
    return {k: _decode(v, tensors) for k, v in value.items()}


def write(folder: Path, name: str, state: dict) -> list[Path]:
    """folder/NAME.json, plus folder/NAME.safetensors when `state` holds tensors. A write refused
    for space raises OSError (kit.recipe.checkpoint tells the user what it means)."""
    from safetensors.torch import save

    tensors: dict[str, torch.Tensor] = {}
    tree = _encode(state, "", tensors)
    written = []
    if tensors:
        written.append(Path(folder) / f"{name}.safetensors")
        written[-1].write_bytes(save(tensors, metadata={"format": "pt"}))
    written.insert(0, Path(folder) / f"{name}.json")
    text = json.dumps({"kit_state": VERSION, "tensors": bool(tensors), "state": tree})
    written[0].write_text(text)
    return written


def read(folder: Path, name: str) -> dict:
    """What `write` wrote, or CheckpointError (one line naming the file)."""
    from safetensors.torch import load

    path = Path(folder) / f"{name}.json"
    try:
        saved = json.loads(path.read_bytes())
    except ValueError as e:  # JSONDecodeError, UnicodeDecodeError: not what the kit writes
        raise CheckpointError(f"{path}: not a JSON file the kit wrote ({first_line(e)}); it was "
                              f"not loaded: {AFTER}") from None
    except OSError as e:
        raise CheckpointError(f"{path}: cannot be read ({first_line(e)})") from None
    if not isinstance(saved, dict) or saved.get("kit_state") != VERSION or "state" not in saved:
        raise CheckpointError(f"{path}: not a state file of this kit (no \"kit_state\": {VERSION});"
                              f" it was not loaded: {AFTER}")
    tensors = {}
    if saved.get("tensors"):
        file = path.with_suffix(".safetensors")
        try:
            tensors = load(file.read_bytes())
        except Exception as e:  # SafetensorError, OSError: a damaged or foreign file
            raise CheckpointError(f"{file}: not a safetensors file the kit wrote "
                                  f"({first_line(e)}); it was not loaded: {AFTER}") from None
    try:
        return _decode(saved["state"], tensors)
    except KeyError as e:
        raise CheckpointError(f"{path}: names tensor {e} that {path.stem}.safetensors does not "
                              f"hold (damaged); it was not loaded: {AFTER}") from None


def read_legacy(path: Path):
    """An earlier kit's torch.save file, read with weights_only=True: tensors and plain values
    only. Anything else is refused in one line naming the file and the object it wanted."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        raise CheckpointError(
            f"{path}: refused: a pickle that asks for Python objects beyond tensors and plain "
            f"values ({_wanted(e)}), which could run code; the kit never writes one and it was "
            f"not loaded: {AFTER}") from None
    except Exception as e:  # truncated or not a torch file at all
        raise CheckpointError(f"{path}: cannot be read ({first_line(e)})") from None


def _wanted(error: pickle.UnpicklingError) -> str:
    """What torch's weights_only unpickler refused ("Unsupported global: GLOBAL posix.system"),
    without its advice to load the file with that check off."""
    said = re.search(r"WeightsUnpickler error: (.*?)(?: was not an allowed global|\. |$)",
                     str(error), re.MULTILINE)
    return said[1][:120] if said else "UnpicklingError"


def read_either(folder: Path, name: str, required: bool = True):
    """NAME.json (this kit) or else NAME.pt (an earlier kit); None when neither exists and not
    `required`."""
    new, old = Path(folder) / f"{name}.json", Path(folder) / f"{name}.pt"
    if new.is_file() or (required and not old.is_file()):
        return read(folder, name)  # a required file missing: read names it
    return read_legacy(old) if old.is_file() else None


# --------------------------------------------------------------------------- RNG states


def rng_state(device) -> dict:
    import random

    import numpy as np

    kind, keys, pos, has_gauss, cached = np.random.get_state()
    state = {"torch": torch.get_rng_state(), "python": random.getstate(),
             "numpy": (kind, [int(k) for k in keys], int(pos), int(has_gauss), float(cached))}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def set_rng_state(state: dict, device) -> None:
    """Restore what rng_state gave (an earlier kit's file has no NumPy state: left as it is)."""
    import random

    import numpy as np

    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "numpy" in state:
        kind, keys, pos, has_gauss, cached = state["numpy"]
        np.random.set_state((kind, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))
    if "cuda" in state and device.type == "cuda":
        torch.cuda.set_rng_state(state["cuda"], device)


# --------------------------------------------------------------------------- DCP, read safely

_DCP_CLASSES = {
    ("torch.distributed.checkpoint.metadata", name) for name in (
        "Metadata", "TensorStorageMetadata", "TensorProperties", "ChunkStorageMetadata",
        "BytesStorageMetadata", "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING")
} | {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"), ("torch", "Size"),
    ("torch.serialization", "_get_layout"), ("collections", "OrderedDict"),
    *((module, cls) for module in ("pathlib", "pathlib._local")
      for cls in ("Path", "PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath")),
}  # fmt: skip


class _MetadataUnpickler(pickle.Unpickler):
    """Builds DCP's metadata (plain dataclasses, sizes, dtypes, paths) and nothing else."""

    def find_class(self, module, name):
        dtype = module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)
        if dtype or (module, name) in _DCP_CLASSES:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not part of a checkpoint's metadata")


def dcp_metadata(folder: Path, rank: int | None = None):
    """dcp/.metadata read with `_MetadataUnpickler`, or CheckpointError naming the file."""
    from torch.distributed.checkpoint.metadata import Metadata

    path = Path(folder) / (".metadata" if rank is None else f"__{rank}.metadata")
    try:
        with open(path, "rb") as f:
            metadata = _MetadataUnpickler(f).load()
    except pickle.UnpicklingError as e:
        raise CheckpointError(f"{path}: refused: {first_line(e).split(': ', 1)[-1]}, which could "
                              f"run code; it was not loaded: {AFTER}") from None
    except Exception as e:
        raise CheckpointError(f"{path}: cannot be read ({first_line(e)})") from None
    if not isinstance(metadata, Metadata):
        raise CheckpointError(f"{path}: holds a {type(metadata).__name__}, not DCP's metadata; "
                              f"it was not loaded: {AFTER}")
    return metadata


@functools.cache
def _dcp_classes():
    from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
    from torch.distributed.checkpoint.metadata import StorageMeta

    class Reader(FileSystemReader):
        def read_metadata(self, *args, **kwargs):
            metadata = dcp_metadata(Path(self.path), kwargs.get("rank"))
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

        def _slice_file(self, file, sinfo):  # which shard is being read, for the error
            self.reading = Path(self.path) / sinfo.relative_path
            return super()._slice_file(file, sinfo)

        def read_data(self, plan, planner):
            try:
                return super().read_data(plan, planner)
            except pickle.UnpicklingError as e:
                shard = getattr(self, "reading", Path(self.path))
                raise CheckpointError(
                    f"{shard}: refused: a value in it asks for Python objects beyond tensors and "
                    f"plain values ({_wanted(e)}), which could run code; it was not loaded: "
                    f"{AFTER}") from None

    class Planner(DefaultLoadPlanner):
        def load_bytes(self, read_item, value):  # DCP's own loads with the check off
            loaded = torch.load(value, weights_only=True)
            if self.flatten_state_dict:
                from torch.distributed.checkpoint._nested_dict import set_element

                set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn],
                            loaded)
            else:
                self.state_dict[read_item.dest_index.fqn] = loaded

    return Reader, Planner


def load_dcp(state: dict, folder: Path) -> None:
    """dcp.load into `state` (in place, a collective), reading nothing as code."""
    import torch.distributed.checkpoint as dcp

    reader, planner = _dcp_classes()
    dcp.load(state, storage_reader=reader(str(folder)), planner=planner())


def refusal(error: BaseException) -> CheckpointError | None:
    """The CheckpointError behind `error` (DCP wraps each rank's error in its own), if any."""
    todo, seen = [error], set()
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, CheckpointError):
            return e
        failures = getattr(e, "failures", None) or {}
        todo += [e.__cause__, e.__context__,
                 *(f[0] if isinstance(f, tuple) else f for f in failures.values())]
    return None
