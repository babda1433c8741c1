"""Explaining a failed run: the raw error strings met on this stack, each mapped to its cause and
fix. Used on a run's logs (diagnose_run), by the launcher when a run fails, and from the command
line (`python -m kit.doctor --explain run.log`).

The patterns are the `error` of the records in kit.pitfalls: they quote the exact text the
libraries print (FINDINGS.md; kit/lab/reproduce_rank.py reproduces most of them on CPU), so a
message seen an hour into a GPU job is recognised at once.
"""

from __future__ import annotations

import re

from kit.findings import LEVELS, Finding
from kit.pitfalls import PITFALLS

EXPLAIN = [p for p in PITFALLS if p.error]  # the pitfalls known by their raw error text


def explain(text: str) -> list[Finding]:
    """Known causes and fixes for the raw error text of a failed run (logs, a traceback).
    One finding per known error: causes (errors) first, each in order of first appearance. A
    raw error is an error, unless its record calls it a consequence (info: a peer died)."""
    hits = []
    for p in EXPLAIN:
        m = re.search(p.error, text)
        if m:
            line = " ".join(text[text.rfind("\n", 0, m.start()) + 1 : m.end()].split())
            said = line if len(line) <= 120 else "..." + line[-117:]
            level = "info" if p.level == "info" else "error"
            hits.append((m.start(), p.finding(saw=said, level=level)))
    seen, out = set(), []
    for _, f in sorted(hits, key=lambda h: (LEVELS.index(h[1].level), h[0])):
        if f.code not in seen:
            seen.add(f.code)
            out.append(f)
    return out
