"""A local model folder (model.name=<folder>) and an adapter folder, checked as the ranks and
`kit chat` will read them, so that a broken file is one line naming it before any process starts.

    check_config(path, name)      # config.json parses, as a JSON object (no transformers)
    check_weights(name)           # the weights exist; every safetensors header parses and its
                                  # data offsets end where the file does (no torch)
    check_adapter(folder)         # adapter_config.json and adapter_model.safetensors, by file

Why read the safetensors header here: safetensors refuses a truncated file only when the whole
file is opened (safe_open maps it and says "MetadataIncompleteBuffer", naming no file), and
transformers reaches that on every rank after the process group has formed; the header is the
first 8 + N bytes, so a multi-GB shard is checked by reading a few KB.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from kit.config import ConfigError

FIELD = "model.name"
SAFETENSORS = "model.safetensors"
INDEX = "model.safetensors.index.json"
BIN, BIN_INDEX = "pytorch_model.bin", "pytorch_model.bin.index.json"
EXPECTED = ("expected what save_pretrained writes: config.json, the tokenizer and "
            f"{SAFETENSORS} (or {INDEX} and its shards)")
# Bytes per element of safetensors' dtypes (its Dtype enum); one not listed is not size-checked.
DTYPE_BYTES = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E5M2": 1, "F8_E4M3": 1, "F8_E8M0": 1, "I16": 2,
               "U16": 2, "F16": 2, "BF16": 2, "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8,
               "F64": 8}
HEADER_LIMIT = 100 * 2**20  # safetensors' own limit on the header's length


def read_json(file: Path, where: str) -> object:
    """A JSON file's value, or one line naming the file, the line and column."""
    try:
        text = file.read_bytes().decode("utf-8")
    except OSError as e:
        raise ConfigError(f"{where}: {file.name} cannot be read ({e.strerror})") from None
    except UnicodeDecodeError as e:
        raise ConfigError(f"{where}: {file.name} is not UTF-8 (byte 0x{e.object[e.start]:02x} at "
                          f"offset {e.start})") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise ConfigError(f"{where}: {file.name} line {e.lineno} column {e.colno} is not valid "
                          f"JSON ({e.msg})") from None


def check_config(path: Path, name: str) -> dict:
    """config.json of the folder at `path` (model.name `name`) as a dict, or one line."""
    where = f"{FIELD}: {name!r}"
    config = read_json(path / "config.json", where)
    if not isinstance(config, dict):
        raise ConfigError(f"{where}: config.json holds a {type(config).__name__}, not a JSON "
                          f"object; {EXPECTED}")
    return config


def safetensors_problem(file: Path) -> str | None:
    """What is wrong with a safetensors file's header, or its size against the header's data
    offsets (None: nothing). Reads the header only."""
    size = file.stat().st_size
    with open(file, "rb") as f:
        head = f.read(8)
        length = int.from_bytes(head, "little") if len(head) == 8 else None
        if length is None or length > min(size - 8, HEADER_LIMIT):
            return (f"is truncated or not safetensors ({size:,} bytes; its first 8 bytes do not "
                    "give the length of a header inside the file)")
        raw = f.read(length)
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as e:
        return f"has a header that is not valid JSON ({str(e).splitlines()[0]})"
    if not isinstance(header, dict):
        return f"has a header that is a {type(header).__name__}, not a JSON object"
    end = 0
    for key, info in header.items():
        if key == "__metadata__":
            continue
        problem = _tensor_problem(info)
        if problem:
            return f"has tensor {key!r} {problem}"
        end = max(end, info["data_offsets"][1])
    want = 8 + length + end
    if size < want:
        return f"is truncated ({size:,} bytes; its header describes {want:,})"
    if size > want:
        return f"has {size - want:,} bytes past the tensors its header describes ({size:,} bytes)"
    return None


def _tensor_problem(info) -> str | None:
    """One header entry ({dtype, shape, data_offsets}): what is wrong with it, or None."""
    if not isinstance(info, dict):
        return f"described by a {type(info).__name__}, not a JSON object"
    offsets, shape = info.get("data_offsets"), info.get("shape")
    if not (isinstance(offsets, list) and len(offsets) == 2
            and all(type(o) is int and o >= 0 for o in offsets) and offsets[0] <= offsets[1]):
        return f"with data_offsets {offsets!r}, not [begin, end] byte offsets"
    if not (isinstance(shape, list) and all(type(d) is int and d >= 0 for d in shape)):
        return f"with shape {shape!r}, not a list of sizes"
    each = DTYPE_BYTES.get(info.get("dtype"))
    if each is not None and offsets[1] - offsets[0] != math.prod(shape) * each:
        return (f"of {info['dtype']} {shape} in {offsets[1] - offsets[0]:,} bytes "
                f"(it needs {math.prod(shape) * each:,})")
    return None


