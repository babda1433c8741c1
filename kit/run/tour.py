"""Run the notebooks in order, headless, with papermill: `python -m kit tour [-p key value]`.

Each notebook's `parameters` cell declares what can be changed (literals only); papermill injects
the given values after it. A value goes only to the notebooks that declare its name. Executed
copies land in launch/tour/ (ignored by git); the committed notebooks stay output-free.
"""

from __future__ import annotations

import ast
import contextlib
import os
import re
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
NOTEBOOKS = ROOT / "notebooks"
KEEP_OUTPUT = "keep_output"  # tag: a cell whose stored output is committed
CHECK_OUTPUT = "nbval-check-output"  # tag: nbval compares that stored output (--nbval-lax)


START = "00-start-here.ipynb"  # the course's plan: markdown only, nothing to run


def notebooks(folder: Path = NOTEBOOKS) -> list[Path]:
    """Stage notebooks NN-slug.ipynb and NNx-slug.ipynb (00a, 05a: one between NN and NN+1), in
    order; the start page (START) is not one."""
    return sorted(p for p in Path(folder).glob("[0-9][0-9]*-*.ipynb")
                  if p.name != START and re.fullmatch(r"\d\d[a-z]?-[\w-]+", p.stem))


def _read(path: Path):
    import nbformat

    return nbformat.read(str(path), as_version=4)


# The start page's study minutes: reading at 200 words a minute, half a minute to run and read
# each code cell, 3 minutes an exercise (a check cell). An estimate, stated on the start page.
WORDS_PER_MIN, MIN_PER_CELL, MIN_PER_EXERCISE = 200, 0.5, 3


def study_minutes(path: Path) -> int:
    """A learner's minutes for one notebook: its markdown words read, its code cells run and read,
    its exercises done (WORDS_PER_MIN, MIN_PER_CELL, MIN_PER_EXERCISE), rounded to 5."""
    cells = _read(path).cells
    words = sum(len(c.source.split()) for c in cells if c.cell_type == "markdown")
    code = [c.source for c in cells if c.cell_type == "code"]
    checks = sum(s.count("exercises.check(") for s in code)
    minutes = words / WORDS_PER_MIN + MIN_PER_CELL * len(code) + MIN_PER_EXERCISE * checks
    return max(5, 5 * round(minutes / 5))


def parameters_of(path: Path) -> dict:
    """The literals of the notebook's `parameters` cell; ValueError if it holds anything else."""
    cells = [c for c in _read(path).cells if "parameters" in c.metadata.get("tags", [])]
    if len(cells) != 1:
        raise ValueError(f"{path.name}: {len(cells)} cells tagged 'parameters', expected 1")
    values = {}
    for node in ast.parse(cells[0].source).body:
        if not (isinstance(node, ast.Assign) and len(node.targets) == 1
                and isinstance(node.targets[0], ast.Name)):  # fmt: skip
            raise ValueError(f"{path.name}: parameters cell may only assign names: {ast.unparse(node)}")
        try:
            values[node.targets[0].id] = ast.literal_eval(node.value)
        except ValueError:
            raise ValueError(f"{path.name}: parameter {ast.unparse(node)} is not a literal") from None
    return values


def stored_outputs(path: Path) -> list[int]:
    """Indices of code cells that carry outputs or an execution count without the keep_output tag."""
    return [
        i for i, c in enumerate(_read(path).cells)
        if c.cell_type == "code" and (c.outputs or c.execution_count is not None)
        and KEEP_OUTPUT not in c.metadata.get("tags", [])
    ]  # fmt: skip


def strip_outputs(path: Path) -> int:
    """Clear outputs and execution counts of every code cell not tagged keep_output (what
    nbstripout does, minus the cells nbval compares); returns how many cells changed."""
    import nbformat

    nb = _read(path)
    changed = 0
    for cell in nb.cells:
        if cell.cell_type == "code" and KEEP_OUTPUT not in cell.metadata.get("tags", []):
            if cell.outputs or cell.execution_count is not None:
                cell.outputs, cell.execution_count = [], None
                changed += 1
    if changed:
        nbformat.write(nb, str(path))
    return changed


