"""What a reader sees at laptop width: JupyterLab in headless Chromium at 1366 px, a few notebooks
opened as committed (their checked cells' stored outputs, nothing run), screenshots, and a count
of the output lines too long for the width, which JupyterLab wraps (a text table then breaks
mid-row; an HTML table does not).

    python benchmarks/tools/render_check.py --out RECORD 00-start-here 00b-primer-ranks-and-collectives

Needs chromium at /usr/bin/chromium and playwright importable (no `playwright install`). The
notebooks are copied to a temp folder first: JupyterLab never touches the checkout. For each
notebook it writes RECORD/<stem>-top.png and, where it has one, RECORD/<stem>-table.png (the
first table output scrolled into view), and prints one JSON line: the longest text-output line
in characters, how many characters fit, and the text lines that would wrap.
"""

from __future__ import annotations

import argparse
import json
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from playwright.sync_api import sync_playwright

ROOT = Path(__file__).resolve().parents[2]
VIEW = {"width": 1366, "height": 768}
TOKEN = "render"

# The width a text output has, in characters, measured in the page: the output area's width over
# the width of one character of its monospace font.
JS_FIT = """() => {
  const panel = '.jp-NotebookPanel:not(.lm-mod-hidden) ';
  const area = document.querySelector(panel + '.jp-OutputArea-output') ||
               document.querySelector(panel + '.jp-MarkdownOutput');
  const probe = document.createElement('pre');
  probe.style.cssText = 'position:absolute;visibility:hidden;margin:0;padding:0';
  probe.className = 'jp-RenderedText';
  probe.textContent = 'x'.repeat(100);
  (area || document.body).appendChild(probe);
  const char = probe.getBoundingClientRect().width / 100;
  probe.remove();
  return {char: char, width: area ? area.getBoundingClientRect().width : null};
}"""


# HTML tables wider than the area that holds them (JupyterLab scrolls those sideways; a row never
# wraps): how many, of the tables laid out.
JS_WIDE = """(panel) => Array.from(document.querySelectorAll(panel + 'table'))
  .filter(t => t.parentElement && t.parentElement.clientWidth > 0
               && t.scrollWidth > t.parentElement.clientWidth + 1).length"""


def text_lines(path: Path) -> list[str]:
    """The lines of the stored outputs JupyterLab shows as text (no HTML beside them)."""
    lines = []
    for cell in json.loads(path.read_text())["cells"]:
        for o in cell.get("outputs", []):
            data = o.get("data", {})
            if "text/html" in data:
                continue
            text = o.get("text") or data.get("text/plain") or ""
            lines += ("".join(text) if isinstance(text, list) else text).splitlines()
    return lines


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("stems", nargs="+")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="render-"))
    shutil.copytree(ROOT / "notebooks", work / "notebooks")
    port = free_port()
    lab = subprocess.Popen([sys.executable, "-m", "jupyter", "lab", "--no-browser", f"--port={port}",
                            f"--ServerApp.token={TOKEN}", f"--ServerApp.root_dir={work}",
                            "--LabApp.news_url=", "--ServerApp.ip=127.0.0.1", "--allow-root"],
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    try:
        for _ in range(120):
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/api/status?token={TOKEN}", timeout=2)
                break
            except OSError:
                time.sleep(1)
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path="/usr/bin/chromium",
                                        args=["--no-sandbox", "--disable-dev-shm-usage"])
            page = browser.new_page(viewport=VIEW)
            for stem in args.stems:
                page.goto(f"http://127.0.0.1:{port}/lab/tree/notebooks/{stem}.ipynb?token={TOKEN}&reset")
                page.wait_for_selector(".jp-NotebookPanel:not(.lm-mod-hidden) .jp-Cell", timeout=120_000)
                time.sleep(4)  # the rendered markdown and outputs settle
                no = page.locator(".jp-toast-button, .Toastify__toast button", has_text="No")
                if no.count():  # "get notified about Jupyter news?" over the notebook
                    no.first.click()
                    time.sleep(1)
                page.screenshot(path=str(args.out / f"{stem}-top.png"))
                fit = page.evaluate(JS_FIT)
                panel = ".jp-NotebookPanel:not(.lm-mod-hidden) "
                table = page.locator(panel + ".jp-OutputArea-output table")
                if not table.count():  # a markdown-only page: its own tables
                    table = page.locator(panel + ".jp-MarkdownOutput table")
                wide = page.evaluate(JS_WIDE, panel)
                shot = None
                if table.count():
                    table.first.evaluate("e => e.scrollIntoView({block: 'center'})")
                    time.sleep(2)
                    shot = f"{stem}-table.png"
                    page.screenshot(path=str(args.out / shot))
                lines = text_lines(work / "notebooks" / f"{stem}.ipynb")
                chars = int(fit["width"] // fit["char"]) if fit["width"] else None
                wrap = [ln for ln in lines if chars and len(ln) > chars]
                print(json.dumps({"notebook": stem, "html_tables": table.count(), "tables_wider": wide,
                                  "text_lines": len(lines), "longest": max(map(len, lines), default=0),
                                  "fit_chars": chars, "wrapping_lines": len(wrap),
                                  "first_wrapping": wrap[:2], "table_shot": shot}), flush=True)
            browser.close()
    finally:
        lab.terminate()
        lab.wait(timeout=30)
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