def check_safetensors(file: Path, where: str) -> dict:
    """The header of a safetensors file (tensor name -> entry), or one line naming the file."""
    problem = safetensors_problem(file)
    if problem:
        raise ConfigError(f"{where}: {file.name} {problem}; copy or save it again")
    with open(file, "rb") as f:
        return json.loads(f.read(int.from_bytes(f.read(8), "little")))


def check_weights(name: str) -> None:
    """The weights of a local model folder exist, and every safetensors file among them has a
    header that parses and the size it describes; an index's every shard exists and holds the
    tensors the index puts there. A kit model or a hub id: nothing to check here."""
    path, where = Path(name).expanduser(), f"{FIELD}: {name!r}"
    if not path.is_dir():  # a kit model or a hub id (kit.inputs.sources.kind): not a folder here
        return
    if (path / SAFETENSORS).is_file():
        check_safetensors(path / SAFETENSORS, where)
    elif (path / INDEX).is_file():
        _check_index(path, INDEX, where, safetensors=True)
    elif (path / BIN).is_file():
        return  # torch.load's format: read by transformers alone (weights_only)
    elif (path / BIN_INDEX).is_file():
        _check_index(path, BIN_INDEX, where, safetensors=False)
    else:
        raise ConfigError(f"{where} has no weights ({SAFETENSORS}, {INDEX} or {BIN}); {EXPECTED}")


def _check_index(path: Path, index: str, where: str, safetensors: bool) -> None:
    data = read_json(path / index, where)
    weight_map = data.get("weight_map") if isinstance(data, dict) else None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise ConfigError(f"{where}: {index} has no weight_map of tensor name -> shard file; "
                          f"{EXPECTED}")
    shards: dict[str, list[str]] = {}
    for tensor, shard in weight_map.items():
        shards.setdefault(shard, []).append(tensor)
    for shard, tensors in shards.items():
        file = path / shard
        if Path(shard).name != shard or not file.is_file():
            raise ConfigError(f"{where}: {index} names the shard {shard!r}, which is not a file "
                              f"of the folder ({len(tensors)} tensors); copy it there again")
        if safetensors:
            missing = [t for t in tensors if t not in check_safetensors(file, where)]
            if missing:
                raise ConfigError(f"{where}: {index} puts {missing[0]!r} in {shard}, whose header "
                                  f"has no such tensor ({len(missing)} missing); the index and the "
                                  "shards are of different saves")


def config_refusal(name: str, path: str, trust_remote_code: bool) -> str | None:
    import transformers
    from transformers import AutoConfig
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    where = f"{FIELD}: {name!r}"
    try:
        config = check_config(Path(path), name)
    except ConfigError as e:
        return str(e)
    model_type = config.get("model_type")
    if model_type is not None and not isinstance(model_type, str):
        return f"{where}: config.json's model_type is {model_type!r}, not a string; {EXPECTED}"
    if model_type is None and "auto_map" not in config:
        return f"{where}: config.json has no model_type (a string); {EXPECTED}"
    if model_type is not None and model_type not in CONFIG_MAPPING and "auto_map" not in config:
        return (f"{where}: config.json has model_type {model_type!r}, which transformers "
                f"{transformers.__version__} does not know; allowed: a model_type it knows "
                "(a newer transformers may know this one)")
    try:
        AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code, local_files_only=True)
    except Exception as e:  # noqa: BLE001 - transformers' reason, as one line naming the folder
        return f"{where}: config.json cannot be read by transformers ({_first_line(e)})"
    return None


def tokenizer_refusal(name: str, path: str, trust_remote_code: bool) -> str | None:
    from transformers import AutoTokenizer
    from transformers.utils import logging

    before = logging.get_verbosity()
    logging.set_verbosity_error()  # its warnings about a missing file: the one line below says it
    try:
        AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code,
                                      local_files_only=True)
    except Exception as e:  # noqa: BLE001 - the library's reason, as one line naming the folder
        return (f"{FIELD}: {name!r}: its tokenizer cannot be loaded ({_first_line(e)}); "
                f"{EXPECTED}")
    finally:
        logging.set_verbosity(before)
    return None


def _first_line(e: BaseException) -> str:
    said = " ".join(str(e).split()).split(". ")[0]  # the first sentence: the reason
    return f"{type(e).__name__}: {said[:300]}" if said else type(e).__name__


def check_adapter(folder: Path) -> None:
    """An adapter folder as PEFT will load it: adapter_config.json parses, as a JSON object, and
    adapter_model.safetensors' header and size agree. One line naming the file."""
    where = f"adapter: '{folder}'"
    config = read_json(folder / "adapter_config.json", where)
    if not isinstance(config, dict):
        raise ConfigError(f"{where}: adapter_config.json holds a {type(config).__name__}, not a "
                          "JSON object")
    weights = folder / "adapter_model.safetensors"
    if not weights.is_file():
        raise ConfigError(f"{where} has no adapter_model.safetensors")
    check_safetensors(weights, where)
