"""What setup.sh installs: the lock's versions, and a notebook kernel of this environment."""

from __future__ import annotations

import importlib.metadata as md
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import ROOT


def pins(path: Path) -> dict[str, str]:
    found = {}
    for line in path.read_text().splitlines():
        line = line.split("#")[0].strip()
        if "==" in line:
            name, version = line.split("==")
            found[re.sub(r"[-_.]+", "-", name).lower()] = version
    return found


def test_the_suite_runs_on_the_locked_versions():
    """Where setup.sh installed torch itself (a CPU machine), every package of constraints.txt is
    at its locked version: what CI tests is what a user installs. On a machine with its own torch
    the torch-coupled packages are constraints-gpu.txt's instead."""
    lock = pins(ROOT / "constraints.txt")
    if md.version("torch").split("+")[0] != lock["torch"]:
        pytest.skip(f"torch {md.version('torch')} is the machine's own (constraints-gpu.txt applies)")
    def installed(name: str) -> str | None:  # the first on sys.path, as an import finds it
        try:
            return md.version(name).split("+")[0]
        except md.PackageNotFoundError:
            return None

    moved = {name: (want, installed(name)) for name, want in lock.items() if installed(name) != want}
    assert not moved, f"installed versions differ from constraints.txt (locked, installed): {moved}"


def test_every_requirement_is_locked():
    """Each range in requirements.txt has a locked version inside it in both lock files' union."""
    from packaging.requirements import Requirement

    lock = pins(ROOT / "constraints.txt")
    for line in (ROOT / "requirements.txt").read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            req = Requirement(line)
            name = re.sub(r"[-_.]+", "-", req.name).lower()
            assert name in lock and req.specifier.contains(lock[name], prereleases=True), line
    for name in pins(ROOT / "constraints-gpu.txt"):
        assert name in lock, f"constraints-gpu.txt pins {name}, which the kit does not install"


def test_the_notebook_kernel_is_this_environments(tmp_path):
    """A user-global python3 kernel written by another checkout's setup (here: one pointing at a
    Python that does not exist) does not take over: kit.run.tour's kernel is this environment's."""
    stale = tmp_path / "user" / "kernels" / "python3"
    stale.mkdir(parents=True)
    (stale / "kernel.json").write_text(json.dumps({
        "argv": ["/elsewhere/venv/bin/python3", "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "Python 3", "language": "python"}))
    env = {"JUPYTER_DATA_DIR": str(tmp_path / "user"), "PATH": "/usr/bin:/bin"}
    proc = subprocess.run([sys.executable, "-c", "from kit.run import tour; print(tour.kernel_python())"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert Path(proc.stdout.strip()).parent == Path(sys.executable).parent, proc.stdout


def _headless(tmp_path, cell: str):
    """One cell's notebook run by kit.run.tour.run in a fresh interpreter: (process, output nb)."""
    import nbformat

    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(cell)])
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nbformat.write(nb, str(tmp_path / "n.ipynb"))
    code = ("import sys; from pathlib import Path; from kit.run import tour; "
            f"o = tour.run(Path({str(tmp_path / 'n.ipynb')!r}), Path({str(tmp_path / 'o.ipynb')!r})); "
            "sys.exit(0 if o.ok else 1)")  # fmt: skip
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    return proc, nbformat.read(str(tmp_path / "o.ipynb"), as_version=4)


def test_a_headless_run_says_nothing_on_stderr(tmp_path):
    """kit.run.tour.run's kernel talks over local IPC sockets: over TCP ipykernel warned on
    stderr, at every notebook's start, that its traffic was unencrypted."""
    proc, out = _headless(tmp_path, "print(6 * 7)")
    assert proc.stderr == ""
    assert out.cells[0].outputs[0]["text"] == "42\n"


def test_a_headless_kernels_own_stderr_is_passed_on_less_libzmqs_teardown_assertion(tmp_path):
    """What the kernel process itself writes on stderr (not its cells' output: that reaches the
    notebook) is passed on after it exits; libzmq's assertion while ipykernel closes its sockets
    at exit is dropped, and kept if the kernel wrote it before the shutdown request."""
    from kit.run import tour

    cell = ("import atexit, os; os.write(2, b'from the kernel itself\\n'); print(6 * 7)\n"
            "atexit.register(os.write, 2, b'Assertion failed: pfd.revents & POLLIN "
            "(src/signaler.cpp:238)\\n')")  # what libzmq writes, at the kernel's exit
    proc, _ = _headless(tmp_path, cell)
    assert proc.stderr == "from the kernel itself\n"
    zmq = b"Assertion failed: pfd.revents & POLLIN (src/signaler.cpp:238)\n"
    data = b"a warning\n" + zmq
    assert tour.kernel_stderr_lines(data, teardown_at=len(b"a warning\n")) == ["a warning"]
    assert tour.kernel_stderr_lines(data, teardown_at=None) == ["a warning", zmq.decode().strip()]
    assert tour.kernel_stderr_lines(zmq + b"after\n", 0) == ["after"]
