"""`python -m kit.train ARGS` for many ARGS in one interpreter: the libraries kit.train imports are
imported once, then each case runs in a forked child exactly as `python -m kit.train` runs it
(runpy executes kit/train.py as __main__, sys.argv as the command line gave it; the child's stdout
and stderr go to the case's files; its exit status is the command's). What it saves is the
interpreter's start and the imports (~5 s a case on 2 cores), not any step of the kit.

    python tests/bare_train.py CASES.json    # [{"argv": [CONFIG, key=value ...], "out": path,
                                             #   "err": path}, ...]

Prints a JSON list of exit codes, one per case, in order.
"""

import json
import os
import runpy
import sys

# What kit.train imports, imported before any fork (kit.train itself is not: runpy runs it fresh).
import peft  # noqa: F401
import torch  # noqa: F401
import transformers  # noqa: F401

import kit.recipe.checkpoint  # noqa: F401
import kit.recipe.engines  # noqa: F401
import kit.recipe.planning  # noqa: F401


def fork(case: dict) -> int:
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid:
        return pid
    for fd, path in ((1, case["out"]), (2, case["err"])):
        os.dup2(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644), fd)
    sys.argv = ["-m", *case["argv"]]  # runpy puts kit/train.py in place of "-m"
    code = 0
    try:
        runpy.run_module("kit.train", run_name="__main__", alter_sys=True)
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:
        import traceback

        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


cases = json.load(open(sys.argv[1]))
codes, running, at = [None] * len(cases), {}, 0
while at < len(cases) or running:  # two at a time: each case's check step is a process too
    while at < len(cases) and len(running) < 2:
        running[fork(cases[at])] = at
        at += 1
    pid, status = os.wait()
    codes[running.pop(pid)] = os.waitstatus_to_exitcode(status)
print(json.dumps(codes))
