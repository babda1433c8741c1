"""Run one function of a kit module in a fresh Python process and get its JSON result back.

    rows = child.call("kit.lab.attention_bench:sweep", seq_lens=[128, 256], timeout=600)
    info = child.call("kit.lab.hardware:collect")
    python -m kit.run.child kit.recipe.attention:usable '{"device": "cpu"}'     # the same, from a terminal

Why a child: a notebook kernel that imports torch or initialises CUDA can no longer fork or start
torchrun safely, and keeps GPU memory until it is restarted. The child imports what it needs,
measures, prints the result as JSON and exits; the caller (kernel side) imports no torch.

What subprocess.run(timeout=...) does not do, and this does: on a timeout (or a KeyboardInterrupt
in the caller) it kills the child's whole process tree, not only the child. The child starts a
session of its own (its process group is killpg'ed), and its descendants are collected first with
psutil, because some start sessions of their own (torchrun's ranks, compile workers) and would
escape the process group. The function's own prints go to stderr, so stdout carries nothing but the
result; a failure is one line (the exception) followed by the tail of the child's stderr.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

from kit import ROOT

STDERR_TAIL = 3000  # characters of the child's stderr a failure carries


class ChildFailed(RuntimeError):
    """The child raised or died: `.message` is one line, `.stderr` the child's stderr."""

    def __init__(self, target: str, message: str, stderr: str = ""):
        self.target, self.message, self.stderr = target, message, stderr
        tail = stderr[-STDERR_TAIL:].rstrip()
        super().__init__(f"{target} failed in its child process: {message}"
                         + (f"\n--- its stderr (last {STDERR_TAIL} characters):\n{tail}"
                            if tail else ""))  # fmt: skip


def call(target: str, timeout: float = 1800, env: dict | None = None, **kwargs):
    """target(**kwargs) in a fresh `python -m kit.run.child` process; its result through JSON.

    target: "module:function", e.g. "kit.lab.hardware:collect". kwargs must be JSON (tuples arrive
    as lists, so do they in the result; objects JSON cannot hold arrive as str). env: extra
    variables for the child (`timeout` and `env` are this call's own, never the function's).
    Raises ChildFailed (one line + stderr tail) when the function raises or the child dies,
    TimeoutError when `timeout` seconds pass (the tree is killed)."""
    module, _, function = target.partition(":")
    if not module or not function.isidentifier():
        raise ValueError(f"target: {target!r} is not allowed; expected 'module:function', "
                         "e.g. 'kit.lab.hardware:collect'")  # fmt: skip
    proc = subprocess.Popen(
        [sys.executable, "-m", "kit.run.child", target], cwd=ROOT, start_new_session=True,
        env={"TOKENIZERS_PARALLELISM": "false", **os.environ, **(env or {})},
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        out, err = proc.communicate(json.dumps(kwargs), timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_tree(proc)
        try:  # a process that escaped the tree (double fork) may still hold the pipes
            _, err = proc.communicate(timeout=10)
        except subprocess.TimeoutExpired:
            err = ""
        raise TimeoutError(f"{target}: stopped after {timeout}s (its whole process tree)\n"
                           f"{err[-STDERR_TAIL:].rstrip()}") from None  # fmt: skip
    except BaseException:  # KeyboardInterrupt in a notebook: leave nothing running behind
        kill_tree(proc)
        raise
    if not out.strip():
        died = (f"killed by {signal.Signals(-proc.returncode).name}" if proc.returncode < 0
                else f"exited with {proc.returncode} without a result")  # fmt: skip
        raise ChildFailed(target, died, err)
    answer = json.loads(out)
    if "error" in answer:
        raise ChildFailed(target, answer["error"], err)
    return answer["result"]


def kill_tree(proc: subprocess.Popen) -> None:
    """SIGKILL the child, its process group and every descendant, wherever its session."""
    import psutil

    try:
        family = psutil.Process(proc.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        family = []
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # its group: start_new_session made pgid == pid
    except ProcessLookupError:
        pass
    for p in family:  # the ones that left the group (setsid) are still its descendants
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(family, timeout=5)
    proc.wait()


def _main(argv: list[str]) -> int:
    """The child: kwargs as JSON on stdin, {"result": ...} or {"error": "one line"} on stdout."""
    import importlib
    import traceback

    if len(argv) not in (1, 2):
        print("usage: python -m kit.run.child module:function ['{json keyword arguments}']",
              file=sys.stderr)  # fmt: skip
        return 2
    result_stream = os.fdopen(os.dup(1), "w")  # the real stdout, for the result alone
    os.dup2(2, 1)  # everything the function prints (and its libraries) goes to stderr
    sys.stdout = sys.stderr
    text = argv[1] if len(argv) == 2 else "" if sys.stdin.isatty() else sys.stdin.read()
    kwargs = json.loads(text or "{}")
    module, _, function = argv[0].partition(":")
    try:
        result = getattr(importlib.import_module(module), function)(**kwargs)
        answer = {"result": result}
    except Exception as e:  # noqa: BLE001 - reported to the caller, one line + traceback
        traceback.print_exc()
        answer = {"error": f"{type(e).__name__}: {' '.join(str(e).split())}"[:1000]}
    result_stream.write(json.dumps(answer, default=str))
    result_stream.flush()
    return 1 if "error" in answer else 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
