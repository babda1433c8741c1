"""benchmarks/ as a record: the runner, the matrices, the dated records and their index, the tools;
every `benchmarks/...` path the kit, the docs, the front page and the notebooks name exists; the
one loader (kit.bench.records) reads what they read."""

from __future__ import annotations

import json
import re
import subprocess

import pytest
import yaml
from conftest import ROOT

from kit.bench import records

BENCH = ROOT / "benchmarks"
NAME = re.compile(r"^\d{4}-\d{2}-\d{2}-[a-z0-9]+(-[a-z0-9]+)*$")
PATH = re.compile(r"benchmarks/[\w./-]*")


def test_the_top_level_holds_the_runner_the_index_matrices_records_and_tools():
    tracked = subprocess.run(["git", "ls-files", "benchmarks"], cwd=ROOT, capture_output=True,
                             text=True, check=True).stdout.split()
    top = {p.split("/")[1] for p in tracked}
    assert top <= {"run.sh", "README.md", "matrices", "records", "tools"}, top
    assert {"run.sh", "README.md", "matrices", "records"} <= top


def test_every_record_is_in_the_index_and_every_line_names_a_record():
    listed, held = records.listed(), records.names()
    assert len(listed) == len(set(listed)), "a record listed twice"
    assert sorted(listed) == held, (set(listed) ^ set(held))
    rows = [line for line in records.INDEX.read_text().splitlines() if "](records/" in line]
    assert len(rows) == len(held)  # one line per record
    for line in rows:  # date | device | record | what | headline
        date, device, _, what, headline = (c.strip() for c in line.strip("|").split(" | ")[:5])
        name = re.search(r"\(records/([^/)]+)/\)", line).group(1)
        assert name.startswith(date) and device and what and headline, line


@pytest.mark.parametrize("name", records.names())
def test_a_record_is_named_by_the_rule_and_holds_a_report_and_its_command(name):
    """<YYYY-MM-DD>-<topic>, the topic not a round or an issue; report.md and command.txt; rows as
    rows.jsonl or rows-<part>.jsonl."""
    assert NAME.match(name) and not re.search(r"round\d|issue\d", name), name
    folder = records.folder(name)
    assert (folder / "report.md").is_file() and (folder / "command.txt").is_file()
    for rows in folder.glob("*.jsonl"):
        assert re.fullmatch(r"rows(-[a-z0-9-]+)?\.jsonl", rows.name), rows
    for matrix in folder.glob("*.yaml"):  # the matrices as they ran: the loader reads each
        assert records.matrix(name, matrix.name)["cases"]


def mentioned() -> dict[str, set[str]]:
    """Every `benchmarks/...` path in kit/, docs/, README.md and notebooks/ (the notebooks' cell
    sources), by the file that names it."""
    found: dict[str, set[str]] = {}
    files = [*(ROOT / "kit").rglob("*.py"), *(ROOT / "kit").rglob("*.yaml"), *(ROOT / "docs").glob("*.md"),
             ROOT / "README.md", *(ROOT / "notebooks").glob("*.md"), *(ROOT / "notebooks").glob("*.ipynb")]
    for path in files:
        text = path.read_text()
        if path.suffix == ".ipynb":
            text = "\n".join("".join(c["source"]) for c in json.loads(text)["cells"])
        for hit in PATH.findall(text):
            hit = hit.rstrip(".,")
            if not any(ch in hit for ch in "{}*<>"):
                found.setdefault(hit, set()).add(str(path.relative_to(ROOT)))
    return found


def test_every_benchmarks_path_the_kit_docs_and_notebooks_name_exists():
    found = mentioned()
    assert "benchmarks/README.md" in found and any(p.startswith("benchmarks/records/") for p in found)
    missing = {p: sorted(w) for p, w in found.items() if not (ROOT / p).exists()}
    assert not missing, missing


