"""The shape of the house, held by tests: no import cycles, two sides that never mix, short modules.

The house (../shared/STYLE.md, "The shape we aim for") has two sides and a folder between them:

- the kernel side (KERNEL_SIDE) is what a notebook kernel imports: config, estimate, launch,
  widgets, doctor, bench reports, tour. Importing it loads no torch/transformers/peft/bitsandbytes
  (nor ipywidgets, except kit.run.widgets and kit.__main__), and it never creates a process group;
- the rank side (RANK_SIDE) is what torchrun's ranks run: the recipe, model, quantize, LoRA,
  sharding, data, loss, checkpoints. It never imports ipywidgets, kit.run.launch, kit.run.widgets or
  kit.doctor, neither at module level nor inside a function;
- the run folder ``launch/<run>/`` is where they meet: the resolved config goes in, JSON-lines
  metrics, logs and checkpoints come out. Nothing else crosses.

Reading a failure:
- test_no_import_cycles prints each cycle's modules, then every import edge inside it with one
  ``file:line`` that makes it. Imports inside functions count: they run when the function does.
  Break the cycle by moving what both need into a module that imports neither.
- test_no_package_loops does the same one level up: a package is kit/<name>/ with everything
  under it (or a module directly in kit/), and package A imports B when any module of A imports
  any of B. Modules can be without a cycle while their packages import each other in a loop; then
  the tree no longer shows which package stands on which. It prints each loop's packages, then
  each arrow inside it with the imports (``file:line``) that make it. Mend it by moving the
  module (or the function) that runs against the others to the package it belongs with.
- test_kernel_side[mod] / test_rank_side[mod] print ``file:line`` for what the source says and
  ``importing it loads X`` for what a fresh interpreter saw (X came in through some import chain;
  ``python -X importtime -c "import mod"`` shows which). A listed module that is not in kit/ yet is
  skipped with "does not exist yet".
- test_module_size lists modules over 400 lines. A module may be longer if its module docstring
  has a line starting ``Longer than 400 lines because`` followed by the reason.

The checkers are plain functions taking (root, package name); test_planted_* run them on a fake
package ``fakekit`` with one violation each, so a checker that goes blind fails too.
"""

from __future__ import annotations

import ast
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PKG = "kit"

