"""Count what issue 29 measures about the house, on any checkout (flat or in packages):

    python benchmarks/house_count.py [ROOT]

- files directly in kit/ (modules, not packages);
- modules spelling a run folder's file names as string literals ("metrics.jsonl", "result.json",
  "adapter", "checkpoints", ...): the names every side should take from one place;
- rank-side experiment mains: modules other than the recipe's entries (kit.train, the SFT entry)
  that start a process group under `if __name__ == "__main__"`, each with its own argv and rows.

Static counts from the source (ast and a regex); nothing is imported.
"""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

NAMES = ("config.yaml", "run.sh", "metrics.jsonl", "result.json", "run.log", "adapter",
         "checkpoints", "earlier", "pid", "exit_code", "probe.pt")
LITERAL = re.compile(r"""["']({})["'/]""".format("|".join(re.escape(n) for n in NAMES)))
ENTRIES = ("train.py", "sft.py")


def main_block(tree: ast.Module) -> bool:
    return any(isinstance(n, ast.If) and "__main__" in ast.unparse(n.test) for n in tree.body)


def starts_group(text: str) -> bool:
    return "init_process_group" in text or "kdist.init" in text or "dist.init(" in text


def count(root: Path) -> dict:
    kit = root / "kit"
    modules = sorted(p for p in kit.rglob("*.py") if "__pycache__" not in p.parts)
    spelling, mains = [], []
    for path in modules:
        text = path.read_text()
        rel = str(path.relative_to(root))
        if LITERAL.search(text):
            spelling.append(rel)
        if path.name not in ENTRIES and main_block(ast.parse(text)) and starts_group(text):
            mains.append(rel)
    return {
        "files directly in kit/": sorted(p.name for p in kit.glob("*.py")),
        "modules spelling run-folder names": spelling,
        "rank-side experiment mains": mains,
    }


if __name__ == "__main__":
    root = Path(sys.argv[1] if len(sys.argv) > 1 else ".").resolve()
    for what, found in count(root).items():
        print(f"{what}: {len(found)}")
        print("    " + " ".join(found))
