"""Where rank 0's metrics rows go: metrics.jsonl always, and the trackers run.report_to names
(TensorBoard event files, a local trackio project), each under the run folder.

    report = Report(cfg, RunFolder("launch/try1"), print)  # opens nothing yet
    report.write({"split": "train", "step": 1, "loss": 2.3, "lr": 1e-2})  # jsonl + every tracker
    report.close()

Every number of a row but its step becomes the scalar `<split>/<key>` at that step (train/loss,
train/lr, train/grad_norm, train/tokens_per_s, train/peak_mem_gib, val/loss, ...), so the
trackers hold what metrics.jsonl holds; the config, flattened (training.lr, ...), is their
hyperparameters. A tracker that is not installed or fails is one line and is dropped: the run
and metrics.jsonl go on. kit.train and kit.sft.trainer write through here. Rank side.
"""

from __future__ import annotations

import contextlib
import io
import os

from kit.folder.layout import RunFolder

TENSORBOARD, TRACKIO = RunFolder.TENSORBOARD, RunFolder.TRACKIO  # names and sub-folders


def scalars(row: dict) -> dict[str, float]:
    """The numbers of a metrics.jsonl row as tracker tags: {"train/loss": 2.3, ...}."""
    split = row.get("split", "train")
    return {f"{split}/{k}": float(v) for k, v in row.items()
            if k not in ("step", "split") and isinstance(v, (int, float)) and not isinstance(v, bool)}


def hyperparameters(tree: dict, prefix: str = "") -> dict:
    """The config as flat key: value pairs (lists and None as text), what trackers accept."""
    flat = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            flat.update(hyperparameters(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value if isinstance(value, (int, float, str, bool)) else str(value)
    return flat


class TensorBoard:
    """torch.utils.tensorboard's SummaryWriter; the config through the hparams plugin."""

    def __init__(self, folder, cfg, params: dict, first_step: int = 0):
        from torch.utils.tensorboard import SummaryWriter
        from torch.utils.tensorboard.summary import hparams

        # A resumed run hides what an earlier start wrote from its first step on, as metrics.jsonl
        # keeps rows only up to the checkpoint (kit.folder.runfolder).
        self.writer = SummaryWriter(log_dir=str(folder.path / TENSORBOARD),
                                    purge_step=first_step or None)
        # add_hparams would open a second run beside this one; its three summaries go here instead
        for summary in hparams(params, {}):
            self.writer.file_writer.add_summary(summary)

    def log(self, step: int, values: dict) -> None:
        for tag, value in values.items():
            self.writer.add_scalar(tag, value, step)
        self.writer.flush()  # readable while the run goes on

    def close(self) -> None:
        self.writer.close()


class Trackio:
    """trackio's init / log / finish, its database under the run folder (TRACKIO_DIR, set before
    trackio is imported), local only: no Space, server or dataset to sync to, no dashboard
    (`trackio show` starts one, by hand), no system metrics of its own (the rows are the kit's).
    Its own lines ("View dashboard by running ...", "Uploading logs ...") are kept out of run.log."""

    def __init__(self, folder, cfg, params: dict, first_step: int = 0):
        os.environ["TRACKIO_DIR"] = str((folder.path / TRACKIO).resolve())
        for remote in ("TRACKIO_SPACE_ID", "TRACKIO_SERVER_URL", "TRACKIO_DATASET_ID"):
            os.environ.pop(remote, None)
        import trackio

        self.trackio = trackio
        with contextlib.redirect_stdout(io.StringIO()):
            trackio.init(project=cfg.run.name, name=cfg.run.name, config=params, resume="allow",
                         embed=False, auto_log_gpu=False, auto_log_cpu=False)

    def log(self, step: int, values: dict) -> None:
        self.trackio.log(values, step=step)

    def close(self) -> None:
        with contextlib.redirect_stdout(io.StringIO()):
            self.trackio.finish()


TRACKERS = {TENSORBOARD: TensorBoard, TRACKIO: Trackio}


class Report:
    """metrics.jsonl and the trackers of cfg.run.report_to, opened at the first row (rank 0 alone
    writes rows). `say` prints a line on rank 0."""

    def __init__(self, cfg, folder, say=print):
        self.cfg, self.folder, self.say = cfg, folder, say
        self.trackers: dict | None = None

    def _open(self, first_step: int) -> dict:
        opened, params = {}, hyperparameters(self.cfg.to_dict())
        for name in dict.fromkeys(self.cfg.run.report_to):
            if name in TRACKERS:
                opened[name] = self._try(name, "could not start", TRACKERS[name], self.folder,
                                         self.cfg, params, first_step)
        return {name: t for name, t in opened.items() if t is not None}

    def _try(self, name: str, what: str, fn, *args):
        try:
            return fn(*args)
        except Exception as e:  # any tracker error: one line, the run goes on without it
            first = (str(e).strip().splitlines() or [""])[0]
            self.say(f"run.report_to: {name} {what} ({type(e).__name__}: {first}); "
                     "dropped, metrics.jsonl goes on")
            if self.trackers:
                self.trackers.pop(name, None)
            return None

    def write(self, row: dict) -> None:
        self.folder.append_metrics(row)
        if self.trackers is None:
            self.trackers = self._open(row.get("step", 0))
        values = scalars(row)
        for name, tracker in list(self.trackers.items()):
            self._try(name, f"failed at step {row.get('step')}", tracker.log, row.get("step", 0), values)

    def close(self) -> None:
        for name, tracker in list((self.trackers or {}).items()):
            self._try(name, "failed to close", tracker.close)
        self.trackers = {}
