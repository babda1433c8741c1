"""JSON-lines files that one process appends to while another reads them (metrics, bench rows).

One reader for the whole kit: only complete lines count (a writer may be mid-line), blank lines are
skipped, and a missing file is an empty list. Imports nothing of the kit; both sides use it.
"""

from __future__ import annotations

import json
import os
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


def write_json(path: str | Path, obj, indent: int = 1) -> None:
    """One JSON document at `path`, atomically: written to a temporary file beside it, then
    renamed over it (a reader sees the whole file or none). Creates the folder."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj, indent=indent))
    os.replace(tmp, path)


def read_ranks(folder: str | Path, prefix: str = "rank") -> list[dict]:
    """The JSON files `<prefix><R>.json` of `folder` (one per rank), in rank order."""
    files = Path(folder).glob(f"{prefix}*.json")
    ranks = [(int(p.name[len(prefix):-len(".json")]), p) for p in files
             if p.name[len(prefix):-len(".json")].isdigit()]
    return [json.loads(p.read_text()) for _, p in sorted(ranks)]