def test_a_matrix_here_is_not_a_copy_that_only_its_records_name():
    """benchmarks/matrices/ keeps the matrices that are named outside the records (the kit, docs,
    notebooks, tests, tools, other matrices) or that a record ran without keeping a copy; one that
    only records name, each holding it as it is here (the same settings and cases: its comments
    may have been reworded since), is a duplicate: it lives in its record."""
    files = [*(ROOT / "kit").rglob("*.py"), *(ROOT / "kit").rglob("*.yaml"),
             *(ROOT / "docs").glob("*.md"), ROOT / "README.md", *(ROOT / "notebooks").iterdir(),
             *(ROOT / "tests").glob("*.py"), *(BENCH / "tools").rglob("*"), BENCH / "README.md",
             *(ROOT / ".ci").iterdir(), *(BENCH / "matrices").glob("*.yaml")]
    texts = {f: f.read_text(errors="replace") for f in files if f.is_file()}
    duplicates = []
    for matrix in (BENCH / "matrices").glob("*.yaml"):
        if any(matrix.name in t for f, t in texts.items() if f != matrix):
            continue
        ran = [d for d in (BENCH / "records").iterdir()
               if any(matrix.name in f.read_text(errors="replace")
                      for f in d.glob("*") if f.suffix in (".md", ".txt"))]
        here = yaml.safe_load(matrix.read_text())
        if ran and all((d / matrix.name).is_file()
                       and yaml.safe_load((d / matrix.name).read_text()) == here for d in ran):
            duplicates.append(f"{matrix.name} (in {', '.join(d.name for d in ran)})")
    assert not duplicates, duplicates


def test_the_loader_reads_a_records_rows_matrix_and_report_and_names_what_is_missing():
    name = "2026-11-23-speed-8b-2xh200"
    rows, matrix = records.rows(name), records.matrix(name)
    assert rows and matrix["model"] == "kit:llama-8b" and "1.52x" in records.report(name)
    assert records.rows("2026-11-25-planned-defaults-1xh100", "8b")
    with pytest.raises(FileNotFoundError, match="did you mean 2026-11-22-speed-8b-2xh200"):
        records.rows("speed-8b-2xh200")
    with pytest.raises(FileNotFoundError, match="it holds .*rows.jsonl"):
        records.rows(name, "nope")
    with pytest.raises(FileNotFoundError, match="5 matrices"):
        records.matrix("2026-11-25-planned-defaults-1xh100")


def test_the_runner_runs_a_tool_detached_and_polls_it(tmp_path):
    """run.sh with a script instead of a matrix, no GPU: the folder gets command.txt, device.txt,
    run.log, rc and DONE; exit 3 while it runs, its status once done; a second start refused."""
    tool, out = tmp_path / "tool.sh", tmp_path / "out"
    tool.write_text('echo "args: $*"; sleep 3; exit 4\n')
    out.mkdir()
    run = BENCH / "run.sh"
    env = {"PATH": "/usr/bin:/bin", "POLL_S": "0", "OUT": str(out), "HOME": str(tmp_path)}
    first = subprocess.run(["bash", run, tool, tmp_path / "d", "x"], capture_output=True, text=True,
                           env=env, timeout=60)
    assert first.returncode == 3 and "--poll" in first.stdout, first.stdout + first.stderr
    again = subprocess.run(["bash", run, tool, tmp_path / "d"], capture_output=True, text=True,
                           env=env, timeout=60)
    assert again.returncode == 2 and "in progress" in again.stderr
    done = subprocess.run(["bash", run, "--poll", tmp_path / "d", "30"], capture_output=True,
                          text=True, env=env, timeout=60)
    assert done.returncode == 4 and f"args: {tmp_path / 'd'} x" in done.stdout, done.stdout
    assert {"command.txt", "device.txt", "run.log", "rc", "DONE"} <= {p.name for p in (tmp_path / "d").iterdir()}
    assert (out / "d.tgz").is_file()
