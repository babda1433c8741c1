"""No config value runs as code (issue 57): every string field of the schema, set to shell and
YAML metacharacters, newlines and `$(...)`, is either written into run.sh, config.yaml and the
`kit jobs` files as data, or refused in one ConfigError line; a YAML key given twice is refused;
of simultaneous starts of one run name exactly one claims the folder; an unwritable folder is
one line."""

from __future__ import annotations

import dataclasses
import json
import os
import socket
import stat
import subprocess
import threading
import typing
from pathlib import Path
from typing import Literal, get_args, get_origin

import pytest
import yaml

from kit.config import Config, ConfigError, config_from_dict, load_config
from kit.folder import runfolder
from kit.run import door, jobs
from kit.run.launch import prepare
from kit.run.quoting import comment, sbatch_value, shell_word, yaml_scalar


def string_fields(cls: type = Config, prefix: str = "") -> list[str]:
    """Every field of the schema a string can be given to (str, a Literal of strings, a union
    or list holding one), found from the dataclasses themselves."""
    found = []
    for f in dataclasses.fields(cls):
        tp = typing.get_type_hints(cls)[f.name]
        if dataclasses.is_dataclass(tp):
            found += string_fields(tp, f"{prefix}{f.name}.")
        elif _takes_str(tp):
            found.append(f"{prefix}{f.name}")
    return found


def _takes_str(tp) -> bool:
    if tp is str:
        return True
    if get_origin(tp) is Literal:
        return any(isinstance(a, str) for a in get_args(tp))
    return any(_takes_str(a) for a in get_args(tp))


def payloads(marker: Path) -> list[str]:
    """Values that would run `touch marker` if a generator let the shell read them as code, and
    YAML's own metacharacters, where YAML reads them (at the start, after ': ', ' #')."""
    touch = f"touch {marker}"
    return [f"$({touch})`{touch}`; {touch}", f"a' ; {touch}; '\"{{}}", "x #not a comment: - y",
            "key: value", "- item", "'", '"', "{}", f"a\n{touch}", f"$({touch})\r\n",
            f"a\x00{touch}"]


def one_line(error: Exception) -> str:
    text = str(error)
    assert text and "\n" not in text, text
    return text


def set_field(tree: dict, field: str, value) -> None:
    *sections, key = field.split(".")
    node = tree
    for s in sections:
        node = node[s]
    node[key] = value


def tree_for(fields: dict) -> dict:
    tree = Config().to_dict()
    tree["training"]["device"] = "cpu"
    for field, value in fields.items():
        set_field(tree, field, value)
    return tree


@pytest.fixture(scope="module")
def accepted(tmp_path_factory) -> tuple[Path, list[tuple[str, Config]]]:
    """Each payload alone in each string field: refused in one line naming the field, or
    accepted; then per payload one Config holding it in every field that accepts it (the
    generators are run once per payload, not once per field)."""
    tmp = tmp_path_factory.mktemp("trust")
    found = []
    for m, value in enumerate(payloads(tmp / "EXECUTED")):
        takes = {}
        for field in string_fields():
            given = str(tmp / f"run-{m}" / value) if field == "run.output_dir" else value
            try:
                config_from_dict(tree_for({field: given}))
                takes[field] = given
            except ConfigError as e:
                assert one_line(e).startswith(field), e
        if any(c in value for c in "\n\r\x00"):
            assert not takes, takes
            continue
        assert {"run.output_dir", "model.name", "data.path", "training.resume"} <= set(takes)
        resume = takes.pop("training.resume")  # a path to a checkpoint: the plan refuses it
        with pytest.raises(ConfigError) as e:
            prepare(config_from_dict(tree_for({"run.output_dir": str(tmp / "resume"),
                                                     "training.resume": resume})))
        assert one_line(e.value).startswith("training.resume: ")
        found.append((value, config_from_dict(tree_for(takes))))
    return tmp, found


def test_control_characters_are_refused_in_every_string_field():
    for field in string_fields():
        for value in ("a\nb", "a\rb", "a\tb", "a\x00b", "a\x1bb", "a\u2028b"):
            tree = Config().to_dict()
            set_field(tree, field, value if field != "lora.target_modules" else [value])
            with pytest.raises(ConfigError) as e:
                config_from_dict(tree)
            assert one_line(e.value).startswith(field) and repr(value) in str(e.value)


def test_a_control_character_in_an_override_is_one_line():
    from kit.config import load_config

    for item in ("training.st\neps=1", "training.steps=1\n2", "run.name=a\x1bb"):
        with pytest.raises(ConfigError) as e:
            load_config("tiny-cpu", [item])
        assert "\n" not in str(e.value), item  # one line, the key or value as written (repr)


