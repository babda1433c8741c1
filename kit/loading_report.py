"""Notebook 10's view of loading, kernel side: one load-only torchrun per `model.loading` mode.

    rows = measure("tiny-cpu", ["model.name=kit:llama-135m"], modes=("full", "rank0"))
    table(rows)    # per mode and rank: seconds, host memory before and at peak, read the file?

The ranks run `python -m kit.loading CONFIG --report DIR` (kit/loading.py): each loads the base
model as the mode says, and writes its load time, its peak host memory and a digest of every byte
it holds into DIR/rank<R>.json. This module starts those runs and reads the files: no torch.
"""

from __future__ import annotations

import json
from pathlib import Path

from kit.launch import run_to_end


def measure(config: str, overrides: list[str] | None = None, modes=("full", "rank0"),
            nproc: int = 2, out: str | Path = "launch/loading") -> list[dict]:
    """One captured torchrun per mode (run folder out/<mode>); rows of every rank's report."""
    rows = []
    for mode in modes:
        folder = (Path(out) / mode).resolve()
        run_to_end(config, [f"run.output_dir={folder}", *(overrides or []),
                            f"model.loading={mode}"],  # fmt: skip
                   nproc=nproc, module="kit.loading",
                   args=["{config}", "--report", "{run_dir}/report"])
        rows += read(folder / "report")
    return rows


def read(folder: str | Path) -> list[dict]:
    """The rank<R>.json files of one report, in rank order."""
    ranks = sorted(Path(folder).glob("rank*.json"), key=lambda p: int(p.stem[4:]))
    return [json.loads(p.read_text()) for p in ranks]


def table(rows: list[dict]) -> list[dict]:
    """Per mode and rank: what loading cost in time and host memory (MiB), and whether the rank
    read the checkpoint; the digest's first 12 hex digits (equal: the same bytes)."""
    return [{"mode": r["mode"], "rank": r["rank"], "read the checkpoint": r["read_checkpoint"],
             "seconds": r["seconds"], "host MiB before": r["rss_before_mib"],
             "host MiB peak": r["peak_rss_mib"],
             "load's MiB": round(r["peak_rss_mib"] - r["rss_before_mib"], 1),
             "digest": r["digest"][:12]} for r in rows]  # fmt: skip
