"""What every check returns (the doctor before and after a run, the recipe during it): a Finding,
one line of problem and one line of fix. Imports nothing of the kit: both sides use it."""

from __future__ import annotations

from dataclasses import dataclass

LEVELS = ("error", "warning", "info")


@dataclass(frozen=True)
class Finding:
    level: str  # 'error' (the run will fail or silently not train) | 'warning' | 'info'
    code: str  # short slug, stable: tests, the launcher and the notebook key on it
    message: str  # one line: what is wrong
    fix: str  # one line: what to change
    field: str = ""  # the config field concerned, when there is one

    def __str__(self) -> str:
        return f"{self.level.upper():7} {self.code}: {self.message} | fix: {self.fix}"


def errors(findings: list[Finding]) -> list[Finding]:
    return [f for f in findings if f.level == "error"]


def codes(findings: list[Finding]) -> list[str]:
    return [f.code for f in findings]


def ordered(findings: list[Finding]) -> list[Finding]:
    """Duplicates dropped, errors first, otherwise in the order found."""
    unique = list({(f.code, f.message): f for f in findings}.values())
    return sorted(unique, key=lambda f: LEVELS.index(f.level))


def report(findings: list[Finding]) -> str:
    """One line per finding (what the CLI prints), or 'no findings'."""
    return "\n".join(str(f) for f in findings) or "no findings"
