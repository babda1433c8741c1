"""Count what issue 29 measures about the house, on any checkout (flat or in packages):

    python benchmarks/tools/house_count.py [ROOT]

- files directly in kit/ (modules, not packages);
- modules spelling a run folder's file names as string literals ("metrics.jsonl", "result.json",
  "adapter", "checkpoints", ...): the names every side should take from one place;
- rank-side experiment mains: modules other than the recipe's entries (kit.train, the SFT entry)
  that start a process group under `if __name__ == "__main__"`, each with its own argv and rows;
- notebook-only lines in the recipe: lines of the recipe modules' top-level definitions that no
  module of the kit uses except the notebooks' instruments (the recipe runs none of them).

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
RECIPE = ("dist engines model loading quantize lora lora_groups fp8 recompute offload loss layers "
          "attention data checkpoint merge checks faults preempt sft sft_setup chat meters").split()
LAB = ("order order_rank loading_rank loading_report sharding sharding_report recompute_sweep "
       "memory attention_bench second_article quantize_nf4 lora_adapters").split()


def notebook_only(kit: Path) -> dict[str, int]:
    """Recipe module -> lines of its definitions used by no kit module but the lab's."""
    flat = not (kit / "recipe").is_dir()
    recipe = [kit / f"{n}.py" if flat else kit / "recipe" / f"{n}.py" for n in RECIPE]
    recipe = [p for p in recipe if p.is_file()]
    lab = {kit / f"{n}.py" for n in LAB} | set((kit / "lab").glob("*.py"))
    others = [p for p in kit.rglob("*.py") if p not in lab and "__pycache__" not in p.parts]
    texts = {p: p.read_text() for p in others}
    out = {}
    for path in recipe:
        tree = ast.parse(texts[path])
        defs = {}  # name -> node, for the module's top-level definitions
        for node in tree.body:
            for name in ([node.name] if hasattr(node, "name") else
                         [t.id for t in getattr(node, "targets", []) if isinstance(t, ast.Name)]):
                defs[name] = node
        refs = {name: {n.id if isinstance(n, ast.Name) else n.attr for n in ast.walk(node)
                       if isinstance(n, (ast.Name, ast.Attribute))} for name, node in defs.items()}
        outside = " ".join(text for p, text in texts.items() if p != path)
        top = {n.id for node in tree.body if node not in defs.values()
               for n in ast.walk(node) if isinstance(n, ast.Name)}  # module-level statements
        used = {n for n in defs if n in top or re.search(rf"\b{re.escape(n)}\b", outside)}
        todo = list(used)
        while todo:  # what a used definition uses is used
            for n in refs[todo.pop()] & defs.keys() - used:
                used.add(n)
                todo.append(n)
        lines = sum(node.end_lineno - node.lineno + 1 for n, node in defs.items() if n not in used)
        if lines:
            out[str(path.relative_to(kit.parent))] = lines
    return out


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
        "notebook-only lines in the recipe": notebook_only(kit),
    }


if __name__ == "__main__":
    root = Path(sys.argv[1] if len(sys.argv) > 1 else ".").resolve()
    for what, found in count(root).items():
        if isinstance(found, dict):
            print(f"{what}: {sum(found.values())}")
            print("    " + " ".join(f"{k} {v}" for k, v in sorted(found.items())))
            continue
        print(f"{what}: {len(found)}")
        print("    " + " ".join(found))
