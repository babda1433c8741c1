"""Watch a launched run from the notebook: progress, loss curves, throughput, logs, a stop button.

    dash = watch(run)      # shows the dashboard and returns at once; a reader thread updates it
    dash.wait()            # blocks until the run ends; a crashed rank raises RunFailed
    compare(run_a, run_b)  # both runs' train and val losses on one figure

Live widgets or plain text? ``live=None`` decides once, by a fixed rule:
  1. ``KIT_LIVE=1`` / ``KIT_LIVE=0`` in the environment wins;
  2. otherwise live only inside an IPython kernel that a Jupyter server (JupyterLab, Notebook)
     started for a notebook: it sets ``JPY_SESSION_NAME`` in the kernel's environment, and
     papermill, nbval, nbclient, ``jupyter execute`` and plain Python do not.
Other frontends (VS Code, ...): pass ``live=True``. Without a live frontend nothing is displayed;
``wait()`` prints one line per logged step from the calling thread, so an executed notebook keeps
readable text instead of widget ids.

Kernel side: reads the run folder's files (kit.run.launch), never torch. Thread rule (ipywidgets):
the dashboard is displayed first, then only the reader thread sets widget values and appends
log lines with ``Output.append_stdout``, never ``with output:`` from a thread. The loss plot is
drawn with matplotlib's Agg canvas (no pyplot, so no GUI state) into an Image widget's PNG.
"""

from __future__ import annotations

import html
import io
import os
import re
import sys
import threading
import time

from kit.run.runs import DONE, Follow, Run

TEE_PREFIX_AT_END = re.compile(r"(\[default\d+\]:)+\s*$")
TEE_PREFIX_ONLY = re.compile(r"\[default\d+\]:\s*")
BAR_STYLE = {"completed": "success", "failed": "danger", "stopped": "warning"}


def is_live() -> bool:
    """The rule in the module docstring: KIT_LIVE, else a Jupyter-server-started kernel."""
    forced = os.environ.get("KIT_LIVE", "")
    if forced in ("0", "1"):
        return forced == "1"
    if "JPY_SESSION_NAME" not in os.environ or "IPython" not in sys.modules:
        return False
    shell = sys.modules["IPython"].get_ipython()
    return getattr(shell, "kernel", None) is not None


def _fmt(value, spec: str) -> str:
    """A metric as text; lists (one value per rank, if the recipe logs them) joined by ' / '."""
    if value is None:
        return "-"
    if isinstance(value, (list, tuple)):
        return " / ".join(format(v, spec) for v in value)
    return format(value, spec)


