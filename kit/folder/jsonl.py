"""JSON-lines files that one process appends to while another reads them (metrics, bench rows).

One reader for the whole kit: only complete lines count (a writer may be mid-line), blank lines are
skipped, and a missing file is an empty list. Imports nothing of the kit; both sides use it.
"""

from __future__ import annotations

import json
from pathlib import Path


def read(path: str | Path, strict: bool = True) -> list[dict]:
    """Every complete JSON line of `path` (a line still being written is left out). strict=False
    skips lines that are not JSON (the doctor reading a damaged run) instead of raising."""
    try:
        text = Path(path).read_text()
    except FileNotFoundError:
        return []
    rows = []
    for line in text.splitlines(keepends=True):
        if line.endswith("\n") and line.strip():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                if strict:
                    raise
    return rows


def append(path: str | Path, row: dict) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(row) + "\n")


def write(path: str | Path, rows: list[dict]) -> None:
    """Replace `path` with `rows`."""
    Path(path).write_text("".join(json.dumps(r) + "\n" for r in rows))
