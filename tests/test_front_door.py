"""The front door: `kit train` (kit.run.door), one command for every stage (kit/__main__.py), and
mistakes said once: one line and exit code 2 from the door before any process starts, with the
run folder's files byte-identical; under bare torchrun, one line from one rank while the others
end quietly (kit.recipe.dist.on_main, PeerFailed)."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import ROOT, TINY

KIT = Path(sys.executable).with_name("kit")  # the console script setup.sh installs
STEPS = ["training.steps=3", "training.eval_every=0"]


def kit(*args, timeout: int = 600) -> subprocess.CompletedProcess:
    return subprocess.run([str(KIT), *map(str, args)], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout)


def bare_torchrun(*args, timeout: int = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                           "--nproc_per_node=2", "-m", "kit.train", str(TINY), *map(str, args)],
                          cwd=ROOT, capture_output=True, text=True, timeout=timeout)


def snapshot(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def train_losses(folder: Path) -> list[float]:
    rows = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in rows if r.get("split") == "train"]


def test_kit_is_one_command_that_explains_each_of_its_commands():
    assert KIT.is_file(), f"{KIT}: the console script is missing; pip install -e . (setup.sh) adds it"
    proc = kit("-h", timeout=60)
    assert proc.returncode == 0, proc.stderr
    for command in ("train", "check", "doctor", "bench", "merge", "checkpoints", "chat", "jobs",
                    "runs", "models", "tour"):
        assert f"    {command}" in proc.stdout, (command, proc.stdout)
    for command in ("train", "check", "doctor", "bench", "chat"):
        proc = kit(command, "-h", timeout=60)
        assert proc.returncode == 0 and f"usage: kit {command}" in proc.stdout, proc.stdout
    train = " ".join(kit("train", "-h", timeout=60).stdout.split())
    for said in ("Ctrl-C, SIGTERM or SIGHUP (a closed terminal) asks the ranks to stop",
                 "a second one, 2 s or more later, ends them at once", "--detach"):
        assert said in train, train


@pytest.fixture(scope="module")
def softcapped(tmp_path_factory) -> Path:
    """A model folder whose config.json sets final_logit_softcapping (a Gemma-2 config, no
    weights: the check reads config.json alone)."""
    from transformers import Gemma2Config

    folder = tmp_path_factory.mktemp("gemma2")
    config = Gemma2Config(vocab_size=256, hidden_size=64, intermediate_size=128,
                          num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                          head_dim=32)
    (folder / "config.json").write_text(config.to_json_string())
    return folder


MISTAKES = {
    "seed": (["training.seed=18446744073709551617"],
             "ConfigError: training.seed: 18446744073709551617 is not allowed; expected an "
             "integer from 0 to 2**63 - 1"),
    "name": (["run.name=../../x"], "ConfigError: run.name: '../../x' is not allowed"),
    "fused-loss": (["model.name={softcapped}", "training.loss=fused"],
                   "ConfigError: training.loss: 'fused' is not allowed for this model; its logits "
                   "pass through final_logit_softcapping after the head; allowed: hf, chunked"),
}


@pytest.mark.parametrize("case", MISTAKES)
def test_each_mistake_is_one_line_and_exit_2_from_the_front_door(case, softcapped, tmp_path):
    overrides, expected = MISTAKES[case]
    folder = tmp_path / "run"  # a run folder that already holds a run's files
    folder.mkdir()
    for name, text in {"config.yaml": "run:\n  name: run\n", "metrics.jsonl": '{"step": 1}\n',
                       "result.json": '{"status": "completed"}\n'}.items():
        (folder / name).write_text(text)
    before = snapshot(folder)
    outside = (ROOT / "launch" / "../../x").resolve()
    existed = outside.exists()
    proc = kit("train", TINY, "--nproc", "2",  # options may stand between the words
               *[o.format(softcapped=softcapped) for o in overrides], f"run.output_dir={folder}",
               timeout=120)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stdout == "" and len(proc.stderr.splitlines()) == 1, proc.stdout + proc.stderr
    assert proc.stderr.startswith(expected), proc.stderr
    assert snapshot(folder) == before
    assert outside.exists() == existed


@pytest.mark.slow
def test_the_front_door_and_bare_torchrun_train_alike(tmp_path):
    door, bare = tmp_path / "door", tmp_path / "bare"
    proc = kit("train", TINY, *STEPS, f"run.output_dir={door}")
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr
    assert proc.stdout.startswith("data: ") and "run: " in proc.stdout.splitlines()[0]
    assert proc.stdout.rstrip().endswith(f"kit: run 'door' completed: {door}")
    assert proc.stderr == "", proc.stderr  # the run's output is followed on stdout, as run.log
    # Checked once, here: run.sh's check step (whose line is unprefixed) did not run again.
    assert sum(line.startswith("data: ") for line in proc.stdout.splitlines()) == 1, proc.stdout
    assert "[default1]:rank 1 of 2" in proc.stdout
    # Rank 0's progress: one plain line a logged step, no carriage-return bar split by
    # torchrun's --tee.
    steps = [line for line in proc.stdout.splitlines() if "train: step " in line]
    assert [line.split(" (")[0] for line in steps] == [
        f"[default0]:train: step {k}/3" for k in (1, 2, 3)], proc.stdout
    assert "\r" not in proc.stdout and "it/s" not in proc.stdout
    proc = bare_torchrun(*STEPS, f"run.output_dir={bare}")
    assert proc.returncode == 0, proc.stderr[-6000:]
    assert len(train_losses(door)) == 3
    assert train_losses(door) == pytest.approx(train_losses(bare), rel=1e-6, abs=0)


@pytest.mark.slow
@pytest.mark.parametrize("mistake, line", [
    ("data.path=/nonexistent/rows.jsonl",
     "[rank 0] ConfigError: data.path: '/nonexistent/rows.jsonl' does not exist"),
    ("training.seed=18446744073709551617",
     "[rank 0] ConfigError: training.seed: 18446744073709551617 is not allowed; expected an "
     "integer from 0 to 2**63 - 1"),
], ids=["found-after-the-group-exists", "found-before"])
def test_a_mistake_under_bare_torchrun_is_said_once_and_the_other_rank_ends_quietly(
        mistake, line, tmp_path):
    proc = bare_torchrun(mistake, f"run.output_dir={tmp_path / 'run'}", timeout=300)
    text = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert [x for x in text.splitlines() if "ConfigError" in x] == [line], text
    assert "[rank 1]" not in text and "[default1]" not in text, text
    assert "Connection closed by peer" not in text and "Traceback (most recent call last):\n  File " \
        "\"" + str(ROOT) not in text, text


def test_progress_is_a_bar_on_a_terminal_and_a_line_per_logged_step_elsewhere(monkeypatch, capsys):
    """kit.recipe.progress: where stderr is a terminal, tqdm's bar redrawn with \\r; elsewhere
    (torchrun's --tee, a pipe, a file) one plain line on stdout per logged step; nothing on the
    other ranks."""
    import io

    from kit.recipe import progress

    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    for shown in (True, False):
        plain = progress.Progress(total=4, start=0, shown=shown)
        for step in (1, 2, 3, 4):
            plain.step(step, {"loss": 7.0 - step / 10}, logged=step % 2 == 0)
        plain.close()
        out = capsys.readouterr()
        lines = [line.split(", ")[0] for line in out.out.splitlines()]
        assert lines == (["train: step 2/4 (50%): loss 6.8000", "train: step 4/4 (100%): loss "
                          "6.6000"] if shown else []) and out.err == ""
    monkeypatch.setattr(sys, "stderr", Terminal())
    bar = progress.Progress(total=4, start=1, shown=True)
    for step in (2, 3, 4):
        bar.step(step, {"loss": 6.5}, logged=True)
    bar.close()
    assert capsys.readouterr().out == "" and "\r" in sys.stderr.getvalue()
    assert "4/4" in sys.stderr.getvalue() and "loss=6.5000" in sys.stderr.getvalue()
    assert progress.clock(42) == "42s" and progress.clock(185) == "3m05s"
    assert progress.clock(3720) == "1h02m"
