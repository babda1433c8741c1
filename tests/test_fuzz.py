"""Generated input, where a user's input enters the kit (issue 57, item 7): values for every config
field (through load_config's key=value), rows of every data format the kit reads (JSON Lines and
JSON with text, chat messages or ShareGPT turns; CSV), and broken model folders (a missing file,
config.json that is not JSON or not a config, a truncated or altered safetensors file, an index
naming shards that are missing or lack its tensors). Each either loads or is one ConfigError line;
never another exception, never a file written outside the test's temporary folder (every write
this process makes is recorded by an audit hook while the checks run).

Deterministic (derandomize, no example database) and quick: a few hundred examples in all."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kit.config import Config, ConfigError, DataConfig, load_config
from kit.inputs import builtin, checks, datafile, model_folder, sources

FUZZ = settings(max_examples=120, deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture,
                                       HealthCheck.too_slow])


def fields(tree: dict, prefix: str = "") -> list[str]:
    return [key for k, v in tree.items()
            for key in (fields(v, f"{prefix}{k}.") if isinstance(v, dict) else [prefix + k])]


FIELDS = fields(Config().to_dict())

# --------------------------------------------------------------------------- writes recorded

_WRITES: list[str] | None = None  # the paths written while recording; None: not recording
_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC
# Audit events that change the file system: the places of their arguments that name what changes.
_MUTATIONS = {"os.mkdir": (0,), "os.rename": (0, 1), "os.remove": (0,), "os.rmdir": (0,),
              "os.symlink": (1,), "os.link": (1,), "os.truncate": (0,), "shutil.copyfile": (1,),
              "shutil.rmtree": (0,)}


def _audit(event: str, args: tuple) -> None:
    if _WRITES is None:
        return
    if event == "open":
        path, mode, flags = args
        writes = any(c in mode for c in "wax+") if isinstance(mode, str) else bool(
            isinstance(flags, int) and flags & _WRITE_FLAGS)
        paths = [path] if writes else []
    elif event in ("os.remove", "os.rmdir") and args[1] not in (None, -1):
        paths = []  # inside a folder shutil.rmtree named (its dir_fd walk): that event counts
    elif event in _MUTATIONS:
        paths = [args[i] for i in _MUTATIONS[event]]
    else:
        return
    _WRITES.extend(os.path.abspath(os.fsdecode(p)) for p in paths if not isinstance(p, int))


sys.addaudithook(_audit)  # for the process's life (a hook cannot be removed): idle when not recording


@contextlib.contextmanager
def writes_only_under(folder: Path):
    """Fail when anything this process writes, in the body, lies outside `folder` (byte code
    caches of modules imported on the way, and os.devnull, aside)."""
    global _WRITES
    _WRITES = []
    try:
        yield
    finally:
        written, _WRITES = _WRITES, None
    outside = [p for p in written if not p.startswith(str(folder) + os.sep)
               and f"{os.sep}__pycache__{os.sep}" not in p and p != os.devnull]
    assert not outside, f"written outside {folder}: {outside[:5]}"


def one_line_or_nothing(fn, *args, **kwargs):
    """fn's result, or None when it raised a ConfigError of one line; anything else fails."""
    try:
        return fn(*args, **kwargs)
    except ConfigError as e:
        assert str(e) and "\n" not in str(e), repr(str(e))
        return None


# --------------------------------------------------------------------------- config values

SCALARS = st.one_of(
    st.text(max_size=30),
    st.text(alphabet="$(){}[]'\"`;&|<>*?~#:,!%\\ \n\t\r\x00abc-", max_size=20),
    st.integers(min_value=-(2**70), max_value=2**70).map(str),
    st.floats(allow_nan=True, allow_infinity=True).map(repr),
    st.sampled_from(["true", "false", "null", "~", "auto", "[]", "{}", "[a, b]", "{a: 1}",
                     "'quoted'", "- x", "!!python/object:os.system x", "&a x", "*a", "1e400",
                     "0x10", "08", ".nan", "-.inf", "kit:nope", "../../x", "a\nb", "$(touch x)"]),
)


# Keys: the schema's, one level too deep, and printable unknown ones (a key holding a newline
# is echoed raw in kit.config's refusal, two lines: left to the loader's control-character rule).
KEYS = st.one_of(st.sampled_from(FIELDS), st.sampled_from(FIELDS).map(lambda f: f + ".x"),
                 st.text(st.characters(min_codepoint=33, max_codepoint=126), max_size=12))


@given(key=KEYS, value=SCALARS)
@FUZZ
def test_a_config_value_loads_or_is_one_line(tmp_path, key, value):
    with writes_only_under(tmp_path):
        cfg = one_line_or_nothing(load_config, None, [f"{key}={value}"])
    assert cfg is None or isinstance(cfg, Config)


# --------------------------------------------------------------------------- data rows

JSONISH = st.recursive(st.one_of(st.none(), st.booleans(), st.integers(), st.text(max_size=12),
                                 st.floats(allow_nan=False)),
                       lambda inner: st.one_of(st.lists(inner, max_size=3),
                                               st.dictionaries(st.text(max_size=8), inner,
                                                               max_size=3)), max_leaves=6)
MESSAGE = st.one_of(
    st.fixed_dictionaries({"role": st.sampled_from([*datafile.ROLES, "gpt", "robot", ""]),
                           "content": st.one_of(st.text(max_size=20), st.none(), JSONISH)}),
    st.fixed_dictionaries({"from": st.sampled_from(["human", "gpt", "system", "x"]),
                           "value": st.text(max_size=20)}),
    JSONISH,
)
ROW = st.one_of(
    st.fixed_dictionaries({"text": st.one_of(st.text(max_size=40), JSONISH)}),
    st.fixed_dictionaries({"messages": st.one_of(st.lists(MESSAGE, max_size=4), JSONISH)}),
    st.fixed_dictionaries({"conversations": st.lists(MESSAGE, max_size=4)}),
    st.dictionaries(st.text(max_size=8), JSONISH, max_size=3),
)


