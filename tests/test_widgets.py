"""The dashboard without a frontend: widgets built and fed the rows rank 0 writes, text mode,
the live/text rule, compare(). No process is launched: a prepared run folder is written to."""

from __future__ import annotations

import json
import subprocess

import pytest

from kit.run.launch import Run, RunFailed, prepare
from kit.run.widgets import Dashboard, compare, is_live

STEPS = 8


def row(step: int, loss: float, split: str = "train") -> dict:
    if split == "val":
        return {"split": "val", "step": step, "loss": loss, "peak_mem_gib": 0.5, "elapsed_s": step}
    return {"split": "train", "step": step, "loss": loss, "grad_norm": 0.5, "lr": 1e-2,
            "tokens_per_s": 1234.0 + step, "step_s": 0.1, "peak_mem_gib": 0.45,
            "elapsed_s": 0.5 * step}


def write(path, rows, partial: str = "") -> None:
    with open(path, "a") as f:
        f.write("".join(json.dumps(r) + "\n" for r in rows) + partial)


@pytest.fixture
def run(tmp_path) -> Run:
    return Run(prepare("tiny-cpu", [f"training.steps={STEPS}", f"run.output_dir={tmp_path / 'r'}"]))


def finish(run: Run, code: int) -> None:
    """Make the folder look like an ended run: a dead pid, an exit code, result.json if 0."""
    dead = subprocess.Popen(["true"])
    dead.wait()
    (run.folder / "pid").write_text(f"{dead.pid}\n")
    (run.folder / "exit_code").write_text(f"{code}\n")
    if code == 0:
        (run.folder / "result.json").write_text(json.dumps({"status": "completed"}))


def test_dashboard_follows_rows_and_logs(run):
    dash = Dashboard(run, live=True, plot_interval_s=0)
    assert (dash.progress.value, dash.progress.max) == (0, STEPS)
    assert dash.plot.layout.display == "none"  # no data yet: no empty image
    metrics, log = run.folder / "metrics.jsonl", run.folder / "run.log"
    write(metrics, [row(1, 6.9), row(2, 6.7), row(2, 6.8, "val")], partial='{"split": "tr')
    log.write_text("[default0]:hello from rank 0\n[default1]:hello from rank 1\n[default1]:\n"
                   "[default0]:train:  10%|# | 1/8[default0]:\r[default0]:train:  25%|## | 2/8\r")
    dash.poll()
    assert dash.status == "prepared"
    assert dash.progress.value == 2  # the half-written third row is not read yet
    assert list(dash.train_line.get_xdata()) == [1, 2]
    assert list(dash.train_line.get_ydata()) == [6.9, 6.7]
    assert list(dash.val_line.get_xdata()) == [2] and list(dash.val_line.get_ydata()) == [6.8]
    assert dash.plot.value[:4] == b"\x89PNG" and dash.plot.layout.display is None
    assert "6.7000" in dash.stats.value and "1,236" in dash.stats.value  # loss, tokens/s
    assert "0.45" in dash.stats.value  # peak memory
    shown = [o["text"] for o in dash.log.outputs]
    assert shown == [  # tqdm's \r redraws become lines; torchrun's stray prefixes are dropped
        "[default0]:hello from rank 0\n", "[default1]:hello from rank 1\n",
        "[default0]:train:  10%|# | 1/8\n", "[default0]:train:  25%|## | 2/8\n"]

    with open(metrics, "a") as f:  # the row completes, then more steps
        f.write('ain", "step": 3, "loss": 6.5}\n')
    write(metrics, [row(s, 6.5 - 0.1 * s) for s in range(4, STEPS + 1)])
    write(log, [], partial="".join(f"[default0]:line {i}\n" for i in range(40)))
    finish(run, 0)
    dash.poll()
    assert dash.status == "completed"
    assert (dash.progress.value, dash.progress.max) == (STEPS, STEPS)
    assert dash.progress.bar_style == "success"
    assert list(dash.train_line.get_xdata()) == list(range(1, STEPS + 1))
    assert len(dash.log.outputs) == dash.log_lines  # only the last lines are kept
    assert dash.log.outputs[-1]["text"] == "[default0]:line 39\n"
    assert dash.stop_button.disabled and dash.stop_button.description == "Completed"
    assert dash.error.layout.display == "none"