# The house's layout, by package. "x.*" means the package x and every module under it. Packages
# that hold one side are named whole; bench, inputs and lab hold both sides, module by module.
KERNEL_SIDE = [
    "kit", "kit.__main__", "kit.config", "kit.findings",
    "kit.run.*",  # the check, the launcher, the run handle, widgets, jobs, nodes, the tour
    "kit.folder.*",  # the run folder's files, what a start may do to it, manifests, JSON lines
    "kit.budget.*",  # memory and speed from a shape and this machine
    "kit.doctor.*",
    "kit.pitfalls",  # the registry of records
    "kit.inputs", "kit.inputs.sources", "kit.inputs.datafile",  # known before any process starts
    "kit.inputs.model_folder", "kit.inputs.checks",  # a model folder's files; transformers'
    # view only inside a function (the check step's child process, or a rank's own)
    "kit.inputs.families",  # what each family allows; transformers only inside a function
    "kit.inputs.moe_shapes",  # MoE shapes of the kit models (a dict; the budget reads it)
    "kit.bench", "kit.bench.__main__", "kit.bench.runner", "kit.bench.matrix", "kit.bench.report",
    "kit.bench.peer",  # the runner asks it whether a peer case can run; torch only in its build
    "kit.bench.unsloth",  # likewise for an unsloth case; torch and unsloth only in its build
    "kit.bench.records",  # benchmarks/records/: what notebooks, claims and tests read of a record
    "kit.lab", "kit.lab.order", "kit.lab.loading_report", "kit.lab.sharding_report",
    "kit.lab.recompute_sweep", "kit.lab.second_article", "kit.lab.collectives",  # notebooks'
    # experiments, started and read
    "kit.lab.plain_recipe",  # the page without the kit, and the kit's run, under torchrun
    "kit.lab.reproduce",  # the pitfalls' reproductions, started under torchrun and read
    "kit.lab.claims", "kit.lab.claims_table",  # the articles' claims, read from the notebooks
    "kit.lab.course",  # every notebook's first line: the repository root, quiet libraries
    "kit.lab.hardware",  # the machine report of notebook 00c: the probe runs in a child process
    "kit.lab.exercises.*",  # the exercises' checks; a solution imports torch when it is called
]
RANK_SIDE = [
    "kit.train", "kit.recipe.*",  # the recipe, and its opt-in levers (kit.recipe.levers)
    "kit.inference.*",  # a trained adapter merged, exported or talked to: torch in one process
    "kit.sft.*",  # TRL's SFTTrainer under accelerate launch: the second article's path
    "kit.inputs.builtin",  # kit: models, built with torch on first use
    "kit.bench.worker", "kit.bench.article",  # the benchmark's ranks and the article baseline
    "kit.bench.profiling",  # a rank's profiled step
    "kit.bench.experiment",  # the harness every experiment on ranks runs on (worker, the lab's)
    "kit.lab.reproduce_rank",  # the wrong code, run
    "kit.lab.order_rank", "kit.lab.loading_rank", "kit.lab.sharding", "kit.lab.memory",
    "kit.lab.collectives_rank", "kit.lab.article_checks",  # a child process runs the article's code
    "kit.lab.exercise_ranks",  # a hands-on exercise's code, on the ranks a child process forks
    "kit.lab.attention_bench", "kit.lab.quantize_nf4", "kit.lab.lora_adapters",  # torch in the
    # process that runs them: a rank, a child process, notebooks 02 and 03 (one process, no group)
]
KERNEL_HEAVY = ("torch", "transformers", "peft", "bitsandbytes", "ipywidgets")
MAY_IMPORT_IPYWIDGETS = ("run.widgets", "__main__")  # relative to the package
RANK_NEVER = ("ipywidgets", "{pkg}.run", "{pkg}.doctor")  # and below them
# Modules that are only GPU code, importing a package only a GPU machine has (CUDA builds of torch
# bring triton; the CPU install does not): where it is missing, their import is not asked.
GPU_PACKAGE = {"recipe.lora_down_kernels": "triton",  # relative to the package
               "recipe.levers.loss_kernel": "triton", "recipe.nf4_kernels": "triton",
               "recipe.experts_kernels": "triton"}
PROCESS_GROUP_CALLS = ("init_process_group", "init_device_mesh")
MAX_LINES, REASON = 400, "Longer than 400 lines because"


# ---- reading the source (ast only: nothing of the package is imported here) ----