def keep_outputs(path: Path, executed: Path) -> int:
    """Copy the outputs of the cells tagged keep_output (the ones nbval compares) from an executed
    copy of `path` (`python -m kit tour` writes them) into `path`, matched by cell id; every other
    cell stays as committed. How a maintainer records checked outputs after a change that moves
    them; returns how many cells changed."""
    import nbformat

    nb, ran = _read(path), {c.get("id"): c for c in _read(executed).cells}
    changed = 0
    for cell in nb.cells:
        if KEEP_OUTPUT in cell.metadata.get("tags", []) and cell.get("id") in ran:
            new = ran[cell.get("id")]
            new.outputs = _joined_streams(new.outputs)
            if (new.outputs, new.execution_count) != (cell.outputs, cell.execution_count):
                cell.outputs, cell.execution_count = new.outputs, new.execution_count
                changed += 1
    if changed:
        nbformat.write(nb, str(path))
    return changed


def _joined_streams(outputs: list) -> list:
    """Consecutive stream outputs of one name joined into one, as Jupyter shows them: a kernel may
    flush one cell's prints in one chunk or two, and a kept cell then changed shape from run to run
    (notebook 09's plan lines did). Gap filled: nbformat has no such helper; nbconvert's
    coalesce_streams preprocessor would add nbconvert for these lines."""
    joined: list = []
    for out in outputs:
        last = joined[-1] if joined else None
        if (last is not None and out.get("output_type") == last.get("output_type") == "stream"
                and out.get("name") == last.get("name")):
            last["text"] = last["text"] + out["text"]
        else:
            joined.append(out)
    return joined


@dataclass
class Outcome:
    notebook: str
    ok: bool
    seconds: float
    output: Path
    error: str = ""

    def line(self) -> str:
        status = "ok    " if self.ok else "FAILED"
        tail = f"  {self.error}" if self.error else ""
        return f"{status} {self.notebook:<34} {self.seconds:6.1f}s  {self.output}{tail}"


@contextlib.contextmanager
def this_environments_kernel():
    """Jupyter looks up the notebooks' kernel (python3) in this environment's prefix first, where
    setup.sh installs it, before the user-global folder that any other checkout's setup may have
    overwritten. Inside a venv Jupyter does so anyway; this makes it so for a plain Python too."""
    before = os.environ.get("JUPYTER_PREFER_ENV_PATH")
    os.environ["JUPYTER_PREFER_ENV_PATH"] = "1"
    try:
        yield
    finally:
        if before is None:
            del os.environ["JUPYTER_PREFER_ENV_PATH"]
        else:
            os.environ["JUPYTER_PREFER_ENV_PATH"] = before


def kernel_python() -> str:
    """The Python the notebooks' kernel runs, as kit.run.tour finds it."""
    from jupyter_client.kernelspec import KernelSpecManager

    with this_environments_kernel():
        return KernelSpecManager().get_kernel_spec("python3").argv[0]


