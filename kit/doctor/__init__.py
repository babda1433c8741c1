"""The doctor: known QLoRA + FSDP pitfalls found before a run, during it, and after it fails.

    python -m kit.doctor kit/configs/tiny-cpu.yaml sharding.engine=fsdp1   # before: a config
    python -m kit.doctor --script train_fsdp_qlora.py                      # before: a script
    python -m kit.doctor --run launch/tiny-cpu                             # after: a run folder
    python -m kit.doctor --explain launch/tiny-cpu/run.log                 # after: an error log

Every answer is a list of `Finding(level, code, message, fix)`; the CLI prints one line each and
exits 1 when any is an error (`Finding` is kit/findings.py; the in-run checks the recipe runs on
its ranks are kit/recipe/checks.py, read from there). One file per moment, read top to bottom:

    context.py    the config tree, the model's parts on the meta device (the machine:
                  kit.budget.machine.probe)
    preflight.py  the checks on a config + machine: preflight(cfg, env=None)
    script.py     scan_script(path_or_text): article patterns in a user's script
    run.py        diagnose_run(run_dir): a finished or failed run folder
    explain.py    explain(text): raw error strings -> cause and fix

What each pitfall is, how each moment recognises it and its fix are one record per pitfall in
kit/pitfalls.py; these modules only read them. Every pitfall was reproduced on this stack
(FINDINGS.md, kit/lab/reproduce_rank.py); messages quote the exact error text a person would
otherwise meet an hour into a GPU job.

Kernel side: nothing here creates a process group or initialises CUDA. The pitfalls'
reproductions under torchrun (notebooks 08 and 11) are the lab's (kit.lab.reproduce): they start
runs through kit.run.launch, which runs this doctor's pre-flight.
"""

# The doctor's own answers, one module per moment; a Finding and its helpers are kit.findings'.
from kit.doctor.context import read_config
from kit.doctor.explain import EXPLAIN, explain
from kit.doctor.preflight import config_errors, preflight
from kit.doctor.run import diagnose_run
from kit.doctor.script import PATTERNS, scan_script
from kit.findings import Finding, codes, errors, report

__all__ = [
    "EXPLAIN", "PATTERNS", "Finding", "codes", "config_errors", "diagnose_run", "errors",
    "explain", "preflight", "read_config", "report", "scan_script",
]  # fmt: skip