def test_dashboard_drops_an_earlier_runs_rows_when_a_new_start_replaces_metrics(run):
    """Watching starts before the relaunched recipe replaces the earlier run's metrics.jsonl:
    the rows read from the old file must not stay in the curves (seen in JupyterLab)."""
    dash = Dashboard(run, live=True, plot_interval_s=0)
    metrics = run.folder / "metrics.jsonl"
    write(metrics, [row(s, 7.0 - 0.1 * s) for s in range(1, STEPS + 1)])  # the earlier run
    dash.poll()
    assert dash.progress.value == STEPS
    # The new run's start (run.start_over=true) moves the earlier file into earlier/ and the
    # recipe writes a new one.
    (run.folder / "earlier").mkdir(exist_ok=True)
    metrics.rename(run.folder / "earlier" / "metrics.jsonl")
    write(metrics, [row(1, 6.9), row(2, 6.8)])
    dash.poll()
    assert list(dash.train_line.get_xdata()) == [1, 2]
    assert list(dash.train_line.get_ydata()) == [6.9, 6.8]
    assert dash.progress.value == 2


def test_dashboard_shows_the_failed_rank(run):
    dash = Dashboard(run, live=True)
    failure = RunFailed(run.name, 1, "InjectedFailure: boom", "Traceback ...\n  maybe_fail\n",
                        "/x/logs/1/stderr.log")
    dash.feed([row(1, 6.9)], ["[default1]:boom"], "failed", failure)
    assert dash.progress.bar_style == "danger"
    assert dash.error.layout.display is None  # made visible
    assert "failed on rank 1: InjectedFailure: boom" in dash.error.value
    assert "maybe_fail" in dash.error.value and "/x/logs/1/stderr.log" in dash.error.value


def test_failed_folder_reads_as_failed(run):
    write(run.folder / "metrics.jsonl", [row(1, 6.9)])
    finish(run, 1)
    dash = Dashboard(run, live=True)
    dash.poll()
    assert dash.status == "failed" and dash.progress.bar_style == "danger"
    assert dash.failure is not None and dash.error.layout.display is None


def test_text_mode_prints_progress_and_builds_no_widgets(run, capsys):
    dash = Dashboard(run, live=False)
    assert not hasattr(dash, "widget")
    dash.feed([row(1, 6.9), row(2, 6.7), row(2, 6.8, "val")])
    dash.feed([row(3, 6.5)])
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 4
    assert lines[0].startswith("step     1/8  loss 6.9000  lr 1.00e-02  tokens/s/device 1,235")
    assert "peak 0.45 GiB" in lines[0]
    assert lines[2] == "step     2/8  val loss 6.8000"
    assert lines[3].startswith("step     3/8  loss 6.5000")


def test_text_mode_wait_on_an_ended_run(run, capsys):
    write(run.folder / "metrics.jsonl", [row(s, 7 - 0.1 * s) for s in range(1, STEPS + 1)])
    finish(run, 0)
    assert Dashboard(run, live=False).wait(timeout=10) == "completed"
    assert "step     8/8  loss 6.2000" in capsys.readouterr().out


def test_stop_button_on_a_run_that_is_not_running(run):
    dash = Dashboard(run, live=True)
    dash.stop_button.click()
    assert dash.stop_button.disabled and dash.stop_button.description == "Stopping"
    assert run.status == "prepared"  # nothing was running: nothing marked stopped


def test_live_rule(monkeypatch):
    monkeypatch.delenv("JPY_SESSION_NAME", raising=False)
    monkeypatch.setenv("KIT_LIVE", "1")
    assert is_live() is True
    monkeypatch.setenv("KIT_LIVE", "0")
    monkeypatch.setenv("JPY_SESSION_NAME", "/nb.ipynb")
    assert is_live() is False
    monkeypatch.delenv("KIT_LIVE")
    assert is_live() is False  # a Jupyter server's variable, but no IPython kernel here
    monkeypatch.delenv("JPY_SESSION_NAME")
    assert is_live() is False


def test_compare_plots_both_runs(tmp_path):
    runs = []
    for name, losses in (("a", [6.9, 6.5, 6.1]), ("b", [6.9, 6.8])):
        run = Run(prepare("tiny-cpu", [f"run.output_dir={tmp_path / name}"]))
        write(run.folder / "metrics.jsonl",
              [row(i + 1, v) for i, v in enumerate(losses)] + [row(len(losses), 6.0, "val")])
        runs.append(run)
    fig = compare(*runs)
    lines = {line.get_label(): line for line in fig.axes[0].lines}
    assert list(lines["a train"].get_ydata()) == [6.9, 6.5, 6.1]
    assert list(lines["b train"].get_xdata()) == [1, 2]
    assert list(lines["b val"].get_xdata()) == [2] and list(lines["a val"].get_ydata()) == [6.0]
    assert lines["a train"].get_color() == lines["a val"].get_color()
