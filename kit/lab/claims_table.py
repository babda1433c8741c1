"""Where each of the articles' claims is settled: kit.lab.claims (the claims) joined with the notebooks'
code-cell metadata (`"claims": {"A07": "demonstrated"}`; a "caveat" verdict with its one line in
`"caveats": {"A19": "..."}`), as a markdown table with three verdicts: demonstrated, holds with a
caveat, corrected (kit.lab.claims.VERDICTS).

    python -m kit.lab.claims_table                     # print the table
    python -m kit.lab.claims_table --write docs/claims.md   # replace the table between the two markers

Kernel side: no torch (nbformat reads the notebooks as JSON).
"""

from __future__ import annotations

from pathlib import Path

import nbformat

from kit.bench import records
from kit.lab.claims import BY_ID, CLAIMS, LABELS, VERDICTS

ROOT = Path(__file__).resolve().parents[2]
NOTEBOOKS = ROOT / "notebooks"
START, END = "<!-- claims:start -->", "<!-- claims:end -->"
UNSETTLED = "not settled"


def settlements(folder: Path = NOTEBOOKS) -> list[dict]:
    """One row per (claim, code cell) the notebooks' metadata names: the notebook, the section
    heading above the cell, the cell's index and id, the verdict (an id of VERDICTS) and, for a
    "caveat" verdict, the cell's one-line caveat (metadata "caveats"; None otherwise)."""
    rows = []
    for path in sorted(folder.glob("*.ipynb")):
        heading = ""
        for index, cell in enumerate(nbformat.read(str(path), as_version=4).cells):
            if cell.cell_type == "markdown":
                found = [line.lstrip("#").strip() for line in cell.source.splitlines()
                         if line.startswith("#")]
                heading = found[-1] if found else heading
            caveats = cell.metadata.get("caveats", {})
            for claim, verdict in cell.metadata.get("claims", {}).items():
                rows.append({"claim": claim, "verdict": verdict, "notebook": path.stem,
                             "section": heading, "index": index, "id": cell.get("id"),
                             "caveat": caveats.get(claim)})
    return rows


def verdict_of(rows: list[dict]) -> str:
    """The claim's verdict as the table prints it: the label of the one its cells agree on
    (kit.lab.claims.LABELS), "holds, with a caveat: <the caveat>" for a caveat, 'not settled'
    without cells; verdicts that disagree are joined with " / " (tests/test_claims.py refuses them)."""
    found = sorted({r["verdict"] for r in rows})
    if not found:
        return UNSETTLED
    caveats = sorted({r["caveat"] for r in rows if r["verdict"] == "caveat" and r["caveat"]})
    labels = [LABELS.get(v, v) + (f": {'; '.join(caveats)}" if v == "caveat" and caveats else "")
              for v in found]
    return " / ".join(labels)


def _by_claim(folder: Path) -> dict[str, list[dict]]:
    by_claim: dict[str, list[dict]] = {}
    for row in settlements(folder):
        by_claim.setdefault(row["claim"], []).append(row)
    return by_claim


def table(folder: Path = NOTEBOOKS) -> str:
    """The markdown table: claim id | claim | notebook and cell | verdict."""
    by_claim = _by_claim(folder)
    lines = ["| claim | what the article says | notebook and cell | verdict |",
             "|---|---|---|---|"]
    for c in CLAIMS:
        rows = by_claim.get(c.id, [])
        cells = [f"`{r['notebook']}` § {r['section']}, cell {r['index']} (`{r['id']}`)" for r in rows]
        if c.record:
            cells.append(f"recorded: `{records.path(c.record).relative_to(ROOT)}`")
        what = f"{c.claim} ({c.where})".replace("|", "\\|")
        verdict = verdict_of(rows).replace("|", "\\|")
        lines.append(f"| {c.id} | {what} | {'<br>'.join(cells) or '-'} | {verdict} |")
    return "\n".join(lines) + "\n"


def counts(folder: Path = NOTEBOOKS) -> dict[str, int]:
    """How many claims have each verdict, by verdict id (VERDICTS), 'not settled' included."""
    by_claim, found = _by_claim(folder), {}
    for c in CLAIMS:
        v = " / ".join(sorted({r["verdict"] for r in by_claim.get(c.id, [])})) or UNSETTLED
        found[v] = found.get(v, 0) + 1
    return found


def problems(folder: Path = NOTEBOOKS) -> list[str]:
    """What is wrong with the notebooks' claim metadata, one line each: a claim on a cell that is
    not code, an id kit.lab.claims does not know, a verdict outside VERDICTS, a "caveat" verdict
    without its one-line caveat, a caveat beside a verdict that is not "caveat". Empty when sound."""
    found = []
    for path in sorted(folder.glob("*.ipynb")):
        for index, cell in enumerate(nbformat.read(str(path), as_version=4).cells):
            claims, caveats = cell.metadata.get("claims"), cell.metadata.get("caveats", {})
            if claims is None and not caveats:
                continue
            where = f"{path.name} cell {index} ({cell.get('id')})"
            if cell.cell_type != "code" or not claims:
                found.append(f"{where}: claims belong on a code cell that names at least one")
                continue
            for claim, verdict in claims.items():
                if claim not in BY_ID:
                    found.append(f"{where}: {claim!r} is not one of the articles' claims")
                if verdict not in VERDICTS:
                    found.append(f"{where}: {claim} {verdict!r} is not a verdict ({', '.join(VERDICTS)})")
                text = caveats.get(claim)
                if verdict == "caveat" and (not isinstance(text, str) or not text.strip()
                                            or "\n" in text.strip()):
                    found.append(f"{where}: {claim} holds with a caveat: name it in one line "
                                 f'(metadata "caveats": {{"{claim}": "..."}})')
            for claim in set(caveats) - {k for k, v in claims.items() if v == "caveat"}:
                found.append(f"{where}: a caveat for {claim}, whose verdict here is not 'caveat'")
    return found


def replace_block(text: str, block: str) -> str:
    """`text` with what lies between the START and END markers replaced by `block`."""
    if START not in text or END not in text or text.index(START) > text.index(END):
        raise ValueError(f"the file has no {START} ... {END} block")
    head, rest = text.split(START, 1)
    _, tail = rest.split(END, 1)
    return f"{head}{START}\n{block}{END}{tail}"


def block_of(text: str) -> str:
    """What lies between the markers (without the newline after START)."""
    if START not in text or END not in text:
        raise ValueError(f"the file has no {START} ... {END} block")
    return text.split(START, 1)[1].split(END, 1)[0].removeprefix("\n")


def main(argv: list[str] | None = None) -> int:
    """`python -m kit.lab.claims_table` prints the table; `--write FILE` replaces the block between
    the markers in FILE (docs/claims.md's, regenerated whenever a notebook's claims change)."""
    import argparse
    import sys

    parser = argparse.ArgumentParser(prog="python -m kit.lab.claims_table", description=main.__doc__)
    parser.add_argument("--write", type=Path, metavar="FILE")
    args = parser.parse_args(argv)
    text = table()
    if args.write is None:
        print(text, end="")
        return 0
    try:
        args.write.write_text(replace_block(args.write.read_text(), text))
    except (OSError, ValueError) as e:
        print(f"claims: {args.write}: {e}", file=sys.stderr)
        return 2
    print(f"{args.write}: claims table written ({len(text.splitlines()) - 2} claims)")
    return 0


__all__ = ["VERDICTS", "LABELS", "settlements", "table", "counts", "problems", "replace_block", "block_of", "main"]

if __name__ == "__main__":
    raise SystemExit(main())
