"""The recorded runs under benchmarks/records/, read one way: what notebooks, docs' claims, the
lab's exercises and the tests read a record through.

    rows = records.rows("2026-11-23-speed-8b-2xh200")                  # its rows.jsonl
    rows = records.rows("2026-11-25-planned-defaults-1xh100", "8b")    # its rows-8b.jsonl
    matrix = records.matrix("2026-11-23-speed-8b-2xh200")              # its one bench-*.yaml
    records.path("2026-11-22-checkpoints-1b-2xh200")                   # its report.md

A record is a folder `benchmarks/records/<YYYY-MM-DD>-<topic>/` (benchmarks/README.md: the
index and the naming rule): report.md, rows.jsonl or rows-<part>.jsonl, the matrices as they ran
(bench-*.yaml), command.txt. A name or file that is not there raises FileNotFoundError in one
line naming what the record holds. Kernel side: no torch.
"""

from __future__ import annotations

from pathlib import Path

from kit import ROOT

RECORDS = ROOT / "benchmarks" / "records"
INDEX = ROOT / "benchmarks" / "README.md"


def names() -> list[str]:
    """Every record, oldest first (the date leads the name)."""
    return sorted(p.name for p in RECORDS.iterdir() if p.is_dir()) if RECORDS.is_dir() else []


def folder(name: str) -> Path:
    """The record's folder; an unknown name raises FileNotFoundError naming the closest ones."""
    path = RECORDS / name
    if not path.is_dir():
        topic = name[11:] if name[:4].isdigit() else name
        near = [n for n in names() if topic and (topic in n or n[11:] in topic)]
        raise FileNotFoundError(f"benchmarks/records/{name}: no such record"
                                f"{'; did you mean ' + ', '.join(near) if near else ''} "
                                "(benchmarks/README.md lists them)")
    return path


def path(name: str, file: str = "report.md") -> Path:
    """A file of the record (its report by default)."""
    found = folder(name) / file
    if not found.exists():
        held = sorted(p.name for p in folder(name).iterdir())
        raise FileNotFoundError(f"benchmarks/records/{name}/{file}: not in the record; it holds "
                                f"{', '.join(held)}")
    return found


def report(name: str) -> str:
    """The record's report.md, as text."""
    return path(name).read_text()


def rows(name: str, part: str | None = None) -> list[dict]:
    """The record's rows: rows.jsonl, or rows-<part>.jsonl where it holds several."""
    from kit.folder import jsonl

    return jsonl.read(path(name, f"rows-{part}.jsonl" if part else "rows.jsonl"))


def matrix(name: str, file: str | None = None) -> dict:
    """The record's matrix as it ran (kit.bench.matrix.load_matrix): its one bench-*.yaml, or
    the one named (with or without .yaml) where it holds several."""
    from kit.bench.matrix import load_matrix

    if file is None:
        found = sorted(p.name for p in folder(name).glob("*.yaml"))
        if len(found) != 1:
            raise FileNotFoundError(f"benchmarks/records/{name}: {len(found)} matrices "
                                    f"({', '.join(found) or 'none'}); name one")
        file = found[0]
    return load_matrix(path(name, file if file.endswith(".yaml") else f"{file}.yaml"), to_run=False)


def listed() -> list[str]:
    """The records benchmarks/README.md's index names (a line per record: `(records/<name>/)`)."""
    import re

    return re.findall(r"\(records/([^/)]+)/\)", INDEX.read_text()) if INDEX.is_file() else []


__all__ = ["RECORDS", "names", "folder", "path", "report", "rows", "matrix", "listed"]
