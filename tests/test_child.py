"""kit.run.child: a function of a module run in a fresh process, its JSON result back, its failures in
one line, and a timeout that leaves no process of its tree alive (grandchildren included, even
one that started a session of its own, as torchrun's ranks do)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time

import pytest
from conftest import ROOT, alive

from kit.run import child

TARGETS = '''
import os, subprocess, sys, time

def add(a, b, note=""):
    print("chatter on stdout must not spoil the result")
    return {"sum": a + b, "pair": (a, b), "note": note, "pid": os.getpid()}

def fail():
    print("context the caller needs", file=sys.stderr)
    raise ValueError("bad value:\\n  second line")

def die():
    os._exit(3)

def hang(pid_file, own_session):
    """A grandchild that sleeps (in this group, or in a session of its own), then sleep."""
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"],
                               start_new_session=own_session)
    with open(pid_file, "w") as f:
        f.write(str(sleeper.pid))
    time.sleep(600)
'''


@pytest.fixture
def env(tmp_path):
    (tmp_path / "child_targets.py").write_text(textwrap.dedent(TARGETS))
    return {"PYTHONPATH": str(tmp_path)}


def test_result_comes_back_as_json(env):
    got = child.call("child_targets:add", a=1, b=2, note="x", env=env, timeout=60)
    assert got["sum"] == 3 and got["pair"] == [1, 2] and got["note"] == "x"
    assert got["pid"] != os.getpid()


def test_a_raised_error_is_one_line_then_the_stderr_tail(env):
    with pytest.raises(child.ChildFailed) as e:
        child.call("child_targets:fail", env=env, timeout=60)
    first, rest = str(e.value).split("\n", 1)
    assert first == ("child_targets:fail failed in its child process: "
                     "ValueError: bad value: second line")  # fmt: skip
    assert e.value.message == "ValueError: bad value: second line"
    assert "context the caller needs" in rest and 'raise ValueError("bad value' in rest


def test_a_child_that_dies_without_a_result(env):
    with pytest.raises(child.ChildFailed, match="exited with 3 without a result"):
        child.call("child_targets:die", env=env, timeout=60)
    with pytest.raises(child.ChildFailed, match="ModuleNotFoundError: No module named 'nowhere'"):
        child.call("nowhere:f", timeout=60)
    with pytest.raises(ValueError, match="expected 'module:function'"):
        child.call("kit.lab.hardware.collect")


@pytest.mark.parametrize("own_session", [False, True], ids=["same-group", "own-session"])
def test_timeout_kills_the_whole_tree(env, tmp_path, own_session):
    pid_file = tmp_path / "grandchild.pid"
    start = time.monotonic()
    with pytest.raises(TimeoutError, match=r"child_targets:hang: stopped after 4s"):
        child.call("child_targets:hang", pid_file=str(pid_file), own_session=own_session,
                   env=env, timeout=4)  # fmt: skip
    assert time.monotonic() - start < 20
    grandchild = int(pid_file.read_text())
    deadline = time.monotonic() + 5
    while alive(grandchild) and time.monotonic() < deadline:
        time.sleep(0.1)
    if alive(grandchild):
        os.kill(grandchild, 9)  # this test's own leftover; then fail
        pytest.fail(f"grandchild {grandchild} outlived the timeout")


def test_command_line_prints_the_result_alone():
    out = subprocess.run([sys.executable, "-m", "kit.run.child", "kit.folder.jsonl:read", '{"path": "none"}'],
                         cwd=ROOT, capture_output=True, text=True, timeout=60)  # fmt: skip
    assert (out.returncode, out.stdout) == (0, '{"result": []}')
