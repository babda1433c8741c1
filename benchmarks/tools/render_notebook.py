"""Run a notebook in a real JupyterLab in headless Chromium and take a screenshot (live widgets).

    python3 benchmarks/tools/render_notebook.py notebooks/07-launch-multi-gpu.ipynb /tmp/nb07.png

A look at the widgets as a person sees them, which papermill and nbval cannot give: it copies the
notebook into launch/render/ (ignored by git, so the committed file never gains outputs), starts
JupyterLab with its app exposed to the page, opens the copy in `chromium --headless`, runs every
cell through JupyterLab's own command (`notebook:run-all-cells`) over the DevTools protocol, waits
until the kernel is idle, and saves a full-height screenshot, then one per scrolled section
(JupyterLab paints only the cells near the view). Needs chromium and websocket-client.
Keep the PNG out of git.
"""

from __future__ import annotations

import base64
import json
import shutil
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import websocket

ROOT = Path(__file__).resolve().parents[2]
LAB_PORT, CDP_PORT, TOKEN = 8899, 9222, "kit-render"
VIEW = 3600  # pixels scrolled per section screenshot (the window is 4,200 tall)


def wait_for(url: str, seconds: float = 60) -> str:
    end = time.time() + seconds
    while time.time() < end:
        try:
            return urllib.request.urlopen(url, timeout=2).read().decode()
        except OSError:
            time.sleep(1)
    raise TimeoutError(url)


class Page:
    def __init__(self, ws_url: str):
        self.ws = websocket.create_connection(ws_url, timeout=120)
        self.n = 0

    def call(self, method: str, **params):
        self.n += 1
        self.ws.send(json.dumps({"id": self.n, "method": method, "params": params}))
        while True:
            msg = json.loads(self.ws.recv())
            if msg.get("id") == self.n:
                return msg.get("result", {})

    def eval(self, expression: str, wait: bool = True):
        r = self.call("Runtime.evaluate", expression=expression, returnByValue=True,
                      awaitPromise=wait)
        return r.get("result", {}).get("value")


def main(notebook: str, png: str, budget_s: int = 600) -> int:
    work = ROOT / "launch" / "render"
    work.mkdir(parents=True, exist_ok=True)
    copy = work / Path(notebook).name
    shutil.copy(ROOT / notebook, copy)
    lab = subprocess.Popen(
        ["jupyter", "lab", "--no-browser", f"--port={LAB_PORT}", f"--ServerApp.token={TOKEN}",
         f"--ServerApp.root_dir={ROOT}", "--LabApp.expose_app_in_browser=True", "--allow-root"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    url = f"http://127.0.0.1:{LAB_PORT}/lab/tree/{copy.relative_to(ROOT)}?token={TOKEN}"
    browser = None
    try:
        wait_for(f"http://127.0.0.1:{LAB_PORT}/api/status?token={TOKEN}")
        browser = subprocess.Popen(
            ["chromium", "--headless=new", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
             f"--remote-debugging-port={CDP_PORT}", "--remote-allow-origins=*",
             "--window-size=1400,4200", url],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wait_for(f"http://127.0.0.1:{CDP_PORT}/json/version")
        target = next(t for t in json.loads(wait_for(f"http://127.0.0.1:{CDP_PORT}/json"))
                      if t["type"] == "page")
        page = Page(target["webSocketDebuggerUrl"])
        ready = ("(() => { const a = window.jupyterapp; const w = a && a.shell.currentWidget;"
                 " return !!(w && w.sessionContext && w.sessionContext.session &&"
                 " w.sessionContext.session.kernel &&"
                 " w.sessionContext.session.kernel.status === 'idle'); })()")
        end = time.time() + 120
        while not page.eval(ready):
            if time.time() > end:
                raise TimeoutError("JupyterLab did not open the notebook with an idle kernel")
            time.sleep(2)
        # Not awaited: its promise ends with the last cell, past the socket's timeout for a
        # notebook that trains for minutes; the loop below waits for the kernel instead.
        page.eval("window.jupyterapp.commands.execute('notebook:run-all-cells'); true", wait=False)
        time.sleep(5)
        busy = ("(() => { const w = window.jupyterapp.shell.currentWidget;"
                " const cells = w.content.widgets;"
                " return w.sessionContext.session.kernel.status !== 'idle' ||"
                " cells.some(c => c.model.type === 'code' && c.promptNode &&"
                " c.promptNode.textContent.includes('*')); })()")
        end = time.time() + budget_s
        while page.eval(busy):
            if time.time() > end:
                raise TimeoutError("the notebook did not finish in time")
            time.sleep(3)
        # Back to the top: JupyterLab renders only the cells near what is scrolled into view.
        page.eval("window.jupyterapp.shell.currentWidget.content.activeCellIndex = 0;"
                  "document.querySelectorAll('.jp-WindowedPanel-outer')"
                  ".forEach(e => { e.scrollTop = 0; }); true")
        time.sleep(5)  # let the cells and the last widget updates paint
        shot = page.call("Page.captureScreenshot", format="png", captureBeyondViewport=True)
        Path(png).write_bytes(base64.b64decode(shot["data"]))
        # Then the rest, one viewport at a time (OUT-1.png, OUT-2.png, ...): with JupyterLab's
        # windowing, scrolling is what makes the lower cells (a dashboard, tables, plots) paint.
        height = page.eval("document.querySelector('.jp-WindowedPanel-outer').scrollHeight") or 0
        for i, top in enumerate(range(VIEW, height - VIEW // 4, VIEW), start=1):
            page.eval(f"document.querySelectorAll('.jp-WindowedPanel-outer')"
                      f".forEach(e => {{ e.scrollTop = {top}; }}); true")
            time.sleep(3)
            part = page.call("Page.captureScreenshot", format="png")
            Path(png).with_name(f"{Path(png).stem}-{i}.png").write_bytes(base64.b64decode(part["data"]))
        errors = page.eval("Array.from(document.querySelectorAll('.jp-RenderedText[data-mime-type="
                           "\"application/vnd.jupyter.stderr\"]')).length")
        widgets = page.eval("document.querySelectorAll('.jupyter-widgets').length")
        print(f"{png}: {widgets} widget elements rendered, {errors} stderr outputs")
        return 0
    finally:
        if browser:
            browser.kill()
        subprocess.run(["kill", "--", f"-{lab.pid}"], check=False)


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:3]))