def modules_of(root: Path, pkg: str) -> dict[str, Path]:
    """Module name -> file, for every .py of package `pkg` under `root` (a package is its __init__)."""
    found = {}
    for path in sorted((root / pkg).rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def imports_of(module: str, path: Path, known: dict[str, Path]) -> list[tuple[str, int]]:
    """(imported module, line) for every import in the file, inside functions too, by line.

    ``from p import x`` names p, and also p.x when that is a module; relative imports are resolved.
    """
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
                anchor = anchor[: len(anchor) - node.level + 1]
                base = ".".join(anchor + ([node.module] if node.module else []))
            out.append((base, node.lineno))
            out += [(f"{base}.{a.name}", node.lineno) for a in node.names if f"{base}.{a.name}" in known]
    return sorted(out, key=lambda item: item[1])


def _is(name: str, prefixes) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


_GRAPHS: dict[tuple, dict[tuple[str, str], str]] = {}


def import_graph(root: Path, pkg: str) -> dict[tuple[str, str], str]:
    """(importer, imported) -> "file:line" of the first import making that edge, within `pkg`.

    Importing a.b.c also runs a and a.b first, so those are edges too; except a module's own
    packages, which are already being imported when the module itself runs. Parsed once per
    state of the files (their names, sizes and times): the per-module tests ask ~50 times.
    """
    known = modules_of(root, pkg)
    state = (str(root), pkg, tuple((str(p), p.stat().st_mtime_ns, p.stat().st_size)
                                   for p in sorted(known.values())))
    if state not in _GRAPHS:
        _GRAPHS[state] = _import_graph(root, pkg, known)
    return _GRAPHS[state]


def _import_graph(root: Path, pkg: str, known: dict[str, Path]) -> dict[tuple[str, str], str]:
    edges: dict[tuple[str, str], str] = {}
    for module, path in known.items():
        for name, line in imports_of(module, path, known):
            if not _is(name, [pkg]):
                continue
            parts = name.split(".")
            for target in (".".join(parts[:i]) for i in range(1, len(parts) + 1)):
                if target in known and target != module and not module.startswith(target + "."):
                    edges.setdefault((module, target), f"{path.relative_to(root)}:{line}")
    return edges


def cycles(edges) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    graph: dict[str, list[str]] = {}
    for a, b in edges:
        graph.setdefault(a, []).append(b)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found = []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = stack[stack.index(v):]
            del stack[stack.index(v):]
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(found)


def cycle_report(root: Path, pkg: str) -> list[str]:
    edges = import_graph(root, pkg)
    lines = []
    for component in cycles(edges):
        lines.append(f"cycle of {len(component)} modules: {', '.join(component)}")
        lines += [f"    {a} -> {b}   ({where})" for (a, b), where in sorted(edges.items())
                  if a in component and b in component]
    return lines


def package_of(module: str, pkg: str) -> str:
    """kit.recipe.levers.fp8 -> kit.recipe; kit.config -> kit.config; kit -> kit."""
    return ".".join(module.split(".")[:2])


def package_edges(root: Path, pkg: str, leave_out=()) -> dict[tuple[str, str], list[str]]:
    """(package, package) -> ["importer -> imported   (file:line)", ...] for every module edge
    between two packages (inside functions too), but those of the (module, package) pairs in
    `leave_out`."""
    out: dict[tuple[str, str], list[str]] = {}
    for (a, b), where in sorted(import_graph(root, pkg).items()):
        pa, pb = package_of(a, pkg), package_of(b, pkg)
        if pa != pb and (a, pb) not in leave_out:
            out.setdefault((pa, pb), []).append(f"{a} -> {b}   ({where})")
    return out


def package_loop_report(root: Path, pkg: str, leave_out=()) -> list[str]:
    edges = package_edges(root, pkg, leave_out)
    lines = []
    for component in cycles(edges):
        lines.append(f"packages in a loop: {', '.join(component)}")
        for (a, b), made_by in sorted(edges.items()):
            if a in component and b in component:
                lines.append(f"    {a} -> {b}: " + (made_by[0] if len(made_by) == 1 else
                                                     f"{len(made_by)} imports, e.g."))
                lines += [f"        {m}" for m in made_by[:3] if len(made_by) > 1]
    return lines


def reached(root: Path, pkg: str, start: str, never) -> list[str]:
    """Import chains from `start` to a module under `never`, following every import (inside
    functions too) through the package: what a rank could load by running any of its code."""
    after: dict[str, list[tuple[str, str]]] = {}
    for (a, b), where in sorted(import_graph(root, pkg).items()):
        after.setdefault(a, []).append((b, where))
    out, seen, todo = [], {start}, [[start]]
    while todo:
        chain = todo.pop(0)
        for b, where in after.get(chain[-1], []):
            if b in seen:
                continue
            seen.add(b)
            if _is(b, never):
                out.append(" -> ".join(chain + [b]) + f"   ({where})")
            else:
                todo.append(chain + [b])
    return out


def unsided(root: Path, pkg: str, kernel: list[str], rank: list[str]) -> list[str]:
    """Modules on no side, or on both."""
    out = []
    for module in modules_of(root, pkg):
        sides = [s for s, names in (("kernel", kernel), ("rank", rank)) if module in names]
        if len(sides) != 1:
            out.append(f"{module}: on {' and '.join(sides) or 'no'} side")
    return out


def lab_importers(root: Path, pkg: str, lab: str = "lab") -> list[str]:
    """Imports of the notebooks' instruments (pkg.lab) from outside pkg.lab."""
    inside = f"{pkg}.{lab}"
    return [f"{where}: {a} imports {b}" for (a, b), where in sorted(import_graph(root, pkg).items())
            if _is(b, [inside]) and b != inside and not _is(a, [inside])]


def process_group_calls(root: Path, pkg: str, module: str) -> list[str]:
    """Calls of init_process_group/init_device_mesh anywhere in the module (text in strings is fine)."""
    path = modules_of(root, pkg)[module]
    return [f"{path.relative_to(root)}:{node.lineno} calls {name}()"
            for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, ast.Call)
            and (name := getattr(node.func, "attr", getattr(node.func, "id", None))) in PROCESS_GROUP_CALLS]


