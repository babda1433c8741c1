"""The course as a new learner walks it: JupyterLab in headless Chromium, every notebook of the
start page run with Run > Run All Cells, then each exercise answered wrong and right, screenshots.

    bash benchmarks/tools/walkthrough.sh     # the whole thing from scratch (fresh clone, venv, setup)
    python benchmarks/tools/walkthrough.py --root CLONE [--only 00c-setup 03] [--out RECORD]

Run with the clone's venv Python (the one `bash setup.sh` installed into, with `playwright` added):
it starts `jupyter lab` from the clone root (the kit has no command that opens JupyterLab; the start
page says "open JupyterLab on this folder"), opens the start page notebooks/00-start-here.ipynb
(markdown only: it opens rendered) from the file browser, opens each notebook by clicking its link
on that page, runs every cell from the Run menu, waits until the
kernel is idle and no cell shows [*], saves (Ctrl+S) and reads the saved file for error outputs
(JupyterLab renders an error as stderr text, so the page alone does not tell an error from a
warning), then types each exercise's answer into its cell (the likely wrong answer first, then the
solution, both computed here with the clone's kit.lab.exercises) and runs it and its check cell
with Shift+Enter. Writes a record (benchmarks/README.md): OUT/report.md, OUT/walkthrough.json and
OUT/screenshots/*.jpg; OUT by default benchmarks/records/<today>-course-walkthrough-cpu/.
Needs chromium at /usr/bin/chromium (apt-get install chromium); Playwright drives it, with no
`playwright install`.
"""

from __future__ import annotations

import argparse
import ast
import datetime as dt
import importlib.metadata as md
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from playwright.sync_api import Page, sync_playwright

CHROMIUM = "/usr/bin/chromium"
TOKEN = "walkthrough"
START_PAGE = "00-start-here.ipynb"  # the course's start: markdown only, opens rendered
VIEW = {"width": 1280, "height": 900}
NB = ".jp-NotebookPanel:not(.lm-mod-hidden)"  # the notebook tab in front
MAX_SHOT = 150_000  # bytes per screenshot
START = time.time()