def local_kernel_manager():
    """The kernel manager a headless run uses: on POSIX, the kernel talks over IPC sockets (files
    in the temporary folder, removed when it shuts down). Over TCP (the default) ipykernel warns at every start that its traffic is
    unencrypted, a line on stderr per notebook, though kernel and client share this machine.
    The kernel process's own stderr is passed on after it exits, less libzmq's teardown
    assertion (kernel_stderr_lines).
    Gap filled: papermill takes a manager class, but neither a transport nor a quiet shutdown."""
    import tempfile
    import uuid

    from jupyter_client.manager import AsyncKernelManager

    if os.name != "posix":
        return AsyncKernelManager

    class LocalKernelManager(AsyncKernelManager):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.transport = "ipc"
            self.ip = os.path.join(tempfile.gettempdir(), f"kit-kernel-{uuid.uuid4().hex[:12]}")

        async def _async_launch_kernel(self, kernel_cmd, **kw):
            # The kernel process's own stderr (its cells' output reaches the notebook, not this)
            # goes to a file, passed on when it has exited (kernel_stderr_lines).
            self._pass_on_stderr()
            self._stderr, self._teardown_at = tempfile.TemporaryFile(), None
            await super()._async_launch_kernel(kernel_cmd, **{**kw, "stderr": self._stderr})

        async def _async_shutdown_kernel(self, now=False, restart=False):
            if getattr(self, "_stderr", None) is not None:
                self._teardown_at = os.fstat(self._stderr.fileno()).st_size
            await super()._async_shutdown_kernel(now=now, restart=restart)

        shutdown_kernel = _async_shutdown_kernel  # AsyncKernelManager binds the base one by name

        async def _async_cleanup_resources(self, restart=False):
            await super()._async_cleanup_resources(restart=restart)
            self._pass_on_stderr()

        def _pass_on_stderr(self):
            if getattr(self, "_stderr", None) is None:
                return
            self._stderr.seek(0)
            data = self._stderr.read()
            self._stderr.close()
            self._stderr = None
            for line in kernel_stderr_lines(data, self._teardown_at):
                print(line, file=sys.stderr, flush=True)

        async def _async_interrupt_kernel(self):
            # jupyter_client interrupts before every shutdown request; an idle kernel then logs
            # "KeyboardInterrupt caught in kernel" on stderr. The shutdown request, then SIGTERM
            # and SIGKILL still follow when it is busy.
            if not self.shutting_down:
                await super()._async_interrupt_kernel()

    return LocalKernelManager


# libzmq now and then asserts in a poll of its own when ipykernel closes its sockets at exit
# (zeromq/libzmq#1307 and #3715: the poll reports the closed pipe, not data); the kernel has sent
# its shutdown reply by then. Measured: once in a fresh clone's test run, in the kernel of
# tests/test_setup.py's one-cell notebook, which ran and was saved.
ZMQ_TEARDOWN = re.compile(r"^Assertion failed: .+ \(src/signaler\.cpp:\d+\)$")


def kernel_stderr_lines(data: bytes, teardown_at: int | None) -> list[str]:
    """What a headless kernel wrote to its own stderr, less libzmq's assertion at its exit: the
    lines written after the shutdown request (byte `teardown_at` on) lose ZMQ_TEARDOWN's; one
    written while the notebook ran is kept (the kernel died there, and the run says so)."""
    cut = len(data) if teardown_at is None else min(teardown_at, len(data))
    before = data[:cut].decode(errors="replace").splitlines()
    after = data[cut:].decode(errors="replace").splitlines()
    return before + [line for line in after if not ZMQ_TEARDOWN.match(line)]


def run(path: Path, output: Path, parameters: dict | None = None, timeout: int = 900) -> Outcome:
    """Execute one notebook headless (kernel started in its folder, as Jupyter does)."""
    import papermill

    output.parent.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    try:
        with this_environments_kernel():
            papermill.execute_notebook(
                str(path), str(output), parameters=parameters or {}, cwd=str(path.parent),
                progress_bar=False, execution_timeout=timeout,
                kernel_manager_class=local_kernel_manager(),
            )  # fmt: skip
        return Outcome(path.name, True, time.perf_counter() - start, output)
    except Exception as e:
        first = str(e).strip().splitlines()
        message = next((line for line in reversed(first) if line.strip()), type(e).__name__)
        return Outcome(path.name, False, time.perf_counter() - start, output, message[:300])


def tour(out: Path = ROOT / "launch" / "tour", parameters: dict | None = None,
         only: list[str] | None = None, folder: Path = NOTEBOOKS, echo=print) -> list[Outcome]:  # fmt: skip
    """Every notebook in order; each gets the given parameters it declares."""
    parameters = parameters or {}
    paths = [p for p in notebooks(folder) if not only or any(p.name.startswith(o) for o in only)]
    declared = {p: parameters_of(p) for p in paths}
    unknown = set(parameters) - {k for names in declared.values() for k in names}
    if unknown:
        known = sorted({k for names in declared.values() for k in names})
        raise ValueError(f"unknown parameter(s) {sorted(unknown)}; notebooks declare {known}")
    outcomes = []
    for path in paths:
        given = {k: v for k, v in parameters.items() if k in declared[path]}
        outcome = run(path, Path(out) / path.name, given)
        echo(outcome.line())
        outcomes.append(outcome)
    return outcomes
