"""What a user hands the kit, checked as the ranks will read it, refused in one line before any
rank, on every path (issue 57, items 4 and 5).

A model folder (kit.inputs.model_folder): config.json, what transformers makes of it, the
weights' headers and sizes, the tokenizer. A data file (kit.inputs.datafile): bytes that are not
UTF-8, chats with nothing to train on, names datasets would glob or expand. Then every refusal the
check knows (tests/test_check.py's CASES and the ones here) through bare `python -m kit.train`
and `torchrun -m kit.train`: the one kit line, exit 2, no traceback, nothing written."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import ROOT, TINY
from test_check import CASES as CHECK_CASES

from kit.config import ConfigError, load_config
from kit.inputs import builtin, checks, datafile, model_folder
from kit.run import check

SHORT = ["training.steps=1", "training.eval_every=0", "checkpointing.save_adapter=false"]


def model_copy(tmp: Path, change=None) -> Path:
    """kit:tiny-llama's folder (config.json, tokenizer, model.safetensors) copied, then changed."""
    folder = tmp / "model"
    shutil.copytree(builtin.resolve("kit:tiny-llama"), folder)
    if change:
        change(folder)
    return folder


def _rewrite_config(**values):
    def change(folder: Path):
        config = json.loads((folder / "config.json").read_text())
        (folder / "config.json").write_text(json.dumps({**config, **values}))
    return change


def _truncate(folder: Path):
    weights = folder / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-1000])


def _shard(folder: Path, drop_second: bool = True, rename: bool = False):
    """model.safetensors as the first of two shards named by an index; the second is missing."""
    header = model_folder.check_safetensors(folder / "model.safetensors", "")
    (folder / "model.safetensors").rename(folder / "model-1.safetensors")
    names = [k for k in header if k != "__metadata__"]
    weight_map = {k: "model-1.safetensors" for k in names}
    weight_map[names[0]] = "model-2.safetensors"
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))


def _not_json(folder: Path):
    (folder / "config.json").write_text('{"model_type": "llama",\n  "hidden_size": }\n')


MODEL_CASES = {  # name: (what is done to a good folder, what the one line says)
    "config_not_json": (_not_json, "config.json line 2 column 18 is not valid JSON"),
    "unknown_model_type": (_rewrite_config(model_type="nopeformer"),
                           "config.json has model_type 'nopeformer', which transformers "),
    "no_weights": (lambda f: (f / "model.safetensors").unlink(), "has no weights"),
    "truncated_weights": (_truncate, "model.safetensors is truncated ("),
    "index_names_a_missing_shard": (_shard, "model.safetensors.index.json names the shard "
                                    "'model-2.safetensors', which is not a file of the folder"),
    "no_tokenizer": (lambda f: [(f / n).unlink() for n in ("tokenizer.json",
                                                          "tokenizer_config.json")],
                     "its tokenizer cannot be loaded"),
}


@pytest.mark.parametrize("case", MODEL_CASES)
def test_a_model_folder_is_refused_in_one_line_naming_its_file(case, tmp_path):
    """As the ranks check it (kit.inputs.checks.check, transformers read in this process)."""
    change, says = MODEL_CASES[case]
    folder = model_copy(tmp_path, change)
    cfg = load_config(TINY, [f"model.name={folder}"])
    with pytest.raises(ConfigError) as err:
        checks.check(cfg, lambda: check.model_read(cfg, in_process=True))
    line = str(err.value)
    assert "\n" not in line and line.startswith(f"model.name: '{folder}'") and says in line, line


def test_a_good_model_folder_passes_and_kit_check_names_an_unknown_model_type(tmp_path):
    """The check step's own path (transformers read in a child process): a folder as
    save_pretrained wrote it passes; an unknown model_type is one line on stderr, exit 2."""
    good = load_config(TINY, [f"model.name={model_copy(tmp_path / 'good')}"])
    checks.check(good, lambda: check.model_read(good))
    folder = model_copy(tmp_path, _rewrite_config(model_type="nopeformer"))
    proc = subprocess.run([sys.executable, "-m", "kit.run.check", str(TINY),
                           f"model.name={folder}", f"run.output_dir={tmp_path / 'run'}"],
                          capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    assert proc.stderr.startswith(f"ConfigError: model.name: '{folder}': config.json has "
                                  "model_type 'nopeformer', which transformers "), proc.stderr
    assert not (tmp_path / "run").exists()


def test_an_index_whose_shard_lacks_a_tensor_it_names_is_refused(tmp_path):
    folder = model_copy(tmp_path, _shard)
    shutil.copy(folder / "model-1.safetensors", folder / "model-2.safetensors")  # no shard 2's
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {
        "not.a.tensor": "model-2.safetensors"}}))
    with pytest.raises(ConfigError, match="puts 'not.a.tensor' in model-2.safetensors, whose "
                       "header has no such tensor"):
        model_folder.check_weights(str(folder))