def log(msg: str) -> None:
    print(f"[{time.time() - START:7.1f}s] {msg}", flush=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_page_order(root: Path) -> list[tuple[str, float | None]]:
    """The notebooks in the start page's map, in order, with its machine minutes column."""
    cells = json.loads((root / "notebooks" / START_PAGE).read_text())["cells"]
    text = "\n\n".join("".join(c["source"]) for c in cells if c["cell_type"] == "markdown")
    found = []
    row = r"^\| ★? \| \[`([^`]+)`\]\(([^)]+\.ipynb)\) \| \d+ \| ([\d.]+) \|"
    for m in re.finditer(row, text, re.M):
        found.append((m.group(2), float(m.group(3))))
    if not found:
        raise SystemExit(f"no notebook table found in notebooks/{START_PAGE}")
    return found


class Shots:
    def __init__(self, folder: Path, quality: int, clear: bool = True):
        self.folder, self.quality = folder, quality
        folder.mkdir(parents=True, exist_ok=True)
        for old in folder.glob("*.jpg") if clear else ():
            old.unlink()

    def take(self, page: Page, name: str, clip: dict | None = None) -> str:
        path = self.folder / f"{name}.jpg"
        for q in (self.quality, 50, 40, 30):
            page.screenshot(path=str(path), type="jpeg", quality=q, clip=clip)
            if path.stat().st_size <= MAX_SHOT:
                break
        return path.name


# --- JupyterLab helpers -------------------------------------------------------------------------

def menu(page: Page, top: str, item: str) -> None:
    page.locator(".lm-MenuBar-itemLabel", has_text=re.compile(f"^{re.escape(top)}$")).first.click()
    page.locator(".lm-Menu-itemLabel", has_text=re.compile(f"^{re.escape(item)}")).first.click()


def dismiss_toasts(page: Page) -> None:
    """The first start asks about Jupyter news in a toast over the notebook: answer No."""
    no = page.locator(".Toastify__toast button", has_text=re.compile("^No$"))
    if no.count():
        no.first.click()
        log("dismissed the 'Jupyter news' toast (No)")


def accept_dialog_if_any(page: Page, what: str) -> str | None:
    d = page.locator(".jp-Dialog")
    if d.count() and d.first.is_visible():
        text = d.first.inner_text()
        page.locator(".jp-Dialog .jp-mod-accept").first.click()
        log(f"{what}: accepted a dialog: {text[:120]!r}")
        return text
    return None


JS_STATE = """(sel) => {
  const nb = document.querySelector(sel);
  if (!nb) return null;
  const ind = nb.querySelector('.jp-Notebook-ExecutionIndicator');
  const prompts = Array.from(nb.querySelectorAll('.jp-CodeCell .jp-InputPrompt')).map(e => e.innerText.trim());
  return {status: ind ? ind.getAttribute('data-status') : null,
          running: prompts.filter(p => p.includes('*')).length,
          unrun: prompts.filter(p => /\\[\\s*\\]/.test(p)).length,
          cells: prompts.length};
}"""


def wait_idle(page: Page, timeout: float, settle: int = 2, start: float | None = None) -> tuple[bool, float]:
    """Poll until the kernel is idle and no cell shows [*], `settle` polls in a row. Returns
    (finished, seconds from `start` (default: now) until the first idle poll of the final run)."""
    t0 = start or time.time()
    calm, first_calm = 0, None
    while time.time() - t0 < timeout:
        s = page.evaluate(JS_STATE, NB)
        if s and s["status"] == "idle" and s["running"] == 0:
            calm += 1
            first_calm = first_calm or time.time()
            if calm >= settle:
                return True, first_calm - t0
        else:
            calm, first_calm = 0, None
        time.sleep(2)
    return False, time.time() - t0


def save(page: Page) -> None:
    page.locator(f"{NB} .jp-Notebook").first.click(position={"x": 5, "y": 5}, force=True)
    page.keyboard.press("Escape")
    page.keyboard.press("Control+s")
    tab = page.locator(".lm-DockPanel-tabBar .lm-TabBar-tab.lm-mod-current")
    for _ in range(30):
        if "jp-mod-dirty" not in (tab.first.get_attribute("class") or ""):
            return
        time.sleep(0.5)
    log("warning: the notebook still looks unsaved after Ctrl+S")


def cell_index(page: Page, marker: str) -> int:
    return page.evaluate(
        """([sel, marker]) => Array.from(document.querySelectorAll(sel + ' .jp-Notebook .jp-Cell'))
             .findIndex(c => { const e = c.querySelector('.cm-content');
                               return e && Array.from(e.querySelectorAll('.cm-line')).some(l => l.textContent.includes(marker)); })""",
        [NB, marker])


def cells(page: Page):
    return page.locator(f"{NB} .jp-Notebook .jp-Cell")


def cell_text(cell) -> str:
    return cell.locator(".cm-content").first.evaluate(
        "e => Array.from(e.querySelectorAll('.cm-line')).map(l => l.textContent).join('\\n')")


def prompt(cell) -> str:
    return cell.locator(".jp-InputPrompt").first.inner_text().strip()


def outputs(cell) -> str:
    o = cell.locator(".jp-OutputArea-output")
    return "\n".join(o.nth(i).inner_text() for i in range(o.count())).strip()


def shoot_end(page: Page, shots: Shots, name: str) -> str:
    """The notebook's last cells. Scrolled by the last cell itself, a few times: with JupyterLab's
    content-visibility windowing, setting scrollTop to scrollHeight lands past cells not yet
    painted and shows a blank page (the first full run's end screenshots)."""
    last = cells(page).last
    for _ in range(3):
        last.evaluate("e => e.scrollIntoView({block: 'end'})")
        time.sleep(1.5)
    return shots.take(page, name)


def clip_of(page: Page, a, b) -> dict:
    ra, rb = a.bounding_box(), b.bounding_box()
    top = max(0, min(ra["y"], rb["y"]) - 6)
    bottom = min(VIEW["height"], max(ra["y"] + ra["height"], rb["y"] + rb["height"]) + 6)
    left = max(0, min(ra["x"], rb["x"]) - 6)
    right = min(VIEW["width"], max(ra["x"] + ra["width"], rb["x"] + rb["width"]) + 6)
    return {"x": left, "y": top, "width": right - left, "height": max(20, bottom - top)}


# --- the exercises ------------------------------------------------------------------------------

def literal(value, key: str, fallback: str) -> str:
    text = repr(value)
    try:
        if ast.literal_eval(text) == value:
            return text
    except (ValueError, SyntaxError):
        pass
    return fallback


def answer_pair(key: str) -> tuple[str, str, str]:
    """(wrong answer's source, right answer's source, the question), computed with the clone's kit."""
    from kit.lab import exercises

    ex = exercises.registry()[key]
    wrong = literal(ex.wrong[0], key, "-123456789") if ex.wrong else "-123456789"
    right = literal(ex.solution(), key, f'exercises.solution("{key}")')
    return wrong, right, ex.question


def answer(page: Page, key: str, original: str, value_src: str, shot_name: str, shots: Shots) -> dict:
    idx = cell_index(page, f"# EXERCISE {key}")
    if idx < 0:
        raise RuntimeError(f"{key}: no cell on the page shows '# EXERCISE {key}'")
    ex_cell, check_cell = cells(page).nth(idx), cells(page).nth(idx + 1)
    lines = original.split("\n")
    at = [i for i, line in enumerate(lines) if line.strip() == "answer = ..."]
    if len(at) != 1:
        raise RuntimeError(f"{key}: expected one 'answer = ...' line, found {len(at)}")
    lines[at[0]] = f"answer = {value_src}"
    new = "\n".join(lines)
    ex_cell.evaluate("e => e.scrollIntoView({block: 'center'})")
    time.sleep(0.3)
    ex_cell.locator(".cm-content").first.click()
    page.keyboard.press("Control+a")
    page.keyboard.insert_text(new)
    typed = cell_text(ex_cell)
    if typed != new:
        raise RuntimeError(f"{key}: the cell reads {typed!r} after typing, expected {new!r}")
    before = prompt(check_cell)
    page.keyboard.press("Shift+Enter")
    time.sleep(0.3)
    page.keyboard.press("Shift+Enter")
    t0 = time.time()
    while time.time() - t0 < 120:
        p = prompt(check_cell)
        if "*" not in p and p != before and re.search(r"\d", p):
            break
        time.sleep(0.5)
    wait_idle(page, 60, settle=1)
    time.sleep(0.5)
    out = outputs(check_cell)
    ex_cell.evaluate("e => e.scrollIntoView({block: 'center'})")
    time.sleep(0.5)
    shot = shots.take(page, shot_name, clip=clip_of(page, ex_cell, check_cell))
    return {"typed": f"answer = {value_src}", "cell": typed, "check_prompt": prompt(check_cell),
            "printed": out, "shot": shot}


# --- one notebook -------------------------------------------------------------------------------

def saved_report(path: Path) -> dict:
    nb = json.loads(path.read_text())
    errors, stderr, unrun = [], [], 0
    for i, c in enumerate(nb["cells"]):
        if c["cell_type"] != "code":
            continue
        if c.get("execution_count") is None and "".join(c["source"]).strip():
            unrun += 1
        for o in c.get("outputs", []):
            if o["output_type"] == "error":
                errors.append({"cell": i, "ename": o["ename"], "evalue": o["evalue"][:300]})
            elif o["output_type"] == "stream" and o.get("name") == "stderr":
                stderr.append({"cell": i, "text": "".join(o["text"]).strip()[:300]})
    return {"errors": errors, "stderr_outputs": len(stderr), "stderr": stderr, "unexecuted_code_cells": unrun}


def exercise_keys(path: Path) -> list[tuple[str, str]]:
    nb = json.loads(path.read_text())
    found = []
    for c in nb["cells"]:
        src = "".join(c["source"])
        m = re.search(r"# EXERCISE (\d\d\.\d)", src)
        if c["cell_type"] == "code" and m:
            found.append((m.group(1), src))
    return found


def open_from_start_page(page: Page, rel: str, base: str) -> str:
    """Click the notebook's link on the start page (its tab); returns how."""
    page.locator(".lm-DockPanel-tabBar .lm-TabBar-tab", has_text=START_PAGE).first.click()
    link = page.locator(f".jp-RenderedMarkdown a[href*='/notebooks/{rel}']").first  # lab writes /files/...
    how = "link on the start page"
    try:
        link.scroll_into_view_if_needed(timeout=5000)
        link.click(timeout=5000)
        page.locator(".lm-DockPanel-tabBar .lm-TabBar-tab.lm-mod-current", has_text=rel).first.wait_for(timeout=30000)
    except Exception as e:  # noqa: BLE001 - recorded, then the URL way
        log(f"{rel}: the start page link did not open it ({type(e).__name__}); opening by URL")
        page.goto(f"{base}/lab/tree/notebooks/{rel}?token={TOKEN}")
        how = "URL /lab/tree/notebooks/..."
    page.locator(f"{NB} .jp-Notebook").first.wait_for(timeout=60000)
    return how


def walk_notebook(page: Page, root: Path, rel: str, minutes: float | None, base: str,
                  shots: Shots, timeout: float) -> dict:
    stem = Path(rel).stem
    rec: dict = {"notebook": stem, "start_page_minutes": minutes}
    rec["opened_by"] = open_from_start_page(page, rel, base)
    time.sleep(2)
    rec["kernel_dialog"] = accept_dialog_if_any(page, stem)
    ok, _ = wait_idle(page, 120)  # the kernel started
    if not ok:
        log(f"{stem}: kernel not idle 120 s after opening")
    dismiss_toasts(page)
    kernel_name = page.locator(f"{NB} .jp-KernelName").first.inner_text().strip()
    rec["kernel"] = kernel_name
    log(f"{stem}: opened ({rec['opened_by']}), kernel {kernel_name!r}; Run > Run All Cells")
    t0 = time.time()
    menu(page, "Run", "Run All Cells")
    time.sleep(1)
    done, secs = wait_idle(page, timeout, start=t0)
    rec["run_all_s"] = round(secs, 1)
    rec["finished"] = done
    if not done:
        log(f"{stem}: still running after {timeout:.0f} s: Kernel > Interrupt Kernel")
        menu(page, "Kernel", "Interrupt Kernel")
        wait_idle(page, 60)
    state = page.evaluate(JS_STATE, NB)
    rec["page_state"] = state
    log(f"{stem}: run all took {secs:.1f} s (finished={done}); prompts {state}")
    # What the page shows: error-looking stderr (IPython's traceback header), widgets.
    rec["page_tracebacks"] = page.evaluate(
        """(sel) => Array.from(document.querySelectorAll(sel + ' .jp-OutputArea-output[data-mime-type="application/vnd.jupyter.stderr"]'))
             .map(e => e.innerText).filter(t => /^-{20,}\\n\\w+(Error|Exception|Interrupt)\\b/.test(t) || t.includes('Traceback (most recent call last)'))
             .map(t => t.slice(0, 400))""", NB)
    rec["widgets"] = page.locator(f"{NB} .jp-OutputArea-output .jupyter-widgets").count()
    rec["widget_problems"] = page.evaluate(
        """(sel) => Array.from(document.querySelectorAll(sel + ' .jp-OutputArea-output'))
             .map(e => e.innerText).filter(t => /Error displaying widget|Loading widget\\.\\.\\.|model not found/.test(t))
             .map(t => t.slice(0, 200))""", NB)
    rec["shots"] = {}
    page.evaluate("(sel) => document.querySelector(sel + ' .jp-WindowedPanel-outer').scrollTop = 0", NB)
    time.sleep(1)
    rec["shots"]["top"] = shots.take(page, f"{stem}-1-top")
    if rec["widgets"]:
        page.locator(f"{NB} .jp-OutputArea-output .jupyter-widgets").first.evaluate(
            "e => e.scrollIntoView({block: 'start'})")
        time.sleep(1.5)
        rec["shots"]["widgets"] = shots.take(page, f"{stem}-2-widgets")
    rec["shots"]["end"] = shoot_end(page, shots, f"{stem}-3-end")
    save(page)
    rec["saved"] = saved_report(root / "notebooks" / rel)
    log(f"{stem}: saved file: {rec['saved']}; widgets on page {rec['widgets']}")
    rec["exercises"] = []
    for key, original in exercise_keys(root / "notebooks" / rel):
        e: dict = {"key": key}
        try:
            wrong, right, question = answer_pair(key)
            e["question"] = question
            w = answer(page, key, original, wrong, f"{stem}-ex{key}-a-wrong", shots)
            w["ok"] = w["printed"].startswith(f"exercise {key}: not yet. Hint: ")
            r = answer(page, key, original, right, f"{stem}-ex{key}-b-right", shots)
            r["ok"] = r["printed"] == f"exercise {key}: right."
            e["wrong"], e["right"] = w, r
            log(f"{key}: wrong {w['typed']!r} -> {w['printed']!r} ({'OK' if w['ok'] else 'UNEXPECTED'})")
            log(f"{key}: right {r['typed']!r} -> {r['printed']!r} ({'OK' if r['ok'] else 'UNEXPECTED'})")
        except Exception as ex:  # noqa: BLE001 - recorded as found
            e["failure"] = f"{type(ex).__name__}: {ex}"
            log(f"{key}: FAILED {e['failure']}")
            shots.take(page, f"{stem}-ex{key}-failure")
        rec["exercises"].append(e)
    save(page)
    # Close it and shut its kernel down (one kernel at a time on 2 cores).
    menu(page, "File", "Close and Shut Down Notebook")
    time.sleep(1)
    accept_dialog_if_any(page, stem)
    time.sleep(2)
    return rec


# --- the report ---------------------------------------------------------------------------------

def versions(browser_version: str) -> dict:
    v = {}
    for name in ("jupyterlab", "notebook", "ipywidgets", "playwright", "torch"):
        try:
            v[name] = md.version(name)
        except md.PackageNotFoundError:
            v[name] = "not installed"
    v["chromium"] = browser_version
    v["python"] = sys.version.split()[0]
    return v


def cell_md(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ⏎ ")


def write_report(out: Path, res: dict) -> None:
    L = ["# The course walked in a real JupyterLab (headless Chromium), CPU", ""]
    L += [f"- date: {res['date']}", f"- commit: `{res['commit']}` (a fresh `git clone` of the repository)",
          f"- command: `{res['command']}`",
          f"- machine: {res['machine']}",
          "- versions: " + ", ".join(f"{k} {v}" for k, v in res["versions"].items()),
          f"- setup: {res.get('setup', 'see walkthrough.sh')}",
          f"- total: {res['total_s']:.0f} s in the browser for {len(res['notebooks'])} notebooks",
          f"- result: {summary(res)}",
          ""]
    L += ["How: `benchmarks/tools/walkthrough.sh` clones the repository into a temp folder, makes a venv, runs",
          "`bash setup.sh` there, sets a fresh `KIT_HOME`, adds `playwright` to that venv (Debian's",
          "`chromium` drives it; no `playwright install`) and runs `benchmarks/tools/walkthrough.py`, which",
          "starts `jupyter lab` from the clone root (the kit has no command that opens JupyterLab), opens",
          "`notebooks/00-start-here.ipynb` (it opens rendered), then for each notebook of its map, in order:",
          "clicks the notebook's link on that page, waits for the kernel, clicks Run > Run All Cells, polls",
          "until the kernel is idle and no cell shows `[*]` (the time below: from the click to the first",
          "of two such polls 2 s apart),",
          "saves (Ctrl+S) and reads the saved file for outputs of type `error` (JupyterLab renders an error",
          "as stderr text, so the page alone does not tell an error from a warning; the page's",
          "traceback-looking stderr is counted too), then answers each exercise: clicks into the cell,",
          "Ctrl+A, types the cell with its `answer = ...` line replaced (other lines kept), reads the cell",
          "back, Shift+Enter twice (the cell, then its check cell), reads what the check printed. First",
          "the exercise's first likely wrong answer (`Exercise.wrong[0]`), then its solution",
          "(`Exercise.solution()`), both computed by the driver with the clone's `kit.lab.exercises`",
          "after the notebook ran, typed as Python literals. Then File > Close and Shut Down Notebook.",
          ""]
    if res.get("reshoot_end"):
        L += ["The `end` screenshots were taken again after the walk (`" + res["reshoot_end"] + "`): the walk's",
              "own were blank (the driver scrolled past what JupyterLab had painted; fixed in the driver). They",
              "show each notebook as the walk saved it: the outputs of its Run All, the exercises answered right.", ""]
    L += [f"Start page: [screenshot](screenshots/{res['start_page_shot']}), "
          f"[without the file browser](screenshots/{res.get('start_page_shot_wide', '')})", ""]
    L += ["## Notebooks", "",
          "| notebook | run all (s) | start page says (min) | finished | errors (saved file) | tracebacks on page | stderr outputs | widgets | screenshots |",
          "|---|---|---|---|---|---|---|---|---|"]
    for n in res["notebooks"]:
        if "fatal" in n:
            L.append(f"| {n['notebook']} | - | {n.get('start_page_minutes')} | no | driver failure: {cell_md(n['fatal'])} | | | | |")
            continue
        errs = "; ".join(f"cell {e['cell']}: {e['ename']}: {e['evalue'][:80]}" for e in n["saved"]["errors"]) or "none"
        shots = ", ".join(f"[{k}](screenshots/{v})" for k, v in n["shots"].items())
        L.append(f"| {n['notebook']} | {n['run_all_s']} | {n['start_page_minutes']} | "
                 f"{'yes' if n['finished'] else 'NO (timeout)'} | {cell_md(errs)} | {len(n['page_tracebacks'])} | "
                 f"{n['saved']['stderr_outputs']} | {n['widgets']}{' (problems: ' + str(len(n['widget_problems'])) + ')' if n['widget_problems'] else ''} | {shots} |")
    L += ["", "## Exercises", "",
          "| exercise | typed (wrong) | the check printed | as expected | typed (right) | the check printed | as expected | screenshots |",
          "|---|---|---|---|---|---|---|---|"]
    for n in res["notebooks"]:
        for e in n.get("exercises", []):
            if "failure" in e:
                L.append(f"| {e['key']} | driver failure: {cell_md(e['failure'])} | | | | | | |")
                continue
            w, r = e["wrong"], e["right"]
            L.append(f"| {e['key']} | `{cell_md(w['typed'])}` | {cell_md(w['printed'])} | {'yes' if w['ok'] else 'NO'} | "
                     f"`{cell_md(r['typed'])}` | {cell_md(r['printed'])} | {'yes' if r['ok'] else 'NO'} | "
                     f"[wrong](screenshots/{w['shot']}), [right](screenshots/{r['shot']}) |")
    warn = [(n["notebook"], e) for n in res["notebooks"] if "saved" in n for e in n["saved"].get("stderr", [])]
    if warn:
        L += ["", "## stderr outputs (not errors)", ""]
        L += [f"- {nb}, cell {e['cell']}: `{cell_md(e['text'])}`" for nb, e in warn]
    L += ["", "## Found", ""]
    found = res.get("found") or ["nothing: every notebook ran without an error output and every check said what it should."]
    L += [f"- {f}" for f in found]
    L += ["", f"Screenshots: {res['shots_count']} JPEG files, {res['shots_bytes'] / 1e6:.2f} MB in `screenshots/`.", ""]
    (out / "report.md").write_text("\n".join(L))


def summary(res: dict) -> str:
    nbs = res["notebooks"]
    clean = sum(1 for n in nbs if n.get("finished") and not n["saved"]["errors"])
    exs = [e for n in nbs for e in n.get("exercises", [])]
    good = sum(1 for e in exs if "failure" not in e and e["wrong"]["ok"] and e["right"]["ok"])
    return (f"{clean} of {len(nbs)} notebooks ran all their cells without an error output; "
            f"{good} of {len(exs)} exercises: the wrong answer got a hint and the solution 'right.'")


def findings(res: dict) -> list[str]:
    found = []
    for n in res["notebooks"]:
        if "fatal" in n:
            found.append(f"{n['notebook']}: the driver failed: {n['fatal']}")
            continue
        if not n["finished"]:
            found.append(f"{n['notebook']}: Run All did not finish within the timeout")
        for e in n["saved"]["errors"]:
            found.append(f"{n['notebook']}: error output in cell {e['cell']}: {e['ename']}: {e['evalue'][:200]}")
        if n["saved"]["unexecuted_code_cells"] and not n["saved"]["errors"]:
            found.append(f"{n['notebook']}: {n['saved']['unexecuted_code_cells']} code cells not executed")
        if n["page_tracebacks"] and not n["saved"]["errors"]:
            found.append(f"{n['notebook']}: {len(n['page_tracebacks'])} traceback-looking stderr outputs on the page "
                         f"(no error output in the file): {n['page_tracebacks'][0][:200]!r}")
        for p in n["widget_problems"]:
            found.append(f"{n['notebook']}: widget did not render: {p!r}")
        if n.get("kernel") and "kit" not in n["kernel"]:
            found.append(f"{n['notebook']}: kernel shown as {n['kernel']!r}, not 'Python 3 (kit)'")
        for e in n.get("exercises", []):
            if "failure" in e:
                found.append(f"{e['key']}: the driver could not answer it: {e['failure']}")
                continue
            if not e["wrong"]["ok"]:
                found.append(f"{e['key']}: wrong answer {e['wrong']['typed']!r} printed {e['wrong']['printed']!r}")
            if not e["right"]["ok"]:
                found.append(f"{e['key']}: right answer {e['right']['typed']!r} printed {e['right']['printed']!r}")
    return found


def stop(lab: subprocess.Popen) -> None:
    """jupyter lab and its kernels (its own session): TERM, then KILL after 20 s."""
    try:
        os.killpg(lab.pid, signal.SIGTERM)
        lab.wait(timeout=20)
    except subprocess.TimeoutExpired:
        os.killpg(lab.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    log("jupyter lab stopped")


def wait_for_server(base: str, seconds: int = 120) -> None:
    """Until JupyterLab's API answers at `base` (at most `seconds`)."""
    for _ in range(seconds):
        try:
            urllib.request.urlopen(f"{base}/api/status?token={TOKEN}", timeout=2)
            return
        except OSError:
            time.sleep(1)


def reshoot_end(a, root: Path, order, base: str, shots: Shots) -> int:
    res = json.loads((a.out / "walkthrough.json").read_text())
    by_name = {n["notebook"]: n for n in res["notebooks"]}
    wait_for_server(base)
    with sync_playwright() as p:
        browser = p.chromium.launch_persistent_context(
            str(root / ".walkthrough-jupyter" / "chromium-profile"), executable_path=CHROMIUM,
            args=["--no-sandbox"], headless=True, viewport=VIEW)
        page = browser.pages[0] if browser.pages else browser.new_page()
        for rel, _ in order:
            stem = Path(rel).stem
            page.goto(f"{base}/lab/tree/notebooks/{rel}?token={TOKEN}")
            page.locator(f"{NB} .jp-Notebook").first.wait_for(timeout=60000)
            time.sleep(3)
            accept_dialog_if_any(page, stem)
            dismiss_toasts(page)
            if page.locator(".jp-LabShell .jp-SideBar.jp-mod-left .lm-TabBar-tab.lm-mod-current").count():
                page.keyboard.press("Control+b")
            name = shoot_end(page, shots, f"{stem}-3-end")
            if stem in by_name and "shots" in by_name[stem]:
                by_name[stem]["shots"]["end"] = name
                by_name[stem]["end_shot_note"] = ("re-rendered after the walk from the saved notebook "
                                                  "(outputs of the walk's run, exercises answered right)")
            log(f"{stem}: end screenshot {name}")
            menu(page, "File", "Close and Shut Down Notebook")
            time.sleep(1)
            accept_dialog_if_any(page, stem)
            time.sleep(1)
        browser.close()
    files = list(shots.folder.glob("*.jpg"))
    res["shots_count"], res["shots_bytes"] = len(files), sum(f.stat().st_size for f in files)
    res["reshoot_end"] = a.command
    json.dump(res, open(a.out / "walkthrough.json", "w"), indent=1)
    write_report(a.out, res)
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--root", type=Path, required=True, help="the clone to walk (its notebooks get outputs)")
    ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parents[1] / "records"
                    / f"{time.strftime('%Y-%m-%d')}-course-walkthrough-cpu")
    ap.add_argument("--only", nargs="*", help="notebook name prefixes")
    ap.add_argument("--timeout", type=float, default=480, help="seconds per notebook at least")
    ap.add_argument("--quality", type=int, default=60)
    ap.add_argument("--command", default=" ".join(sys.argv))
    ap.add_argument("--setup", default=None, help="a line on the setup, for the report")
    ap.add_argument("--reshoot-end", action="store_true",
                    help="after a walk: open each saved notebook of --root (no run) and take its "
                    "end screenshot again; updates OUT/walkthrough.json and the report")
    a = ap.parse_args(argv)
    root = a.root.resolve()
    import kit  # the clone's kit (installed editable by its setup.sh)

    if not Path(kit.__file__).resolve().is_relative_to(root):
        raise SystemExit(f"kit is imported from {kit.__file__}, not from {root}")
    os.chdir(root)
    order = start_page_order(root)
    if a.only:
        order = [o for o in order if any(Path(o[0]).stem.startswith(p) for p in a.only)]
    shots = Shots(a.out / "screenshots", a.quality, clear=not a.reshoot_end)
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    jupyter = Path(sys.executable).parent / "jupyter"
    lab_log = open(root / "walkthrough-jupyter.log", "w")  # in the clone, beside its outputs
    # A new learner's JupyterLab: no settings or workspace left from an earlier session on this
    # machine (they live under ~/.jupyter and would reopen old tabs and folders).
    fresh = root / ".walkthrough-jupyter"
    shutil.rmtree(fresh, ignore_errors=True)
    env = dict(os.environ, JUPYTER_CONFIG_DIR=str(fresh / "config"), JUPYTER_RUNTIME_DIR=str(fresh / "runtime"))
    lab = subprocess.Popen([str(jupyter), "lab", "--no-browser", f"--port={port}", "--ip=127.0.0.1",
                            f"--ServerApp.token={TOKEN}", "--allow-root",
                            f"--LabApp.user_settings_dir={fresh / 'settings'}",
                            f"--LabApp.workspaces_dir={fresh / 'workspaces'}"],
                           cwd=root, env=env, stdout=lab_log, stderr=subprocess.STDOUT, start_new_session=True)
    log(f"jupyter lab pid {lab.pid} on {base}, root {root}, KIT_HOME={os.environ.get('KIT_HOME')}")
    if a.reshoot_end:
        try:
            return reshoot_end(a, root, order, base, shots)
        finally:
            stop(lab)
    res: dict = {"date": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
                 "commit": subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True,
                                          text=True).stdout.strip(),
                 "command": a.command, "setup": a.setup,
                 "machine": f"{os.cpu_count()} CPU cores, {os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES') / 2**30:.0f} GiB, no GPU",
                 "notebooks": []}
    t_all = time.time()
    try:
        wait_for_server(base)
        with sync_playwright() as p:
            # A profile folder inside the clone: a new learner's browser, and a command line that
            # walkthrough.sh's clean-up finds by the work folder's path.
            browser = p.chromium.launch_persistent_context(
                str(fresh / "chromium-profile"), executable_path=CHROMIUM, args=["--no-sandbox"],
                headless=True, viewport=VIEW)
            res["versions"] = versions(subprocess.run([CHROMIUM, "--version"], capture_output=True,
                                                      text=True).stdout.strip())
            page = browser.pages[0] if browser.pages else browser.new_page()
            page.set_default_timeout(30000)
            page.goto(f"{base}/lab?token={TOKEN}")
            page.locator(".jp-DirListing-item").first.wait_for(timeout=120000)
            time.sleep(3)
            dismiss_toasts(page)
            # The start page: notebooks/00-start-here.ipynb, double-clicked in the file browser.
            page.locator(".jp-BreadCrumbs-home").first.click()
            page.locator(".jp-DirListing-item", has_text=re.compile("^notebooks")).first.dblclick()
            page.locator(".jp-DirListing-item", has_text=START_PAGE).first.wait_for()
            time.sleep(2)  # the listing settles (a click during its redraw hits another file)
            page.locator(".jp-DirListing-item", has_text=START_PAGE).first.dblclick()
            page.locator(".jp-RenderedMarkdown a[href*='.ipynb']").first.wait_for(state="attached", timeout=60000)
            time.sleep(2)
            dismiss_toasts(page)
            res["start_page_shot"] = shots.take(page, "00-start-page")
            # The notebooks get the width: the file browser folds away (View > Show Left Sidebar).
            page.keyboard.press("Control+b")
            time.sleep(1)
            res["start_page_shot_wide"] = shots.take(page, "00-start-page-wide")
            for rel, minutes in order:
                timeout = max(a.timeout, 1.5 * 60 * (minutes or 0))
                try:
                    rec = walk_notebook(page, root, rel, minutes, base, shots, timeout)
                except Exception as ex:  # noqa: BLE001 - recorded, and the walk goes on
                    log(f"{rel}: FATAL {type(ex).__name__}: {ex}")
                    rec = {"notebook": Path(rel).stem, "start_page_minutes": minutes,
                           "fatal": f"{type(ex).__name__}: {str(ex)[:500]}"}
                    try:
                        shots.take(page, f"{Path(rel).stem}-failure")
                        page.goto(f"{base}/lab?token={TOKEN}")
                        time.sleep(5)
                    except Exception:  # noqa: BLE001
                        pass
                res["notebooks"].append(rec)
                json.dump(res, open(a.out / "walkthrough.json", "w"), indent=1)
            browser.close()
    finally:
        stop(lab)
    res["total_s"] = time.time() - t_all
    files = list(shots.folder.glob("*.jpg"))
    res["shots_count"] = len(files)
    res["shots_bytes"] = sum(f.stat().st_size for f in files)
    res["found"] = findings(res)
    json.dump(res, open(a.out / "walkthrough.json", "w"), indent=1)
    write_report(a.out, res)
    log(f"report: {a.out / 'report.md'}; found: {len(res['found'])}")
    for f in res["found"]:
        log(f"FOUND: {f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
