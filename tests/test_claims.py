"""The articles' claims (kit.lab.claims) and where the notebooks settle them (code-cell metadata),
and the table `python -m kit.lab.claims_table` builds from both."""

from __future__ import annotations

import re
import subprocess
import sys

import nbformat
from conftest import ROOT

from kit.bench import records
from kit.lab import claims_table
from kit.lab.claims import BY_ID, CLAIMS, LABELS, VERDICTS

# Claims no notebook cell settles yet. Settling one (a cell whose metadata names it) fails
# test_every_claim_is_settled_but_the_known_few until it leaves this set.
KNOWN_UNSETTLED: set[str] = set()


def test_54_claims_30_from_the_first_article_24_from_the_second():
    ids = [c.id for c in CLAIMS]
    assert len(ids) == len(set(ids)) == 54
    assert ids == [f"A{i:02d}" for i in range(1, 31)] + [f"B{i:02d}" for i in range(1, 25)]
    assert all(c.claim and c.where for c in CLAIMS)


def test_three_verdicts_demonstrated_holds_with_a_caveat_corrected():
    assert VERDICTS == ("demonstrated", "caveat", "corrected")
    assert [LABELS[v] for v in VERDICTS] == ["demonstrated", "holds, with a caveat", "corrected"]


def test_the_notebooks_claim_metadata_is_sound():
    assert claims_table.problems() == []


def _notebook(folder, claims, caveats=None, cell_type="code"):
    nb = nbformat.v4.new_notebook()
    cell = nbformat.v4.new_code_cell("print(1)") if cell_type == "code" else \
        nbformat.v4.new_markdown_cell("# a heading")
    cell.metadata["claims"] = claims
    if caveats is not None:
        cell.metadata["caveats"] = caveats
    nb.cells.append(cell)
    nbformat.write(nb, str(folder / "x.ipynb"))


def test_a_verdict_outside_the_three_is_refused(tmp_path):
    _notebook(tmp_path, {"A01": "plausible"})
    [problem] = claims_table.problems(tmp_path)
    assert "A01 'plausible' is not a verdict (demonstrated, caveat, corrected)" in problem


def test_a_caveat_names_itself_in_one_line_and_only_beside_its_verdict(tmp_path):
    _notebook(tmp_path, {"A19": "caveat"})
    assert "A19 holds with a caveat: name it in one line" in claims_table.problems(tmp_path)[0]
    _notebook(tmp_path, {"A19": "caveat"}, {"A19": "two\nlines"})
    assert len(claims_table.problems(tmp_path)) == 1
    _notebook(tmp_path, {"A19": "demonstrated"}, {"A19": "a caveat"})
    assert "whose verdict here is not 'caveat'" in claims_table.problems(tmp_path)[0]
    _notebook(tmp_path, {"A19": "caveat"}, {"A19": "without flash-attn the kit falls back to sdpa"})
    assert claims_table.problems(tmp_path) == []
    assert "holds, with a caveat: without flash-attn the kit falls back to sdpa |" in \
        claims_table.table(tmp_path)
    assert claims_table.counts(tmp_path)["caveat"] == 1
    _notebook(tmp_path, {"Z99": "demonstrated"}, cell_type="markdown")
    assert "claims belong on a code cell" in claims_table.problems(tmp_path)[0]


def test_every_claim_cites_a_code_cell():
    cited = {r["claim"] for r in claims_table.settlements()}
    assert [c.id for c in CLAIMS if c.id not in cited] == []


def test_every_metadata_claim_exists_with_a_verdict_on_a_code_cell():
    marked = 0
    for path in sorted((ROOT / "notebooks").glob("*.ipynb")):
        for cell in nbformat.read(str(path), as_version=4).cells:
            found = cell.metadata.get("claims")
            if found is None:
                continue
            marked += 1
            assert cell.cell_type == "code", (path.name, cell.get("id"))
            assert found and set(found) <= set(BY_ID), (path.name, cell.get("id"), found)
            assert set(found.values()) <= set(VERDICTS), (path.name, cell.get("id"), found)
    assert marked >= 40


def test_every_claim_is_settled_but_the_known_few():
    rows = claims_table.settlements()
    by_cell = {r["claim"] for r in rows}
    recorded = {c.id for c in CLAIMS if c.record and c.record in records.names()}
    assert {c.id for c in CLAIMS if c.record} == recorded  # every named record exists
    assert {c.id for c in CLAIMS} - (by_cell | recorded) == KNOWN_UNSETTLED
    assert not KNOWN_UNSETTLED & by_cell


def test_a_recorded_result_is_read_where_its_claim_is_settled():
    """A claim settled on GPUs names its record; the notebook of a cell that settles it reads that
    record (its report or its rows, through kit.bench.records)."""
    rows = claims_table.settlements()
    for c in (c for c in CLAIMS if c.record):
        notebooks = {r["notebook"] for r in rows if r["claim"] == c.id}
        assert notebooks, c.id
        sources = ["".join(cell.source for cell in nbformat.read(
            str(ROOT / "notebooks" / f"{n}.ipynb"), as_version=4).cells) for n in notebooks]
        assert any(c.record in s for s in sources), c.id


def test_each_claim_has_one_verdict():
    rows = claims_table.settlements()
    for c in CLAIMS:
        verdicts = {r["verdict"] for r in rows if r["claim"] == c.id}
        assert len(verdicts) <= 1, (c.id, verdicts)


def test_the_generator_prints_every_claim_once():
    done = subprocess.run([sys.executable, "-m", "kit.lab.claims_table"], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    ids = re.findall(r"^\| ([AB]\d\d) \|", done.stdout, flags=re.M)
    assert ids == [c.id for c in CLAIMS]
    for line in done.stdout.splitlines()[2:]:
        verdict = line.rsplit(" | ", 1)[1].removesuffix(" |")
        label = verdict.split(": ", 1)[0] if verdict.startswith(LABELS["caveat"]) else verdict
        assert label in (*LABELS.values(), claims_table.UNSETTLED), line
        assert (label == LABELS["caveat"]) == (": " in verdict), line  # a caveat says what it is
    assert done.stdout == claims_table.table()


def test_write_replaces_only_the_block_between_the_markers(tmp_path, capsys):
    page = tmp_path / "page.md"
    page.write_text(f"# Title\n\nbefore\n{claims_table.START}\nold table\n{claims_table.END}\nafter\n")
    assert claims_table.main(["--write", str(page)]) == 0  # python -m kit.lab.claims_table --write
    text = page.read_text()
    assert text.startswith("# Title\n\nbefore\n") and text.endswith(f"{claims_table.END}\nafter\n")
    assert "old table" not in text and claims_table.block_of(text) == claims_table.table()
    page.write_text("no markers here\n")
    assert claims_table.main(["--write", str(page)]) == 2
    assert "no <!-- claims:start -->" in capsys.readouterr().err
    assert page.read_text() == "no markers here\n"


def test_the_claims_page_holds_the_generated_table():
    assert claims_table.block_of((ROOT / "docs" / "claims.md").read_text()) == claims_table.table()


def test_the_claims_page_states_the_counts_the_table_has():
    text = (ROOT / "docs" / "claims.md").read_text()
    found = claims_table.counts()
    stated = re.search(r"All 54 are settled: (\d+) demonstrated,\s+(\d+) hold with a caveat,\s+(\d+) "
                       r"corrected", text)
    assert stated, "docs/claims.md: 'All 54 are settled: N demonstrated, N hold with a caveat, N corrected'"
    assert [int(n) for n in stated.groups()] == [found.get(v, 0) for v in VERDICTS]