def run_sh(folder: Path, tmp: Path) -> list[list[str]]:
    """Execute the folder's run.sh with a stand-in python that records its arguments and exits
    0: every line of run.sh runs (check step, environment, torchrun's command), nothing more."""
    record = tmp / "args.bin"
    record.unlink(missing_ok=True)
    stub = tmp / "python"
    if not stub.exists():
        stub.write_text('#!/usr/bin/env bash\nprintf "%s\\0" "$@" >> "$ARGS_FILE"\n'
                        'printf "\\n\\0" >> "$ARGS_FILE"\n')
        stub.chmod(stub.stat().st_mode | stat.S_IEXEC)
    env = {**os.environ, "PYTHON": str(stub), "ARGS_FILE": str(record)}
    env.pop("NNODES", None)
    proc = subprocess.run(["bash", str(folder / "run.sh")], capture_output=True, text=True,
                          env=env, cwd=tmp, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    calls = record.read_bytes().decode().split("\n\0")
    return [c.split("\0")[:-1] for c in calls if c]


def test_every_string_field_is_data_in_run_sh_and_config_yaml(accepted):
    tmp, found = accepted
    for value, cfg in found:
        folder = prepare(cfg, nproc=2)
        assert subprocess.run(["bash", "-n", str(folder / "run.sh")]).returncode == 0
        tree = yaml.safe_load((folder / "config.yaml").read_text())
        assert load_config(folder / "config.yaml").to_dict() == cfg.to_dict() == tree
        assert tree["model"]["name"] == tree["data"]["path"] == value
        check, torchrun = run_sh(folder, tmp)  # every line of it runs
        assert check[:3] == ["-m", "kit.run.check", f"{folder}/config.yaml"]
        given = [a for a in check + torchrun if a.startswith("run.output_dir=")]
        assert len(given) == 2 and all(  # read back as the ranks read an override
            load_config(None, [a]).run.output_dir == str(folder) for a in given)
        runfolder.release(folder / runfolder.CLAIM)
    assert len(found) == 8 and not (tmp / "EXECUTED").exists()


def test_every_string_field_is_data_in_the_kit_jobs_files(accepted):
    tmp, found = accepted
    written = 0
    for value, cfg in found:
        cfg = config_from_dict(cfg.to_dict())  # the fixture's stays as it is
        try:
            folder = jobs.write(cfg, nnodes=2, nproc_per_node=2)
        except ConfigError as e:  # Slurm cannot name a folder with spaces or quotes
            assert one_line(e).startswith("run.output_dir (--out): "), e
            cfg.run.output_dir = str(tmp / "jobs" / str(written))  # the other fields still
            # reach every file
            folder = jobs.write(cfg, nnodes=2, nproc_per_node=2)
        written += 1
        for name in ("run.sh", "job.sbatch"):
            assert subprocess.run(["bash", "-n", str(folder / name)]).returncode == 0
        for name in ("accelerate.yaml", "trainjob.yaml", "pytorchjob.yaml"):
            yaml.safe_load((folder / name).read_text())  # comments stay comments
        manifest = yaml.safe_load((folder / "trainjob.yaml").read_text())
        assert manifest["spec"]["trainer"]["command"][1] == f"{jobs._pod_dir(folder)}/run.sh"
        assert load_config(folder / "config.yaml").model.name == value
    assert written == 8 and not (tmp / "EXECUTED").exists()


def test_quoting_round_trips():
    for value in ["plain", "a b", "$(x)", "`x`", "a'b", 'a"b', "{}", "#x", "a: b", "- x", "",
                  "yes", "1e3", "a\nb", "\u2028"]:
        assert subprocess.run(["bash", "-c", f"printf %s {shell_word(value)}"],
                              capture_output=True, text=True).stdout == value
        assert yaml.safe_load(f"key: {yaml_scalar(value)}") == {"key": value}
        assert "\n" not in yaml_scalar(value) and "\n" not in comment(value)
        assert "\u2028" not in comment(value)
    assert sbatch_value("/r/%x", "f", pattern=True) == "/r/%%x"
    with pytest.raises(ConfigError, match="^f: 'a b' is not allowed"):
        sbatch_value("a b", "f")


def test_a_start_through_the_front_door_trains_with_metacharacters_as_data(tmp_path, capsys):
    """One real run (`kit train`'s own main): its folder's name full of shell and YAML
    metacharacters; a value with a newline is one line on stderr, before anything is written."""
    marker = tmp_path / "EXECUTED"
    weird = tmp_path / f"a b$(touch {marker})`touch {marker}`;'\"{{}}#x: - y"
    bad = door.main(["tiny-cpu", f"run.output_dir={yaml_scalar(f'{weird}' + chr(10) + 'x')}"])
    err = capsys.readouterr().err
    assert bad == 2 and err.count("\n") == 1 and err.startswith("ConfigError: run.output_dir:")
    assert not any(tmp_path.iterdir())  # nothing written
    rc = door.main(["tiny-cpu", f"run.output_dir={yaml_scalar(str(weird))}", "training.steps=1",
                    "training.eval_every=0", "checkpointing.save_probe_logits=false",
                    "--nproc", "1"])
    assert rc == 0, capsys.readouterr()
    assert json.loads((weird / "result.json").read_text())["status"] == "completed"
    assert not marker.exists()


def test_a_key_given_twice_is_refused_naming_key_and_file(tmp_path, capsys):
    path = tmp_path / "twice.yaml"
    path.write_text("training:\n  steps: 3\nmodel:\n  name: kit:tiny-llama\ntraining:\n  lr: 1\n")
    with pytest.raises(ConfigError) as e:
        load_config(path)
    assert one_line(e.value).startswith(f"config file: {str(path)!r} line 5: key 'training'")
    path.write_text("lora:\n  r: 4\n  r: 8\n")
    assert door.main([str(path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "key 'r' is given twice" in err and str(path) in err
    path.write_text("base: &b {r: 4}\nlora:\n  <<: *b\n  r: 8\n")  # a merge key may be overridden
    with pytest.raises(ConfigError, match="base: unknown key"):
        load_config(path)


def tiny(folder: Path) -> Config:
    return load_config("tiny-cpu", [f"run.output_dir={folder}"])


def test_simultaneous_starts_of_one_run_give_one_run_and_one_refusal(tmp_path):
    for attempt in range(25):
        cfg, starts = tiny(tmp_path / f"r{attempt}"), 4
        barrier, won, refused = threading.Barrier(starts), [], []

        def start(cfg=cfg, barrier=barrier, won=won, refused=refused):
            barrier.wait()
            try:
                won.append(prepare(cfg, nproc=2))
            except runfolder.FolderRefused as e:
                refused.append(one_line(e))

        threads = [threading.Thread(target=start) for _ in range(starts)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert len(won) == 1 and len(refused) == starts - 1, (won, refused)
        assert all(f"is being started by pid {os.getpid()} on host {socket.gethostname()}"
                   in line for line in refused)
        assert sorted(p.name for p in won[0].iterdir()) == [".claim", "config.yaml", "run.sh"]


def test_a_claim_of_a_process_that_is_gone_does_not_block(tmp_path):
    folder = tmp_path / "r"
    folder.mkdir()
    sleeper = subprocess.Popen(["sleep", "60"])
    try:
        started = runfolder._create_time(sleeper.pid)
        (folder / ".claim").write_text(json.dumps({
            "pid": sleeper.pid, "host": socket.gethostname(), "owner": f"{sleeper.pid}/1",
            "started": started, "nonce": "x", "at": "then"}))
        with pytest.raises(runfolder.FolderRefused, match=f"by pid {sleeper.pid} on host"):
            prepare(tiny(folder), nproc=2)
        assert sorted(p.name for p in folder.iterdir()) == [".claim"]  # nothing else written
    finally:
        sleeper.kill()
        sleeper.wait()
    assert prepare(tiny(folder), nproc=2) == folder  # its process is gone: taken over
    assert json.loads((folder / ".claim").read_text())["pid"] == os.getpid()


def test_an_unwritable_run_folder_is_one_line(tmp_path, capsys):
    blocker = tmp_path / "file"  # a folder below a file fails for root too, unlike chmod
    blocker.write_text("not a folder\n")
    with pytest.raises(ConfigError) as e:
        prepare(tiny(blocker / "run"), nproc=2)
    assert one_line(e.value).startswith(f"run.output_dir: {str(blocker / 'run')!r} cannot be "
                                        "written")
    assert door.main(["tiny-cpu", f"run.output_dir={blocker / 'run'}"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "is a file, not a folder" in err
    assert blocker.read_text() == "not a folder\n"
    (tmp_path / "busy").mkdir()  # a refused start leaves the folder as it was
    (tmp_path / "busy" / ".claim").write_text(json.dumps(
        {"pid": 1, "host": socket.gethostname(), "owner": "1/1", "nonce": "y", "at": "then"}))
    with pytest.raises(runfolder.FolderRefused):
        prepare(tiny(tmp_path / "busy"), nproc=2)
    assert sorted(os.listdir(tmp_path / "busy")) == [".claim"]
