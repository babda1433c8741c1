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
    # Rank 0's progress: one plain line a logged step (not a terminal here: kit.run.door draws
    # them in place on one), no carriage-return bar split by torchrun's --tee.
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


# What torchrun prints as it ends (torch 2.13, copied from run.log files; paths cut short).
STOPPING = [
    "W1129 02:31:47.095000 3418 torch/distributed/elastic/multiprocessing/api.py:1028] Sending "
    "process 3422 closing signal SIGTERM",
    # a venv inside the working directory: torch names its files from there
    "W1129 04:16:02.535000 17815 .venv/lib/python3.11/site-packages/torch/distributed/elastic/"
    "agent/server/api.py:753] Received 15 death signal, shutting down workers",
]
SIGNALLED = [
    "Traceback (most recent call last):",
    '  File "<frozen runpy>", line 198, in _run_module_as_main',
    '  File ".../torch/distributed/launcher/api.py", line 374, in launch_agent',
    "    result = agent.run()",
    "             ^^^^^^^^^^^",
    '  File ".../torch/distributed/elastic/agent/server/api.py", line 923, in _invoke_run',
    "    time.sleep(monitor_interval)",
    "torch.distributed.elastic.multiprocessing.api.SignalException: Process 3418 got signal: 15",
]
CHAINED = [*SIGNALLED, "During handling of the above exception, another exception occurred:",
           *SIGNALLED]


def child_failed(code: int) -> list[str]:
    """torchrun's ChildFailedError report, both ranks ended with exit code `code`."""
    ranks = [line for rank in (0, 1) for line in (
        f"[{rank}]:", "  time      : 2026-11-29_02:31:26", "  host      : localhost",
        f"  rank      : {rank} (local_rank: {rank})", f"  exitcode  : {code} (pid: 331{rank})",
        "  error_file: <N/A>")]
    return [*SIGNALLED[:5], '  File ".../launcher/api.py", line 383, in launch_agent',
            "    raise ChildFailedError(",
            "torch.distributed.elastic.multiprocessing.errors.ChildFailedError: ",
            "=" * 60, "kit.train FAILED", "-" * 60, "Failures:", *ranks[6:], "-" * 60,
            "Root Cause (first observed failure):", *ranks[:6], "=" * 60]


def shown(lines: list[str], stopping: bool, capsys, terminal: bool = False) -> str:
    """What the front door prints of the run's lines (kit.run.door._Output)."""
    from kit.run import door

    out = door._Output(terminal=terminal)
    out.stopping = stopping
    out.lines(lines)
    out.flush()
    out.say("kit: the end")
    return capsys.readouterr().out


BEFORE = ["[default0]:preempted (SIGTERM): checkpoint the one above at step 9"]
AFTER = ["=== restart 1 of 3 after exit code 1, 2026-11-29 02:31:30"]  # run.sh's own, shown


@pytest.mark.parametrize("tail, stopping, hidden", [
    (STOPPING + SIGNALLED, True, True),  # the door's stop request: torchrun's SignalException
    (STOPPING + SIGNALLED, False, False),  # nobody asked the door: shown as it came
    (STOPPING + CHAINED, True, True),  # a second signal while torchrun was stopping the ranks
    (child_failed(75), False, True),  # every rank saved and stopped on request (SIGUSR1 to one)
    (child_failed(17), True, False),  # a failure: torchrun's report whole, whoever asked
    (child_failed(17)[:-3], False, False),  # a log that ends inside the report: whole
], ids=["stop", "not-asked", "chained", "ranks-stopped", "crash", "cut-short"])
def test_torchruns_traceback_is_left_out_of_a_requested_stop_and_a_failures_shown(
        tail, stopping, hidden, capsys):
    """kit train's terminal (run.log keeps every line): torchrun's own traceback and its lines
    as it signals the ranks are noise after a stop the user asked for; a ChildFailedError report
    of ranks that all exited 75 (kit.recipe.preempt) too; a failure's report is shown whole."""
    text = shown(BEFORE + tail + AFTER, stopping, capsys)
    kept = BEFORE + ([] if hidden else tail) + AFTER + ["kit: the end"]
    assert text == "".join(f"{line}\n" for line in kept)


def test_a_traceback_after_a_ranks_unfinished_line_and_a_ranks_own_traceback(capsys):
    """torchrun's traceback may start on the line a rank left unfinished (tqdm's bar did): held
    as one, the rank's part shown; a rank's own traceback ([defaultN]: on every line) is shown."""
    rank = ["[default1]:Traceback (most recent call last):", '[default1]:  File "x.py", line 1',
            "[default1]:RuntimeError: boom"]
    glued = ["[default0]:train:  45%|####5     | 9/20" + SIGNALLED[0], *SIGNALLED[1:]]
    text = shown(rank + STOPPING + glued + AFTER, True, capsys)
    assert text.splitlines() == [*rank, "[default0]:train:  45%|####5     | 9/20", *AFTER,
                                 "kit: the end"]


def test_rank_0s_progress_is_one_line_redrawn_in_place_on_a_terminal(capsys):
    """On a terminal each progress line (kit.recipe.progress) replaces the one before; the next
    other line starts below the last one. Not on a terminal (a pipe, a file): plain lines."""
    lines = ["[default0]:data: 432 training rows",
             "[default0]:train: step 1/3 (33%): loss 6.9364, 0.50 s/step, 1s left",
             "[default0]:train: step 2/3 (66%): loss 6.9656, 0.40 s/step, 0s left",
             "[default0]:checkpoint: /tmp/run/checkpoints/step-000002",
             "[default0]:train: step 3/3 (100%): loss 6.8535, 0.40 s/step, 0s left"]
    assert shown(lines, False, capsys, terminal=True) == (
        f"{lines[0]}\n\r\033[K{lines[1]}\r\033[K{lines[2]}\n{lines[3]}\n\r\033[K{lines[4]}\n"
        "kit: the end\n")
    assert shown(lines, False, capsys) == "".join(f"{line}\n" for line in [*lines, "kit: the end"])


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