class Dashboard:
    """Widgets (or text lines) fed with a run's metric rows, log lines and status."""

    def __init__(self, run: Run, live: bool | None = None, interval_s: float = 1.0,
                 plot_interval_s: float = 2.0, log_lines: int = 15):
        self.run = run
        self.live = is_live() if live is None else live
        self.interval_s, self.plot_interval_s, self.log_lines = (
            interval_s, plot_interval_s, log_lines)
        try:
            self.steps = run.config.training.steps
        except Exception:  # no config.yaml yet: the bar learns its length from the rows
            self.steps = 0
        self.rows: list[dict] = []
        self.status = "prepared"
        self.failure = None
        self._metrics = Follow(run.files.metrics)
        self._log = Follow(run.files.log)
        self._printed = 0
        self._plotted_at = 0.0
        self._thread: threading.Thread | None = None
        if self.live:
            self._build()

    def __repr__(self) -> str:
        return f"Dashboard({self.run.name!r}, {self.status}, step {self.step}/{self.steps})"

    # ------------------------------------------------------------------ state
    @property
    def train(self) -> list[dict]:
        return [r for r in self.rows if r.get("split") == "train"]

    @property
    def val(self) -> list[dict]:
        return [r for r in self.rows if r.get("split") == "val"]

    @property
    def step(self) -> int:
        return max((r["step"] for r in self.train), default=0)

    def feed(self, rows=(), lines=(), status: str | None = None, failure=None) -> None:
        """Take new metric rows / log lines / a status, then redraw (live) or print (text)."""
        self.rows += list(rows)
        self.status = status or self.status
        self.failure = failure or self.failure
        self.steps = max(self.steps, self.step)
        if self.live:
            self._render(list(lines))
        else:
            self._print()

    def poll(self, run: Run | None = None) -> str:
        """Read what the run wrote since the last poll and feed it; returns the status."""
        status = self.run.status
        failure = self.run.failure() if status == "failed" else None
        restarts = self._metrics.restarts
        rows = self._metrics.new_rows()
        if self._metrics.restarts != restarts:
            # The recipe rewrote metrics.jsonl (a fresh start replacing an earlier run, or a
            # resume keeping the rows up to its step): what was read before is not this run's.
            self.rows, self._printed = [], 0
        self.feed(rows, self._log.new_lines(), status, failure)
        return status

    # ------------------------------------------------------------------ text
    def _print(self) -> None:
        every = max(1, self.steps // 20)  # ~20 lines per run, whatever its length
        for r in self.rows[self._printed:]:
            if r.get("split") == "val":
                print(f"step {r['step']:>5}/{self.steps}  val loss {r['loss']:.4f}")
            elif r["step"] % every == 0 or r["step"] in (1, self.steps):
                print(f"step {r['step']:>5}/{self.steps}  loss {r['loss']:.4f}  "
                      f"lr {_fmt(r.get('lr'), '.2e')}  "
                      f"tokens/s/device {_fmt(r.get('tokens_per_s'), ',.0f')}  "
                      f"peak {_fmt(r.get('peak_mem_gib'), '.2f')} GiB  "
                      f"{_fmt(r.get('elapsed_s'), '.1f')}s")
        self._printed = len(self.rows)

    # ------------------------------------------------------------------ widgets
    def _build(self) -> None:
        import ipywidgets as W
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
        from matplotlib.ticker import MaxNLocator

        self.title = W.HTML()
        self.progress = W.IntProgress(value=0, min=0, max=max(self.steps, 1),
                                      description="steps", layout=W.Layout(width="60%"))
        self.stats = W.HTML()
        self.figure = Figure(figsize=(6, 2.6), dpi=100)
        self.canvas = FigureCanvasAgg(self.figure)
        self.ax = self.figure.add_subplot()
        self.ax.set(xlabel="step", ylabel="loss")
        self.ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        self.ax.grid(alpha=0.3)
        (self.train_line,) = self.ax.plot([], [], label="train")
        (self.val_line,) = self.ax.plot([], [], "o--", label="val")
        self.ax.legend(loc="upper right")
        self.figure.tight_layout()
        # Hidden until the first row: an empty Image shows as a broken-image icon.
        self.plot = W.Image(format="png", layout=W.Layout(align_self="flex-start", display="none"))
        self.log = W.Output(layout=W.Layout(max_height="16em", overflow="auto",
                                            border="1px solid #ddd"))
        self.error = W.HTML(layout=W.Layout(display="none"))
        self.stop_button = W.Button(description="Stop", button_style="danger", icon="stop",
                                    tooltip="SIGTERM to every process of the run, then SIGKILL")
        self.stop_button.on_click(self._on_stop)
        self.widget = W.VBox([
            W.HBox([self.progress, self.stop_button]), self.title, self.plot, self.stats,
            self.error, self.log,
        ])
        self._render([])

    def _on_stop(self, _button) -> None:
        self.stop_button.disabled = True
        self.stop_button.description = "Stopping"
        threading.Thread(target=self.run.stop, daemon=True).start()  # keep the kernel free

    def _render(self, lines: list[str]) -> None:
        train, val, done = self.train, self.val, self.status in DONE
        self.progress.max = max(self.steps, 1)
        self.progress.value = min(self.step, self.progress.max)
        self.progress.bar_style = BAR_STYLE.get(self.status, "")
        self.title.value = (f"<b>{html.escape(self.run.name)}</b>: {self.status}, step "
                            f"{self.step}/{self.steps} <small>({html.escape(str(self.run.folder))})"
                            "</small>")
        last = train[-1] if train else {}
        cells = [
            ("loss", _fmt(last.get("loss"), ".4f")),
            ("val loss", _fmt(val[-1]["loss"] if val else None, ".4f")),
            ("lr", _fmt(last.get("lr"), ".2e")),
            ("grad norm", _fmt(last.get("grad_norm"), ".3f")),
            ("tokens/s per device<br>(mean of ranks)", _fmt(last.get("tokens_per_s"), ",.0f")),
            ("peak memory GiB<br>(rank 0)", _fmt(last.get("peak_mem_gib"), ".2f")),
            ("elapsed s", _fmt(last.get("elapsed_s"), ".1f")),
        ]
        td = "<td style='padding:0 1em 0 0;text-align:right'>"
        self.stats.value = (
            "<table><tr>" + "".join(f"{td}{k}</td>" for k, _ in cells) + "</tr><tr>"
            + "".join(f"{td}<b>{v}</b></td>" for _, v in cells) + "</tr></table>"
        )
        self.train_line.set_data([r["step"] for r in train], [r["loss"] for r in train])
        self.val_line.set_data([r["step"] for r in val], [r["loss"] for r in val])
        now = time.monotonic()
        if train and (done or now - self._plotted_at >= self.plot_interval_s):
            self._plotted_at = now
            self.ax.relim()
            self.ax.autoscale_view()
            buf = io.BytesIO()
            self.canvas.print_png(buf)
            self.plot.value = buf.getvalue()
            self.plot.layout.display = None
        for line in lines:
            # torchrun's --tee prefixes per \n, tqdm redraws per \r: drop the stray prefixes.
            line = TEE_PREFIX_AT_END.sub("", line)
            if line.strip() and not TEE_PREFIX_ONLY.fullmatch(line):
                self.log.append_stdout(line + "\n")
        if len(self.log.outputs) > self.log_lines:
            self.log.outputs = self.log.outputs[-self.log_lines:]
        if done:
            self.stop_button.disabled, self.stop_button.button_style = True, ""
            self.stop_button.description = self.status.capitalize()
        if self.failure is not None:
            self.error.layout.display = None
            self.error.value = (f"<b style='color:#b00'>failed on rank {self.failure.rank}: "
                                f"{html.escape(self.failure.message)}</b><pre>"
                                f"{html.escape(self.failure.traceback or '')}</pre>"
                                f"log: {html.escape(self.failure.log)}")

    # ------------------------------------------------------------------ running
    def start(self) -> Dashboard:
        """Live: display the widget, then follow the run from a daemon thread; returns at once.
        Text: print one header line (wait() prints the progress)."""
        if not self.live:
            print(f"run {self.run.name}: {self.run.status} ({self.run.folder}); "
                  "progress is printed by wait()")
            return self
        from IPython.display import display

        display(self.widget)
        self._thread = threading.Thread(target=self._follow, daemon=True)
        self._thread.start()
        return self

    def _follow(self) -> None:
        while self.poll() not in DONE:
            time.sleep(self.interval_s)

    def wait(self, timeout: float | None = None, step: int | None = None) -> str:
        """Block until the run ends (or logs train step `step`); text mode prints progress
        meanwhile. A crash raises RunFailed. The kernel is busy meanwhile, so the Stop button
        answers only after wait() returns: interrupt the kernel (the run goes on), then stop."""
        if self.live:
            status = self.run.wait(timeout, step=step)
            if self._thread is not None and status in DONE:
                self._thread.join(timeout=10)
            return status
        try:
            # Waiting for a step: looked for often (a stop sent then lands near it, not steps on).
            return self.run.wait(timeout, step=step, on_update=lambda run: self.poll(),
                                 poll_s=self.interval_s if step is None else
                                 min(self.interval_s, 0.2))
        except Exception:
            print(f"run {self.run.name}: {self.run.status}")
            raise

    def stop(self) -> str:
        return self.run.stop()


def watch(run: Run | str, live: bool | None = None, **kwargs) -> Dashboard:
    """A Dashboard for run (a Run or a run name), started: see Dashboard.start."""
    run = Run.attach(run) if isinstance(run, str) else run
    return Dashboard(run, live, **kwargs).start()


def compare(*runs: Run | str, title: str = "loss"):
    """Train (solid) and val (dashed) loss of several runs on one matplotlib figure."""
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    fig, ax = plt.subplots(figsize=(7, 3.5))
    for run in runs:
        run = Run.attach(run) if isinstance(run, str) else run
        rows = run.metrics()
        train = [r for r in rows if r.get("split") == "train"]
        val = [r for r in rows if r.get("split") == "val"]
        (line,) = ax.plot([r["step"] for r in train], [r["loss"] for r in train],
                          label=f"{run.name} train")
        ax.plot([r["step"] for r in val], [r["loss"] for r in val], "o--",
                color=line.get_color(), label=f"{run.name} val")
    ax.set(xlabel="step", ylabel="loss", title=title)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    plt.close(fig)  # the returned figure is displayed once, as the cell's value
    return fig
