"""Kernel side of the reproductions (notebooks 08 and 11): run the pitfalls of kit.pitfalls under
torchrun, each rank's outcome read back with what the doctor makes of it.

    runs = reproduce(["prepare_kbit_fsdp1", "fsdp1_int_storage"])   # one torchrun launch
    print(repro_table(runs["wrong"]))                                # and runs["fixed"]
    print(describe(runs, "full_state_dict_empty_adapter"))
    runs = read(["prepare_kbit_fsdp1", "fsdp1_int_storage"])        # the same, read back later

The ranks run kit/lab/reproduce_rank.py from a run folder written and started by
kit.run.launch.run_to_end (config.yaml, run.sh, run.log), like every other run of the kit.
"""

from __future__ import annotations

import re
import shutil
from dataclasses import dataclass
from pathlib import Path

from kit import ROOT, pitfalls
from kit.doctor.explain import explain
from kit.doctor.preflight import preflight
from kit.doctor.script import scan_script
from kit.findings import Finding, codes, ordered
from kit.folder import jsonl
from kit.folder.layout import RunFolder

TINY = ROOT / "kit" / "configs" / "tiny-cpu.yaml"
CPU = {"gpus": [], "nproc_per_node": 2, "vars": {}}  # the machine the doctor assumes for a case
SIDES = ("wrong", "fixed")


@dataclass
class Repro:
    """One side of one pitfall as the ranks ran it: the raw outcome and what the doctor says."""

    code: str
    side: str  # "wrong": the mistake as a person writes it; "fixed": the kit's way
    ok: bool  # finished without an exception (a crash leaves ok=False)
    error: str  # "ExcType: message" as the ranks raised it, or torchrun's exit summary
    observed: str  # the error, or what the step measured when nothing was raised
    text: str  # the traceback or torchrun output to show
    findings: list  # explain(text), and the in-run checks' findings the step reported

    @property
    def failed(self) -> bool:
        """Raised, or caught by an in-run check."""
        return not self.ok or any(f.level == "error" for f in self.findings)


def launches(codes=(), sides=SIDES) -> list[list[str]]:
    """The steps (CODE:side) of each torchrun launch: every step in one launch, except that a
    wrong side that kills a process (`crashes`) runs last, and a second one in a launch of its
    own."""
    records = pitfalls.reproduced(codes)
    crashing = [f"{p.code}:wrong" for p in records if p.crashes and "wrong" in sides]
    shared = [f"{p.code}:{s}" for p in records for s in sides if f"{p.code}:{s}" not in crashing]
    groups = [shared + crashing[:1]] + [[step] for step in crashing[1:]]
    return [g for g in groups if g]


def reproduce(codes=(), sides=SIDES, nproc: int = 2, out: str | Path = "",
              overrides=("training.device=cpu",), timeout: int = 900) -> dict[str, dict]:
    """Run the reproductions of `codes` (all: every reproduced pitfall) under torchrun
    (`nproc` ranks; the tiny model on CPU unless `overrides` say otherwise) and return
    {side: {code: Repro}}. Each launch is a run folder under `out` (default launch/pitfalls)."""
    from kit.run.launch import run_to_end

    out = _out(out)
    for i, steps in enumerate(launches(codes, sides)):
        folder = out / f"launch-{i}"
        shutil.rmtree(folder, ignore_errors=True)  # no report of an earlier launch is read
        run_to_end(TINY, [*overrides, f"run.output_dir={folder}", "run.dist_timeout_min=2"],
                   nproc=nproc, name=f"pitfalls-{i}", module="kit.lab.reproduce_rank",
                   args=["{config}", "{run_dir}", *steps], timeout=timeout, check=False)
    return read(codes, sides, nproc, out)


def read(codes=(), sides=SIDES, nproc: int = 2, out: str | Path = "") -> dict[str, dict]:
    """What reproduce(codes, sides, nproc, out) returned, read again from the launch folders it
    left under `out` (each rank's reports and run.log), starting nothing: a notebook's
    reproductions, read by a test or another kernel. A launch folder that is missing or was
    never run raises FileNotFoundError, naming it."""
    out = _out(out)
    runs: dict[str, dict] = {side: {} for side in sides}
    for i, steps in enumerate(launches(codes, sides)):
        folder = out / f"launch-{i}"
        if not RunFolder(folder).exit_code.is_file():  # run.sh writes it when torchrun has ended
            raise FileNotFoundError(f"{folder}: no finished launch of reproduce() here")
        console = RunFolder(folder).log.read_text(errors="replace")
        for step in steps:
            code, side = step.split(":")
            runs[side][code] = _read(folder, code, side, nproc, console)
    order = [p.code for p in pitfalls.reproduced(codes)]
    return {side: {c: got[c] for c in order if c in got} for side, got in runs.items()}