# ---- what importing a module loads: one fresh interpreter per module ----

# Runs in one subprocess per side: loads `preload` (shared heavy packages that are not watched),
# then forks one child per module, so each module is imported by an interpreter that has loaded
# nothing else of the package: no module can hide another's import. Children run concurrently.
FRESH_IMPORTS = r"""
import importlib, json, os, sys
root, modules, watch, preload = json.loads(sys.argv[1])
sys.path.insert(0, root)
for name in preload:
    importlib.import_module(name)
seen = lambda: sorted(w for w in watch if any(m == w or m.startswith(w + ".") for m in sys.modules))
assert not seen(), f"preloading {preload} loaded {seen()}: it would hide what modules import"
pending, running, results = list(modules), {}, {}
while pending or running:
    while pending and len(running) < max(2, len(os.sched_getaffinity(0))):
        module, (r, w) = pending.pop(0), os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(r)
            os.dup2(os.open(os.devnull, os.O_WRONLY), 1)
            os.dup2(1, 2)
            try:
                importlib.import_module(module)
                out = {"loaded": seen()}
            except BaseException as e:
                out = {"loaded": seen(), "error": f"{type(e).__name__}: {e}"[:1500]}
            os.write(w, json.dumps(out).encode())
            os._exit(0)
        os.close(w)
        running[pid] = (module, r)
    pid, _ = os.wait()
    module, r = running.pop(pid)
    data = b"".join(iter(lambda: os.read(r, 65536), b""))
    os.close(r)
    results[module] = json.loads(data) if data else {"loaded": [], "error": "the import killed it"}
print(json.dumps(results))
"""


