"""run.report_to (kit.recipe.trackers): one 2-process tiny run writes TensorBoard event files and
a trackio project beside metrics.jsonl; each is read back by its own library's reader and holds
metrics.jsonl's numbers at its steps, and the config as hyperparameters. trackio is optional (not
in requirements.txt: it pins pillow<13, the lock has pillow 13): where it is not installed the
run says so in one line and completes."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest
import yaml
from conftest import read_run, torchrun

from kit.config import ConfigError, load_config
from kit.folder.layout import RunFolder
from kit.recipe import trackers

HAS_TRACKIO = importlib.util.find_spec("trackio") is not None


@pytest.fixture(scope="module")
def tracked(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("trackers") / "run"
    finished = torchrun(out, "training.steps=4", "training.eval_every=2",
                        "run.report_to=[jsonl,tensorboard,trackio]")
    (out / "output.txt").write_text(finished.stdout)
    return out


def expected(out: Path) -> dict[tuple[int, str], float]:
    """metrics.jsonl as (step, tag) -> value, the tags the trackers are given."""
    _, rows = read_run(out)
    assert {r["split"] for r in rows} == {"train", "val"}
    return {(r["step"], tag): v for r in rows for tag, v in trackers.scalars(r).items()}


def test_tensorboard_holds_what_metrics_jsonl_holds(tracked):
    pytest.importorskip("tensorboard", reason="tensorboard is not installed")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.plugins.hparams import plugin_data_pb2

    events = EventAccumulator(str(tracked / RunFolder.TENSORBOARD), size_guidance={"scalars": 0})
    events.Reload()
    got = {(e.step, tag): e.value for tag in events.Tags()["scalars"] for e in events.Scalars(tag)}
    want = expected(tracked)
    assert {"train/loss", "train/lr", "train/grad_norm", "train/tokens_per_s",
            "train/peak_mem_gib", "val/loss"} <= {tag for _, tag in want}
    assert got.keys() == want.keys()
    for key, value in want.items():  # event files store float32
        assert got[key] == pytest.approx(value, rel=1e-6, abs=1e-12), key

    start = events.PluginTagToContent("hparams")["_hparams_/session_start_info"]
    hparams = plugin_data_pb2.HParamsPluginData.FromString(start).session_start_info.hparams
    config = trackers.hyperparameters(yaml.safe_load((tracked / RunFolder.CONFIG).read_text()))
    assert set(hparams) == set(config)
    assert hparams["training.steps"].number_value == 4
    assert hparams["training.lr"].number_value == pytest.approx(config["training.lr"])
    assert hparams["model.name"].string_value == config["model.name"]


def test_trackio_holds_what_metrics_jsonl_holds_or_is_one_line(tracked):
    result, _ = read_run(tracked)
    assert result["status"] == "completed"
    lines = [line for line in (tracked / "output.txt").read_text().splitlines()
             if "run.report_to: trackio" in line]
    if not HAS_TRACKIO:
        assert len(lines) == 1 and "No module named 'trackio'" in lines[0], lines
        assert "metrics.jsonl goes on" in lines[0]
        pytest.skip("trackio is not installed (optional: pip install trackio); its one line checked")
    assert not lines, lines
    os.environ["TRACKIO_DIR"] = str(tracked / RunFolder.TRACKIO)  # read before trackio's import
    from trackio.sqlite_storage import SQLiteStorage

    name = yaml.safe_load((tracked / RunFolder.CONFIG).read_text())["run"]["name"]
    got = {(log["step"], tag): v for log in SQLiteStorage.get_logs(name, name)
           for tag, v in log.items() if "/" in tag}
    want = expected(tracked)
    assert got.keys() == want.keys()
    for key, value in want.items():
        assert got[key] == pytest.approx(value, rel=1e-9), key
    config = trackers.hyperparameters(yaml.safe_load((tracked / RunFolder.CONFIG).read_text()))
    stored = SQLiteStorage.get_run_config(name, name)
    assert {k: stored[k] for k in config} == config


def test_a_tracker_that_fails_is_one_line_and_metrics_go_on(tmp_path, monkeypatch):
    class Broken:
        def __init__(self, folder, cfg, params, first_step):
            pass

        def log(self, step, values):
            raise OSError("disk full\nsecond line")

        def close(self):
            raise AssertionError("a dropped tracker is not closed")

    monkeypatch.setitem(trackers.TRACKERS, "tensorboard", Broken)
    said: list[str] = []
    folder = RunFolder(tmp_path)
    report = trackers.Report(load_config("tiny-cpu", ["run.report_to=tensorboard"]), folder,
                             said.append)
    for step in (1, 2):
        report.write({"split": "train", "step": step, "loss": 1.0 / step})
    report.close()
    assert said == ["run.report_to: tensorboard failed at step 1 (OSError: disk full); dropped, "
                    "metrics.jsonl goes on"]
    assert [r["step"] for r in folder.read_metrics()] == [1, 2]


def test_report_to_names_only_known_trackers():
    assert load_config("tiny-cpu").run.report_to == ["jsonl"]
    assert load_config("tiny-cpu", ["run.report_to=tensorboard"]).run.report_to == ["tensorboard"]
    with pytest.raises(ConfigError) as e:
        load_config("tiny-cpu", ["run.report_to=[tensorboard,wandb]"])
    assert str(e.value) == ("run.report_to[1]: 'wandb' is not allowed; expected one of 'jsonl', "
                            "'tensorboard', 'trackio'")


def test_a_resumed_run_hides_what_an_earlier_start_wrote_past_its_checkpoint(tmp_path):
    """metrics.jsonl keeps rows up to the checkpoint on a resume; TensorBoard then shows the
    resumed steps only (SummaryWriter's purge_step), not two values at one step."""
    pytest.importorskip("tensorboard", reason="tensorboard is not installed")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    cfg, folder = load_config("tiny-cpu", ["run.report_to=tensorboard"]), RunFolder(tmp_path)
    for steps, loss in ((range(1, 5), 1.0), (range(3, 5), 2.0)):  # a start, then a resume at 2
        report = trackers.Report(cfg, folder, pytest.fail)
        for step in steps:
            report.write({"split": "train", "step": step, "loss": loss})
        report.close()
    events = EventAccumulator(str(tmp_path / RunFolder.TENSORBOARD))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("train/loss")] == [
        (1, 1.0), (2, 1.0), (3, 2.0), (4, 2.0)]
