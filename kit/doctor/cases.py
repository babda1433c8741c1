"""Kernel side of notebook 11: run the pitfalls of kit/repro.py under torchrun (CPU, gloo) and
read back what each raised and what the doctor says about it, before and after.

    runs = reproduce(["prepare-kbit", "uint8-storage"])   # one torchrun launch
    print(repro_table(runs))
"""

from __future__ import annotations

import json
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

from kit.doctor.context import ROOT
from kit.doctor.explain import explain
from kit.doctor.preflight import preflight
from kit.doctor.script import scan_script
from kit.findings import Finding, codes, ordered
from kit.torchrun import torchrun


@dataclass
class Repro:
    """One pitfall run by kit.repro under torchrun: the raw outcome and what the doctor says."""

    case: str
    fixed: bool
    ok: bool  # the case finished without an exception (a crash leaves ok=False)
    error: str  # "ExcType: message" as the ranks raised it, or torchrun's exit summary
    text: str  # the traceback or torchrun output to show
    findings: list  # explain(text), or diagnose-style findings the case itself reported


def reproduce(
    cases: list[str], fixed: bool = False, nproc: int = 2, out: str | Path = "", timeout: int = 900
) -> dict[str, Repro]:
    """Run kit.repro CASES under `torchrun --nproc_per_node=nproc` (CPU, gloo) and return what
    each case raised. One launch for all; a case that kills a process runs last in it (a second
    such case gets a launch of its own)."""
    from kit import repro

    out = Path(out or ROOT / "launch" / "doctor-repro").resolve()  # the ranks run in ROOT
    crashers = [c for c in cases if repro.CASES[c].crashes and not fixed]
    shared = [c for c in cases if c not in crashers] + crashers[:1]  # a crash ends its launch
    groups = ([shared] if shared else []) + [[c] for c in crashers[1:]]
    results: dict[str, Repro] = {}
    for i, group in enumerate(groups):
        folder = out / ("fixed" if fixed else "raw") / (f"{i}-{group[0]}" if i else "")
        shutil.rmtree(folder, ignore_errors=True)
        folder.mkdir(parents=True)
        args = ["--out", folder, *(["--fixed"] if fixed else []), *group]
        proc = torchrun("kit.repro", *args, nproc=nproc, timeout=timeout, check=False)
        console = proc.stdout + proc.stderr
        (folder / "console.log").write_text(console)
        reports = [json.loads(f.read_text()) for f in sorted(folder.glob("rank*.json"))]
        for case in group:
            got = [r[case] for r in reports if case in r]
            failed = [g for g in got if not g["ok"]]
            # The cause is the error the doctor knows; other ranks often only died of its
            # absence ("Connection closed by peer", code peer_died).
            known = [g for g in failed if set(codes(explain(g["traceback"]))) - {"peer_died"}]
            if len(got) < nproc and not known:  # a rank died before it could report
                root = re.search(
                    r"Root Cause.*?rank\s*:\s*(\d+).*?exitcode\s*:\s*([^\n]*)", console, re.S
                )
                error = (
                    f"rank {root.group(1)} died: exitcode {' '.join(root.group(2).split())}"
                    if root
                    else f"torchrun exit code {proc.returncode}"
                )
                # This case's own lines and torchrun's failure summary: not the earlier cases' errors.
                mine = [line for line in console.splitlines() if f"] {case}: " in line]
                start = console.find("Failures:")
                text = "\n".join(mine) + "\n" + (console[start:] if start >= 0 else console[-3000:])
                results[case] = Repro(case, fixed, False, error, text, explain(text))
                continue
            first = (known or failed or got)[0]
            findings = [Finding(**f) for g in got for f in g["findings"]]
            findings += explain(first["traceback"])
            results[case] = Repro(
                case, fixed, not failed, first["error"], first["traceback"], ordered(findings)
            )
    return {c: results[c] for c in cases}


def repro_table(runs: dict[str, Repro]) -> str:
    """One line per case: outcome and the doctor's codes."""
    lines = [f"{'case':<24} {'outcome':<8} {'doctor':<34} raw error"]
    for r in runs.values():
        said = ", ".join(dict.fromkeys(codes(r.findings))) or "-"
        lines.append(f"{r.case:<24} {'ok' if r.ok else 'FAILED':<8} {said:<34} {r.error[:90]}")
    return "\n".join(lines)


def case_findings(case: str) -> list[Finding]:
    """What the doctor says about a repro case before running it: preflight of the equivalent
    kit config when there is one, else a scan of the case's source."""
    from kit import repro

    spec = repro.CASES[case]
    if spec.overrides:
        return preflight(
            ROOT / "kit" / "configs" / "tiny-cpu.yaml", env=spec.env, overrides=list(spec.overrides)
        )
    return scan_script(repro.source(case))


def repro_summary(before: dict, raw: dict, fixed: dict) -> dict:
    """Per case: the doctor's codes before the run, whether the raw run failed (or was caught
    by an in-run check), the codes it gave the raw run, whether the fixed run was clean."""
    from kit import repro

    out = {}
    for case, r in raw.items():
        out[case] = {
            "expect": repro.CASES[case].expect,
            "before": sorted(set(codes(before.get(case, [])))),
            "raw_failed": not r.ok or any(f.level == "error" for f in r.findings),
            "raw_codes": sorted({f.code for f in r.findings if f.level == "error"}),
            "fixed_clean": case in fixed
            and fixed[case].ok
            and not any(f.level == "error" for f in fixed[case].findings),
        }
    return out
