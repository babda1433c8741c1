"""model.loading on this CPU, 2 processes, from a checkpoint large enough for the model's bytes to
outweigh the libraries' (default kit:llama-1b: Llama-3.2-1B's shape, 2.5 GB of bf16 safetensors,
written once under $KIT_HOME). One torchrun per mode (kit.lab.loading_report.measure), so each row's
peaks are its own; prints a markdown table per rank and the ratio of what each load added.

    python3 benchmarks/tools/cpu_loading.py [MODEL] > report.md   # as in benchmarks/records/2026-11-24-loading-1b-cpu
"""

import sys
import time

from kit.lab import loading_report

model = sys.argv[1] if len(sys.argv) > 1 else "kit:llama-1b"
start = time.time()
rows = loading_report.measure("tiny-cpu", [f"model.name={model}", "training.device=cpu"],
                              out="launch/cpu-loading")
print(f"`{model}`, 2 processes on the CPU, one torchrun per mode ({time.time() - start:.0f} s in "
      "all). MiB; load's MiB: the peak resident set until sharded minus what the rank held before "
      "loading.\n")
keys = ["mode", "rank", "read the checkpoint", "seconds", "host MiB before", "host MiB peak",
        "load's MiB", "anon MiB peak", "file MiB peak", "model MiB at most", "model MiB sharded",
        "digest", "logits"]
table = loading_report.table(rows)
print("| " + " | ".join(keys) + " |")
print("|" + "---|" * len(keys))
for r in table:
    print("| " + " | ".join(str(r[k]) for k in keys) + " |")
added = {(r["mode"], r["rank"]): r["load's MiB"] for r in table}
print()
for rank in (0, 1):
    print(f"- rank {rank}: stream's load added {added['stream', rank] / added['full', rank]:.2f}x "
          f"of full's, rank0's {added['rank0', rank] / added['full', rank]:.2f}x")