def fresh_imports(root: Path, modules, watch, preload=()) -> dict[str, dict]:
    """module -> {"loaded": [watched names in sys.modules after importing it], "error"?: str}."""
    arg = json.dumps([str(root), list(modules), list(watch), list(preload)])
    env = {**os.environ, "PYTHONPATH": str(root), "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run([sys.executable, "-c", FRESH_IMPORTS, arg], cwd=root, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.splitlines()[-1])


def kernel_side_findings(root: Path, pkg: str, module: str, imported: dict) -> list[str]:
    allowed = {"ipywidgets"} if module in {f"{pkg}.{m}" for m in MAY_IMPORT_IPYWIDGETS} else set()
    found = [f"importing it loads {name}" for name in imported["loaded"] if name not in allowed]
    found += [f"importing it fails: {imported['error']}"] if "error" in imported else []
    return found + process_group_calls(root, pkg, module)


def rank_never(pkg: str) -> list[str]:
    return [name.format(pkg=pkg) for name in RANK_NEVER]


def rank_side_findings(root: Path, pkg: str, module: str, imported: dict) -> list[str]:
    never = rank_never(pkg)
    known = modules_of(root, pkg)
    path = known[module]
    by_line = {}
    for name, line in imports_of(module, path, known):
        if _is(name, never):
            by_line.setdefault(line, name)
    found = [f"{path.relative_to(root)}:{line} imports {name}" for line, name in sorted(by_line.items())]
    found += [f"importing it loads {name}" for name in imported["loaded"]]
    needs = GPU_PACKAGE.get(module.removeprefix(f"{pkg}."))
    if needs and importlib.util.find_spec(needs) is None and \
            imported.get("error") == f"ModuleNotFoundError: No module named '{needs}'":
        return found
    return found + ([f"importing it fails: {imported['error']}"] if "error" in imported else [])


def long_modules(root: Path, pkg: str) -> list[str]:
    out = []
    for path in modules_of(root, pkg).values():
        text = path.read_text()
        doc = ast.get_docstring(ast.parse(text)) or ""
        if len(text.splitlines()) > MAX_LINES and not any(
                line.strip().startswith(REASON) for line in doc.splitlines()):
            out.append(f"{path.relative_to(root)}: {len(text.splitlines())} lines")
    return out


# ---- the real house ----

def expand(names: list[str]) -> list[str]:
    known = modules_of(ROOT, PKG)
    out = []
    for name in names:
        base = name.removesuffix(".*")
        out += [base] + ([m for m in known if m.startswith(base + ".")] if name.endswith(".*") else [])
    return out


def existing(module: str) -> None:
    if module not in modules_of(ROOT, PKG):
        pytest.skip(f"{module} does not exist yet")


@pytest.fixture(scope="module")
def kernel_imports():
    return fresh_imports(ROOT, [m for m in expand(KERNEL_SIDE) if m in modules_of(ROOT, PKG)],
                         KERNEL_HEAVY)


@pytest.fixture(scope="module")
def rank_imports():
    return fresh_imports(ROOT, [m for m in expand(RANK_SIDE) if m in modules_of(ROOT, PKG)],
                         rank_never(PKG),
                         preload=("torch",))  # shared, not watched: loaded once, not 15 times


def test_no_import_cycles():
    report = cycle_report(ROOT, PKG)
    assert not report, "import cycles (imports inside functions count):\n" + "\n".join(report)


# Arrows against the layering that still close a loop, each with why it is there and the way out.
# The test fails on any other loop, and on an arrow listed here that the code no longer has.
LOOP_ARROWS_PENDING: dict = {}  # none left: the notebook's machine report lives in kit.lab


def test_no_package_loops():
    report = package_loop_report(ROOT, PKG, LOOP_ARROWS_PENDING)
    assert not report, "packages that import each other (imports inside functions count):\n" + \
        "\n".join(report)
    made = {(a, package_of(b, PKG)) for a, b in import_graph(ROOT, PKG)}
    gone = [f"{a} -> {p}" for a, p in LOOP_ARROWS_PENDING if (a, p) not in made]
    assert not gone, "no longer imported: delete from LOOP_ARROWS_PENDING:\n" + "\n".join(gone)


@pytest.mark.parametrize("module, allowed", [("kit", set()), ("kit.config", {"kit", "kit.pitfalls"})],
                         ids=["kit", "kit.config"])
def test_imports_nothing_of_the_kit(module, allowed):
    """kit/__init__ imports nothing; kit.config, imported by both sides, only kit (for ROOT) and
    the pitfall registry (its config rules), which imports nothing but kit.findings."""
    known = modules_of(ROOT, PKG)
    found = [f"{known[module].relative_to(ROOT)}:{line} imports {name}"
             for name, line in imports_of(module, known[module], known)
             if _is(name, [PKG]) and name not in allowed]
    assert not found, "\n".join(found)


@pytest.mark.parametrize("module", expand(KERNEL_SIDE))
def test_kernel_side(module, kernel_imports):
    existing(module)
    found = kernel_side_findings(ROOT, PKG, module, kernel_imports[module])
    assert not found, f"{module} is kernel side, yet:\n" + "\n".join(found)


@pytest.mark.parametrize("module", expand(RANK_SIDE))
def test_rank_side(module, rank_imports):
    existing(module)
    found = rank_side_findings(ROOT, PKG, module, rank_imports[module])
    assert not found, f"{module} is rank side, yet:\n" + "\n".join(found)


@pytest.mark.parametrize("module", expand(RANK_SIDE))
def test_rank_side_never_reaches_the_kernel_side(module):
    """Not even through an import inside a function: a rank runs any of its module's code."""
    found = reached(ROOT, PKG, module, [n for n in rank_never(PKG) if n.startswith(PKG)])
    assert not found, f"{module} is rank side, yet it can import:\n" + "\n".join(found)


def test_every_module_is_on_one_side():
    found = unsided(ROOT, PKG, expand(KERNEL_SIDE), expand(RANK_SIDE))
    assert not found, "name each module in KERNEL_SIDE or RANK_SIDE, once:\n" + "\n".join(found)


def test_nothing_outside_the_lab_imports_the_lab():
    """kit/lab/ holds what the notebooks measure; the recipe, the launcher and the tools never
    need it (what they share lives in their own packages)."""
    found = lab_importers(ROOT, PKG)
    assert not found, "\n".join(found)


def test_module_size():
    """Every kit/**/*.py has at most 400 lines, or a docstring line `Longer than 400 lines because ...`."""
    found = long_modules(ROOT, PKG)
    assert not found, "over 400 lines without a stated reason:\n" + "\n".join(found)


# ---- planted violations: the checkers must see them ----

FAKE = {
    "__init__.py": "",
    "run/__init__.py": "",
    "run/launch.py": "RUNS = 1\n",
    "run/widgets.py": "from fakekit.run.launch import RUNS\n",
    "a.py": "from fakekit import b\n",
    "b.py": "import json\n\n\ndef later():\n    from fakekit.a import later\n",
    "sub/__init__.py": "from fakekit.sub.c import VALUE\n",
    "sub/c.py": "from fakekit.sub import d\n\nVALUE = d\n",
    "sub/d.py": "",
    "rank.py": "def go():\n    from fakekit.run import launch\n    return launch\n",
    "rank_loads.py": "import fakekit.run.widgets\n",
    "user.py": "import fakekit.sub.d\n",
    "rel/__init__.py": "from . import x\n",
    "rel/x.py": "from ..run import launch\n",
    "kernel.py": "import torch\n",
    "kernel_pg.py": "def start():\n    import torch.distributed as dist\n    dist.init_process_group('gloo')\n",
    "long.py": '"""Long."""\n' + "x = 1\n" * MAX_LINES,
    "pa/__init__.py": "",  # pa and pb: modules without a cycle, packages in a loop
    "pa/one.py": "from fakekit.pb import two\n",
    "pa/four.py": "",
    "pb/__init__.py": "",
    "pb/two.py": "",
    "pb/three.py": "def f():\n    from fakekit.pa import four\n",
    "long_ok.py": f'"""Long.\n\n{REASON} it is a table.\n"""\n' + "x = 1\n" * MAX_LINES,
}


@pytest.fixture
def fake(tmp_path):
    for name, text in FAKE.items():
        (tmp_path / "fakekit" / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "fakekit" / name).write_text(text)
    return tmp_path


def test_planted_function_level_cycle_is_found(fake):
    assert cycles(import_graph(fake, "fakekit")) == [["fakekit.a", "fakekit.b"]]
    report = cycle_report(fake, "fakekit")
    assert "    fakekit.b -> fakekit.a   (fakekit/b.py:5)" in report, report


def test_planted_package_loop_is_found(fake):
    edges = import_graph(fake, "fakekit")
    assert not [c for c in cycles(edges) if "fakekit.pa.one" in c or "fakekit.pb.three" in c]
    loops = cycles(package_edges(fake, "fakekit"))
    assert loops == [["fakekit.a", "fakekit.b"], ["fakekit.pa", "fakekit.pb"]], loops
    report = package_loop_report(fake, "fakekit")
    assert "        fakekit.pb.three -> fakekit.pa.four   (fakekit/pb/three.py:2)" in report, report
    assert not [line for line in report if "fakekit.sub" in line or "fakekit.run" in line]
    assert cycles(package_edges(fake, "fakekit", {("fakekit.pb.three", "fakekit.pa")})) == [
        ["fakekit.a", "fakekit.b"]]  # a pending arrow left out opens its loop, and only that


def test_planted_package_importing_its_submodules_is_no_cycle(fake):
    edges = import_graph(fake, "fakekit")
    assert ("fakekit.sub", "fakekit.sub.c") in edges and ("fakekit.sub.c", "fakekit.sub") not in edges
    assert {("fakekit.user", "fakekit.sub"), ("fakekit.user", "fakekit.sub.d")} <= edges.keys()
    assert {("fakekit.rel", "fakekit.rel.x"), ("fakekit.rel.x", "fakekit.run.launch")} <= edges.keys()


def test_planted_rank_side_violations_are_found(fake):
    imported = fresh_imports(fake, ["fakekit.rank", "fakekit.rank_loads"], rank_never("fakekit"))
    assert rank_side_findings(fake, "fakekit", "fakekit.rank", imported["fakekit.rank"]) == [
        "fakekit/rank.py:2 imports fakekit.run"]
    assert rank_side_findings(fake, "fakekit", "fakekit.rank_loads", imported["fakekit.rank_loads"]) == [
        "fakekit/rank_loads.py:1 imports fakekit.run.widgets", "importing it loads fakekit.run"]


def test_planted_kernel_side_violations_are_found(fake):
    imported = fresh_imports(fake, ["fakekit.kernel", "fakekit.kernel_pg", "fakekit.run.launch"], KERNEL_HEAVY)
    assert kernel_side_findings(fake, "fakekit", "fakekit.kernel", imported["fakekit.kernel"]) == [
        "importing it loads torch"]
    assert kernel_side_findings(fake, "fakekit", "fakekit.kernel_pg", imported["fakekit.kernel_pg"]) == [
        "fakekit/kernel_pg.py:3 calls init_process_group()"]
    assert kernel_side_findings(fake, "fakekit", "fakekit.run.launch", imported["fakekit.run.launch"]) == []


def test_planted_reach_unsided_and_lab_importers_are_found(fake):
    assert reached(fake, "fakekit", "fakekit.rank", ["fakekit.run"]) == [
        "fakekit.rank -> fakekit.run   (fakekit/rank.py:2)",
        "fakekit.rank -> fakekit.run.launch   (fakekit/rank.py:2)"]
    assert reached(fake, "fakekit", "fakekit.user", ["fakekit.run"]) == []
    found = unsided(fake, "fakekit", ["fakekit.a", "fakekit.b"], ["fakekit.b"])
    assert "fakekit.b: on kernel and rank side" in found and "fakekit.user: on no side" in found
    assert not [line for line in found if line.startswith("fakekit.a:")]
    assert lab_importers(fake, "fakekit", lab="sub") == [
        "fakekit/user.py:1: fakekit.user imports fakekit.sub.d"]


def test_planted_long_module_is_found(fake):
    assert long_modules(fake, "fakekit") == [f"fakekit/long.py: {MAX_LINES + 1} lines"]


def torch_config_monkeypatches(source: str) -> list[str]:
    """`monkeypatch.setattr(X, ...)` where X names a torch config module (`torch._inductor.config`,
    `torch._dynamo.config`, or a name imported from one): pytest's undo deletes such a module's
    entry, and every later compile in the run fails ("... does not exist"). torch's own
    `config.patch(...)` restores it."""
    tree = ast.parse(source)
    configs = {a.asname or a.name for n in ast.walk(tree) if isinstance(n, ast.Import)
               for a in n.names if a.name.startswith("torch.") and a.name.endswith(".config")}
    configs |= {a.asname or a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)
                and (n.module or "").startswith("torch.") for a in n.names if a.name == "config"}
    found = []
    for n in ast.walk(tree):
        if (isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)
                and n.func.attr == "setattr" and ast.unparse(n.func.value) == "monkeypatch"
                and n.args):
            target = ast.unparse(n.args[0])
            if target in configs or (target.startswith("torch.") and target.endswith(".config")):
                found.append(f"line {n.lineno}: monkeypatch.setattr({target}, ...)")
    return found


def test_no_test_monkeypatches_a_torch_config_module():
    found = [f"{p.name} {hit}" for p in sorted((ROOT / "tests").glob("*.py"))
             for hit in torch_config_monkeypatches(p.read_text())]
    assert not found, "use torch's config.patch(...) instead:\n" + "\n".join(found)
    planted = ("import torch._inductor.config as ic\n"
               "def test(monkeypatch):\n    monkeypatch.setattr(ic, 'fallback_random', True)\n")
    assert torch_config_monkeypatches(planted) == ["line 3: monkeypatch.setattr(ic, ...)"]