def _out(out: str | Path) -> Path:
    return Path(out or ROOT / "launch" / "pitfalls").resolve()


def _read(folder: Path, code: str, side: str, nproc: int, console: str) -> Repro:
    """One step's outcome from every rank's report; torchrun's summary when a rank died first."""
    got = jsonl.read_ranks(folder / code, prefix=f"{side}.rank")  # each rank's report
    failed = [g for g in got if not g["ok"]]
    # The cause is the error the doctor knows; other ranks often only died of its absence
    # ("Connection closed by peer", code peer_died).
    known = [g for g in failed if set(codes(explain(g["traceback"]))) - {"peer_died"}]
    if len(got) < nproc and not known:  # a rank died before it could report
        root = re.search(r"Root Cause.*?rank\s*:\s*(\d+).*?exitcode\s*:\s*([^\n]*)", console, re.S)
        error = (f"rank {root.group(1)} died: exitcode {' '.join(root.group(2).split())}"
                 if root else "a rank died without a report")  # fmt: skip
        # This step's own lines and torchrun's failure summary: not the earlier steps' errors.
        mine = [line for line in console.splitlines() if f"] {code}:{side}: " in line]
        start = console.find("Failures:")
        text = "\n".join(mine) + "\n" + (console[start:] if start >= 0 else console[-3000:])
        return Repro(code, side, False, error, error, text, explain(text))
    first = (known or failed or got)[0]
    findings = [Finding(**f) for g in got for f in g["findings"]]
    findings += explain(first["traceback"])
    return Repro(code, side, not failed, first["error"], first["observed"],
                 first["traceback"], ordered(findings))  # fmt: skip


def describe(runs: dict[str, dict], code: str) -> str:
    """A pitfall told in words: the mistake, what it did, why, the fix, what the fix did (or
    'not run')."""
    p = pitfalls.get(code)

    def seen(side: str) -> str:
        got = runs.get(side, {}).get(code)
        return got.observed if got else "not run"

    rows = [("wrong", pitfalls.summary(p.wrong)), ("observed", seen("wrong")),
            ("why", p.why or p.message), ("fix", p.fix), ("with the fix", seen("fixed"))]
    return "\n".join([p.title] + [f"  {label + ':':<13} {text}" for label, text in rows])


def repro_table(runs: dict[str, Repro]) -> str:
    """One line per pitfall of one side: outcome and the doctor's codes."""
    lines = [f"{'pitfall':<30} {'outcome':<8} {'doctor':<34} raw error"]
    for r in runs.values():
        said = ", ".join(dict.fromkeys(codes(r.findings))) or "-"
        outcome = "FAILED" if r.failed else "ok"
        lines.append(f"{r.code:<30} {outcome:<8} {said:<34} {r.error[:80]}")
    return "\n".join(lines)


def case_findings(code: str) -> list[Finding]:
    """What the doctor says about a reproduced pitfall before running it: preflight of the kit
    config with the same mistake when there is one, else a scan of the wrong side's source."""
    p = pitfalls.get(code)
    if p.overrides:
        return preflight(TINY, env=CPU, overrides=list(p.overrides))
    return scan_script(pitfalls.source(p.wrong))


def repro_summary(before: dict, raw: dict, fixed: dict) -> dict:
    """Per pitfall: the doctor's codes before the run, whether the raw run failed (or was caught
    by an in-run check), the codes it gave the raw run, whether the fixed run was clean."""
    return {
        code: {
            "expect": pitfalls.get(code).expect,
            "before": sorted(set(codes(before.get(code, [])))),
            "raw_failed": r.failed,
            "raw_codes": sorted({f.code for f in r.findings if f.level == "error"}),
            "fixed_clean": code in fixed and not fixed[code].failed,
        }
        for code, r in raw.items()
    }
