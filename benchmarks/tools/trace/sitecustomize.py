# Count, per process, calls of the functions that check a start (issue 29: checks per launch).
# Loaded through PYTHONPATH by benchmarks/count_checks.sh; every process of a launch inherits it.
import atexit
import json
import os
import sys

WATCH = {("config.py", "_check"), ("engines.py", "check"), ("preflight.py", "preflight"),
         ("__init__.py", "machine_violations"), ("runfolder.py", "plan"), ("check.py", "check")}
counts = {}

def prof(frame, event, arg):
    if event == "call":
        code = frame.f_code
        key = (os.path.basename(code.co_filename), code.co_name)
        if key in WATCH and "/kit/" in code.co_filename:
            counts[f"{key[0]}:{key[1]}"] = counts.get(f"{key[0]}:{key[1]}", 0) + 1

sys.setprofile(prof)

@atexit.register
def _dump():
    if counts:
        out = os.environ.get("TRACE_OUT", "/tmp/trace/out")
        os.makedirs(out, exist_ok=True)
        with open(f"{out}/{os.getpid()}.json", "w") as f:
            json.dump({"argv": " ".join(sys.argv)[:120], "counts": counts}, f)
