"""The doctor: known QLoRA + FSDP pitfalls found before a run, during it, and after it fails.

    python -m kit.doctor kit/configs/tiny-cpu.yaml sharding.engine=fsdp1   # before: a config
    python -m kit.doctor --script train_fsdp_qlora.py                      # before: a script
    python -m kit.doctor --run launch/tiny-cpu                             # after: a run folder
    python -m kit.doctor --explain launch/tiny-cpu/run.log                 # after: an error log

Every answer is a list of `Finding(level, code, message, fix)`; the CLI prints one line each and
exits 1 when any is an error (`Finding` is kit/findings.py; the in-run checks the recipe runs on
its ranks are kit/checks.py). One file per moment, read top to bottom:

    context.py    the machine (detect_env), the config tree, the model's shape on the meta device
    preflight.py  the checks on a config + machine: preflight(cfg, env=None)
    script.py     scan_script(path_or_text): article patterns in a user's script
    run.py        diagnose_run(run_dir): a finished or failed run folder
    explain.py    explain(text): raw error strings -> cause and fix
    cases.py      reproduce(cases): the pitfalls of kit/repro.py under torchrun (notebook 11)

Kernel side: nothing here creates a process group or initialises CUDA. Every pitfall was
reproduced on this stack (FINDINGS.md, kit/repro.py); messages quote the exact error text a
person would otherwise meet an hour into a GPU job.
"""

# The in-run checks live rank side (kit.checks); the doctor offers them too.
from kit.checks import (
    check_adapter,
    check_checkpointing_active,
    check_lora_changed,
    check_rank_times,
    check_step,
    trainable_snapshot,
)
from kit.doctor.cases import Repro, case_findings, repro_summary, repro_table, reproduce
from kit.doctor.context import detect_env, model_facts, read_config
from kit.doctor.explain import EXPLAIN, explain
from kit.doctor.preflight import config_errors, preflight
from kit.doctor.run import diagnose_run
from kit.doctor.script import PATTERNS, scan_script
from kit.findings import Finding, codes, errors, report

__all__ = [
    "EXPLAIN", "PATTERNS", "Finding", "Repro", "case_findings", "check_adapter",
    "check_checkpointing_active", "check_lora_changed", "check_rank_times", "check_step",
    "codes", "config_errors", "detect_env", "diagnose_run", "errors", "explain",
    "model_facts", "preflight", "read_config", "repro_summary", "repro_table", "report",
    "reproduce", "scan_script", "trainable_snapshot",
]  # fmt: skip
