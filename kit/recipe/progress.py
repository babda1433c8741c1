"""Rank 0's progress through a run: one line that updates in place where it can, one plain line
per logged step where it cannot.

    progress = Progress(total=20, start=0, shown=env.is_main)
    progress.step(step, row, logged)    # after each step: its metrics row, whether it was logged
    progress.close()

On a terminal (a rank started without torchrun, `python -m kit.train` in a shell) it is tqdm's bar,
redrawn in place. Anywhere else (torchrun's --tee, run.log, a notebook's log) a carriage-return bar
cannot redraw: torchrun prefixes every piece of it and the log holds two lines a step. There it
prints one plain line per logged step (training.log_every), rank 0 only:

    train: step 40/200 (20%): loss 1.2345, 0.85 s/step, 2m16s left

`kit train` draws those lines in place on its own terminal (kit.run.door). Rank side.
"""

from __future__ import annotations

import sys
import time

PREFIX = "train: step "  # what kit.run.door recognises (behind torchrun's [default0]:)


def clock(seconds: float) -> str:
    """42s, 3m05s, 1h02m."""
    s = int(round(seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


def line(step: int, total: int, loss: float, step_s: float) -> str:
    """One plain progress line: the step, the share done, the loss, time per step and left."""
    return (f"{PREFIX}{step}/{total} ({100 * step // max(total, 1)}%): loss {loss:.4f}, "
            f"{step_s:.2f} s/step, {clock(step_s * max(total - step, 0))} left")


class Progress:
    """tqdm's bar on a terminal, else plain lines at logged steps; nothing where not `shown`."""

    def __init__(self, total: int, start: int, shown: bool, stream=None):
        self.total, self.start, self.shown = total, start, shown
        self.stream = stream or sys.stdout
        self.began = time.perf_counter()
        self.bar = None
        if shown and sys.stderr.isatty():  # tqdm draws on stderr
            from tqdm.auto import tqdm

            self.bar = tqdm(total=total, initial=start, desc="train", mininterval=1.0)

    def step(self, step: int, row: dict, logged: bool) -> None:
        if self.bar is not None:
            self.bar.update(1)
            self.bar.set_postfix(loss=f"{row['loss']:.4f}")
        elif self.shown and logged:
            per_step = (time.perf_counter() - self.began) / max(step - self.start, 1)
            print(line(step, self.total, row["loss"], per_step), file=self.stream, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