def _csv(rows: list[dict]) -> bytes:
    import csv
    import io

    out = io.StringIO()
    writer = csv.writer(out)
    writer.writerow(["text"])
    for row in rows:
        writer.writerow([json.dumps(v) if not isinstance(v, str) else v for v in row.values()])
    return out.getvalue().encode()


FILES = st.one_of(
    st.tuples(st.just(".jsonl"), st.lists(ROW, max_size=6).map(
        lambda rows: "".join(json.dumps(r) + "\n" for r in rows).encode())),
    st.tuples(st.just(".json"), st.lists(st.one_of(ROW, JSONISH), max_size=6).map(
        lambda rows: json.dumps(rows).encode())),
    st.tuples(st.just(".csv"), st.lists(ROW, max_size=6).map(_csv)),
    st.tuples(st.sampled_from([".jsonl", ".json", ".csv"]), st.binary(max_size=60)),
)
DATA = st.fixed_dictionaries({"format": st.sampled_from(["auto", "text", "messages"]),
                              "train_on": st.sampled_from(["assistant", "all"])})


@given(file=FILES, data=DATA, name=st.sampled_from(["rows", "rows [v2] {x}", "rows $HOME *"]))
@FUZZ
def test_data_rows_load_or_are_one_line(tmp_path, monkeypatch, file, data, name):
    """Both readers: the check's (the standard library) and the ranks' (datasets, its cache in
    the temporary folder)."""
    monkeypatch.setenv("KIT_HOME", str(tmp_path / "home"))
    suffix, content = file
    path = tmp_path / f"{name}{suffix}"
    path.write_bytes(content)
    cfg = DataConfig(path=str(path), **data)
    with writes_only_under(tmp_path):
        for stdlib in (True, False):
            rows = one_line_or_nothing(datafile.read_checked, str(path), cfg, stdlib=stdlib)
            assert rows is None or (rows and all(isinstance(r, dict) for r in rows))


# --------------------------------------------------------------------------- model folders

def _damage(folder: Path, how: str, where: float, text: str) -> None:
    """One kind of damage to a good model folder; `where` (0..1) and `text` vary it."""
    weights = folder / "model.safetensors"
    if how == "delete":
        names = sorted(p.name for p in folder.iterdir())
        (folder / names[int(where * (len(names) - 1))]).unlink()
    elif how == "truncate":
        data = weights.read_bytes()
        weights.write_bytes(data[:int(where * len(data))])
    elif how == "flip":  # one byte of the header (its length or its JSON) changed
        data = bytearray(weights.read_bytes())
        at = int(where * (8 + int.from_bytes(data[:8], "little")))
        data[at] = (data[at] + 1 + int(where * 254)) % 256
        weights.write_bytes(bytes(data))
    elif how == "append":
        weights.write_bytes(weights.read_bytes() + text.encode())
    elif how == "config":
        (folder / "config.json").write_text(text)
    elif how == "index":
        header = json.loads(weights.read_bytes()[8:8 + int.from_bytes(weights.read_bytes()[:8],
                                                                      "little")])
        weights.rename(folder / "a.safetensors")
        shards = ["a.safetensors", "b.safetensors", text or "c", "../a.safetensors"]
        keys = [k for k in header if k != "__metadata__"] + ["extra"]
        (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {
            k: shards[int(where * 7 + i) % len(shards)] for i, k in enumerate(keys)}}))


CONFIG_TEXT = st.one_of(
    st.text(max_size=40),
    JSONISH.map(json.dumps),
    st.dictionaries(st.sampled_from(["model_type", "vocab_size", "hidden_size",
                                     "num_hidden_layers", "auto_map", "architectures"]),
                    st.one_of(st.sampled_from(["llama", "nopeformer", ""]), JSONISH),
                    max_size=4).map(json.dumps),
)


@pytest.fixture(scope="module")
def good_model() -> Path:
    """kit:tiny-llama's folder, read once before any recording: the libraries' imports make
    their own caches (torch's inductor folder), which are not the checks' writes."""
    folder = builtin.resolve("kit:tiny-llama")
    assert checks.read(str(folder)) == {**checks.read(str(folder)), "config": None,
                                              "tokenizer": None}
    return folder


@given(how=st.sampled_from(["delete", "truncate", "flip", "append", "config", "index"]),
       where=st.floats(min_value=0, max_value=1), text=CONFIG_TEXT)
@settings(FUZZ, max_examples=80)
def test_a_broken_model_folder_is_one_line_or_loads(tmp_path, good_model, how, where, text):
    """The check's own steps on it: sources.check_model (config.json), checks.read
    (AutoConfig and the tokenizer, as the ranks read them) and check_weights (headers, sizes)."""
    folder = tmp_path / "model"
    shutil.rmtree(folder, ignore_errors=True)
    shutil.copytree(good_model, folder)
    _damage(folder, how, where, text)
    with writes_only_under(tmp_path):
        if _refused(sources.check_model, str(folder)):  # config.json missing or not JSON
            return
        found = checks.read(str(folder))
        for refusal in (found["config"], found["tokenizer"]):
            assert refusal is None or (refusal and "\n" not in refusal), refusal
        one_line_or_nothing(model_folder.check_weights, str(folder))


def _refused(fn, *args) -> bool:
    try:
        fn(*args)
    except ConfigError as e:
        assert "\n" not in str(e)
        return True
    return False