def test_a_tensor_whose_bytes_do_not_match_its_shape_is_refused(tmp_path):
    folder = model_copy(tmp_path)
    weights = folder / "model.safetensors"
    data = weights.read_bytes()
    length = int.from_bytes(data[:8], "little")
    header = json.loads(data[8:8 + length])
    name = next(k for k in header if k != "__metadata__")
    header[name]["shape"] = [s + 1 for s in header[name]["shape"]]
    raw = json.dumps(header, separators=(",", ":")).encode()
    assert len(raw) <= length
    raw = raw.ljust(length)  # same length (padded with spaces, as safetensors pads): a wrong shape
    weights.write_bytes(data[:8] + raw + data[8 + length:])
    with pytest.raises(ConfigError, match=f"model.safetensors has tensor '{name}' of "):
        model_folder.check_weights(str(folder))


# --------------------------------------------------------------------------- data files

def _write(tmp: Path, name: str, data: bytes) -> str:
    path = tmp / name
    path.write_bytes(data)
    return str(path)


CHAT = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}
NO_REPLY = {"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]}
DATA_CASES = {  # name: (data.path's bytes, file name, what the one line says)
    "not_utf8": (b'{"text": "fine"}\n{"text": "caf\xe9"}\n', "rows.jsonl",
                 "line 2: not UTF-8 (byte 0xe9 at column 14)"),
    "not_utf8_csv": (b"text\nfine\n\xff\n", "rows.csv", "line 3: not UTF-8 (byte 0xff at column 1)"),
    "chat_without_assistant": ("\n".join(json.dumps(r) for r in [CHAT] * 20 + [NO_REPLY] * 2)
                               .encode(), "chat.jsonl",
                               "row 21 (line 21): 'messages' has no assistant message with "
                               "content: nothing in it trains (1 more bad row: 22)"),
}


@pytest.mark.parametrize("case", DATA_CASES)
def test_a_data_file_is_refused_in_one_line_naming_file_and_line(case, tmp_path):
    data, name, says = DATA_CASES[case]
    path = _write(tmp_path, name, data)
    cfg = load_config(None, [f"data.path={path}"])
    for stdlib in (True, False):  # the check's reader and the ranks' (datasets)
        with pytest.raises(ConfigError) as err:
            datafile.read_checked(path, cfg.data, stdlib=stdlib)
        line = str(err.value)
        assert "\n" not in line and line.startswith(f"data.path: '{path}' ") and says in line, line


def test_chat_rows_without_a_reply_train_when_every_token_does(tmp_path):
    path = _write(tmp_path, "chat.jsonl", json.dumps(NO_REPLY).encode())
    cfg = load_config(None, [f"data.path={path}", "data.train_on=all"])
    assert datafile.read_checked(path, cfg.data, stdlib=True) == [NO_REPLY]


@pytest.mark.parametrize("name", ["rows [v2] {final}.jsonl", "rows $HOME.jsonl", "rows*?.jsonl"])
def test_a_data_path_is_read_literally(name, tmp_path, monkeypatch):
    """No glob, no variable expansion, by either reader; a decoy the glob would match is not read."""
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    path = _write(tmp_path, name, b'{"text": "the file itself"}\n')
    _write(tmp_path, "rows v.jsonl", b'{"text": "a decoy"}\n')
    cfg = load_config(None, [f"data.path={path}"])
    for stdlib in (True, False):
        rows = datafile.read_checked(path, cfg.data, stdlib=stdlib)
        assert rows == [{"text": "the file itself"}]


# --------------------------------------------------------------------------- every path

REFUSALS = {  # every refusal of the check: tests/test_check.py's cases, and this file's
    **{name: (lambda t, o=overrides: o(t) if callable(o) else o, says)
       for name, (overrides, says) in CHECK_CASES.items()},
    **{f"model_{name}": (lambda t, c=change: [f"model.name={model_copy(t, c)}"], says)
       for name, (change, says) in MODEL_CASES.items()},
    **{f"data_{name}": (lambda t, d=data, n=name_: [f"data.path={_write(t, n, d)}"], says)
       for name, (data, name_, says) in DATA_CASES.items()},
}


def bare(tmp: Path, overrides: list[str], nproc: int = 0) -> subprocess.CompletedProcess:
    """python -m kit.train (nproc 0) or torchrun -m kit.train: no kit in front, nothing checked."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    front = ([sys.executable, "-m", "torch.distributed.run", "--standalone",
              f"--nproc_per_node={nproc}"] if nproc else [sys.executable])
    return subprocess.run([*front, "-m", "kit.train", str(TINY), f"run.output_dir={tmp / 'run'}",
                           *SHORT, *overrides], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=600)


def kit_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.strip()]


def test_every_refusal_of_the_check_is_one_line_from_bare_python_m_kit_train(tmp_path):
    """No front door: rank 0 checks before it plans (kit.inputs.checks, as the check step) and says
    the check's own line; nothing is written to the run folder. Every refusal, each its own
    `python -m kit.train` (forked from one interpreter that imported the libraries once:
    tests/bare_train.py)."""
    cases, expect = [], []
    for name, (make, says) in REFUSALS.items():
        tmp = tmp_path / name
        tmp.mkdir()
        cases.append({"argv": [str(TINY), f"run.output_dir={tmp / 'run'}", *SHORT,
                               *make(tmp)], "out": str(tmp / "out"), "err": str(tmp / "err")})
        expect.append((name, says, tmp))
    (tmp_path / "cases.json").write_text(json.dumps(cases))
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    proc = subprocess.run([sys.executable, str(ROOT / "tests" / "bare_train.py"),
                           str(tmp_path / "cases.json")], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr
    wrong = []
    for (name, says, tmp), code in zip(expect, json.loads(proc.stdout.splitlines()[-1]),
                                       strict=True):
        stderr = (tmp / "err").read_text()
        lines = kit_lines(stderr)
        if not (code == 2 and len(lines) == 1 and "Traceback" not in stderr
                and lines[0].startswith("[rank 0] ConfigError: ") and says in lines[0]
                and not (tmp / "run").exists()):
            wrong.append(f"{name}: exit {code}\n{stderr[-3000:]}")
    assert len(expect) == len(REFUSALS) > 20 and not wrong, "\n\n".join(wrong)


def test_bare_torchrun_gives_the_checks_line_for_a_mistake_it_used_to_trace_back(tmp_path):
    """Two ranks: rank 0 says the check's line (it used to be the planner's ValueError from
    kit.budget.shapes, traced back); rank 1 ends quietly. What follows is torchrun's own report
    of a worker that exited 2 (its ChildFailedError, a launcher's traceback with no frame of the
    kit): bare torchrun prints it for any failed worker."""
    make, says = REFUSALS["target_module_typo"]
    proc = bare(tmp_path, make(tmp_path), nproc=2)
    lines = kit_lines(proc.stderr)
    kit = [line for line in lines if "ConfigError" in line]
    assert proc.returncode != 0 and len(kit) == 1 and says in kit[0], proc.stderr
    assert kit[0].startswith("[rank 0] ConfigError: lora.target_modules: 'v_prj' matches no "
                             "module of kit:tiny-llama"), proc.stderr
    frames = [line for line in lines if line.strip().startswith('File "')]
    assert proc.stderr.count("Traceback") <= 1 and not [f for f in frames if "/kit/" in f], (
        proc.stderr)
    assert "ValueError" not in proc.stderr and "[rank0]:" not in proc.stderr, proc.stderr
    assert not (tmp_path / "run").exists()


# --------------------------------------------------------------------------- kit chat

def test_a_damaged_adapter_is_named_by_its_file_in_kit_chat(tmp_path, capsys):
    import numpy as np
    from safetensors.numpy import save_file

    from kit.inference import chat

    run = tmp_path / "run"
    (run / "adapter").mkdir(parents=True)
    (run / "config.yaml").write_text(load_config(TINY, [f"run.output_dir={run}"]).to_yaml())
    (run / "adapter" / "adapter_config.json").write_text(json.dumps({"r": 8, "peft_type": "LORA"}))
    weights = run / "adapter" / "adapter_model.safetensors"
    save_file({"a": np.zeros((8, 64), dtype=np.float32)}, str(weights))
    weights.write_bytes(weights.read_bytes()[:-100])
    assert chat.main([str(run), "--prompt", "hi"]) == 2
    said = capsys.readouterr().err
    assert said.count("\n") == 1 and said.startswith(
        f"chat: adapter: '{run / 'adapter'}': adapter_model.safetensors is truncated ("), said
    (run / "adapter" / "adapter_config.json").write_text("{'r': 8}")
    assert chat.main([str(run), "--prompt", "hi"]) == 2
    assert "adapter_config.json line 1 column 2 is not valid JSON" in capsys.readouterr().err
