"""Scanning a user's training script (or accelerate YAML, or launch script) for the article
patterns that fail, or silently misbehave, under FSDP. Plain regular expressions over the text
with comments removed: the script is never imported or run. The patterns are the `script` of the
records in kit.pitfalls.

    scan_script("train_fsdp_qlora.py")   # a path, or the text itself
"""

from __future__ import annotations

import io
import re
import tokenize
from pathlib import Path

from kit.findings import Finding, ordered
from kit.pitfalls import PITFALLS

PATTERNS = [p for p in PITFALLS if p.script]  # the pitfalls a script shows


def _strip_comments(text: str) -> str:
    """Python comments removed (line numbers kept), so '# or SHARD_GRAD_OP' does not count."""
    try:
        tokens = tokenize.generate_tokens(io.StringIO(text).readline)
        lines = text.splitlines(keepends=True)
        for tok in tokens:
            if tok.type == tokenize.COMMENT:
                (row, col), end = tok.start, tok.end[1]
                lines[row - 1] = lines[row - 1][:col] + " " * (end - col) + lines[row - 1][end:]
        return "".join(lines)
    except (tokenize.TokenError, IndentationError, SyntaxError):
        return re.sub(r"(?m)(^|\s)#.*$", r"\1", text)  # YAML / shell


def script_line(p, text: str) -> int | None:
    """The line at which pitfall record `p`'s script patterns match `text` (comments removed
    first), or None."""
    code = _strip_comments(text)
    first = re.search(p.script[0], code) if p.script else None
    if not first or not all(re.search(r, code) for r in p.script[1:]):
        return None
    if any(re.search(r, code) for r in p.script_absent):
        return None
    return code.count("\n", 0, first.start()) + 1


def scan_script(path_or_text: str | Path) -> list[Finding]:
    """Findings for a user's training script (or YAML/shell): the article patterns that fail or
    silently misbehave under FSDP. Each message starts with the line it points at."""
    text = str(path_or_text)
    if "\n" not in text and len(text) < 4096 and Path(text).is_file():
        text = Path(text).read_text()
    lines = [(p, script_line(p, text)) for p in PATTERNS]
    return ordered([p.finding(f"line {line}") for p, line in lines if line is not None])
