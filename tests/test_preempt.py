"""What clusters do to runs, done for real on 2 CPU processes (kit.recipe.preempt, run.sh, kit.folder.runfolder):
a stop request saves the step and exits resumable, a restart resumes by itself, a second request
exits at once without a half-written checkpoint, a rank killed mid-step is restarted by torchrun.

Each compares with one run that was never interrupted (fp32 without quantization: exact on CPU)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
from conftest import TINY, read_run, torchrun

from kit.folder import manifest
from kit.run.launch import launch

pytestmark = pytest.mark.slow
STEPS = 60
ARGS = ["model.dtype=float32", "quantization.method=none", f"training.steps={STEPS}",
        "training.eval_every=0", "checkpointing.save_every=20", "checkpointing.keep_last=0"]


def losses(out: Path, after: int = 0) -> dict[int, float]:
    return {m["step"]: m["loss"] for m in read_run(out)[1] if m["split"] == "train"
            and m["step"] > after}


def same_adapter(a: Path, b: Path) -> bool:
    """The adapters the two runs saved hold the same tensors (each rank's checksum of them)."""
    return read_run(a)[0]["lora_checksums"] == read_run(b)[0]["lora_checksums"]


def tree(folder: Path) -> dict[str, str]:
    return {p.relative_to(folder).as_posix(): manifest.sha256(p)
            for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def straight(tmp_path_factory) -> Path:
    """The run that was never interrupted."""
    out = tmp_path_factory.mktemp("straight") / "run"
    torchrun(out, *ARGS)
    return out


def started(out: Path, env: dict | None = None, at_step: int = 3, extra: tuple = ()):
    run = launch(TINY, [f"run.output_dir={out}", *ARGS, *extra], nproc=2, env=env)
    run.wait(step=at_step, timeout=300)
    return run


def ended(run, timeout: float = 120) -> float:
    began = time.monotonic()
    while run.processes():
        assert time.monotonic() - began < timeout, run.output()[-3000:]
        time.sleep(0.1)
    return time.monotonic() - began


def restart(out: Path) -> subprocess.CompletedProcess:
    """The job started again as a requeued Slurm job starts it: the same run.sh."""
    return subprocess.run(["bash", str(out / "run.sh")], env={**os.environ, "SLURM_RESTART_COUNT": "1"},
                          capture_output=True, text=True, timeout=600)


@pytest.mark.full  # CI time: notebook 08 section 7 sends run.sh the stop request and restarts it (exit 75, resumed), section 3 resumes exactly
def test_a_stop_request_saves_the_step_and_a_restart_resumes_by_itself(tmp_path, straight):
    """SIGTERM to run.sh alone (what Kubernetes sends a pod's first process): the ranks finish the
    step, save it, write result.json "preempted" and run.sh exits 75; the same run.sh started
    again as a restart resumes from that step with no option added (and despite the first
    start's run.start_over=true, which a restart obeying it would throw every step away with),
    and every later step's loss is the uninterrupted run's."""
    out = tmp_path / "run"
    run = started(out, extra=("run.start_over=true",))
    assert run.preempt() < 30  # SIGTERM to run.sh alone: well inside Kubernetes' grace period
    result = read_run(out)[0]
    step = result["steps"]
    assert (run.exit_code, run.status, result["status"]) == (75, "preempted", "preempted")
    assert 3 <= step < STEPS and (out / "checkpoints" / f"step-{step:06d}").is_dir()
    assert f"preempted (SIGTERM): checkpoint {out / 'checkpoints' / f'step-{step:06d}'} at step " \
           f"{step}" in run.output()
    saved = tree(out / "checkpoints")
    proc = restart(out)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "a restart of this run (SLURM_RESTART_COUNT=1): training.resume=auto" in proc.stdout
    assert f"resumed from {out / 'checkpoints' / f'step-{step:06d}'} at step {step}" in proc.stdout
    assert losses(out, step) == losses(straight, step)  # exact: fp32 on CPU
    assert same_adapter(out, straight)
    assert {k: v for k, v in tree(out / "checkpoints").items() if k in saved} == saved


@pytest.mark.full  # CI time: a variant of the stop request; notebook 08 section 7 and the test above run the stop and the restart
def test_a_stop_request_during_a_save_lets_it_finish_and_stops_there(tmp_path, straight):
    """SIGUSR1 (what Slurm's --signal=USR1@120 sends ahead of a time limit) while checkpoint 20
    is being written (KIT_SLOW_SAVE_S makes it take 5 s): run.sh passes it on as SIGTERM, the save
    completes, no second one is written, and the run stops there, resumable from step 20."""
    out = tmp_path / "run"
    run = started(out, env={"KIT_SLOW_SAVE_S": "5"}, at_step=20)
    run.preempt(signal.SIGUSR1)
    assert (run.exit_code, read_run(out)[0]["status"], read_run(out)[0]["steps"]) == (75, "preempted", 20)
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-000020"]
    assert "preempted (SIGTERM): checkpoint the one above at step 20" in run.output()
    assert manifest.problem(out / "checkpoints" / "step-000020") is None


@pytest.mark.full  # CI time: a variant of the stop request; a half-written checkpoint is skipped in notebook 08 section 4
def test_a_second_request_exits_at_once_leaving_no_half_written_checkpoint(tmp_path, straight):
    """A save that takes long (KIT_SLOW_SAVE_S) and a second request to run.sh 3 s after the
    first: torchrun and the ranks end at once, the checkpoint being written stays step-N.tmp
    (never resumed), and a restart starts over from the start, exactly."""
    out = tmp_path / "run"
    run = started(out, env={"KIT_SLOW_SAVE_S": "20"})
    script = int((out / "pid").read_text())
    os.kill(script, signal.SIGTERM)
    time.sleep(3)
    os.kill(script, signal.SIGTERM)
    assert ended(run) < 15  # not the 20 s the save would have taken
    ckpts = sorted(p.name for p in (out / "checkpoints").iterdir())
    assert ckpts and all(name.endswith(".tmp") for name in ckpts), ckpts  # none completed
    proc = restart(out)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert ".tmp" in proc.stdout and "starting at step 0" in proc.stdout  # named, then skipped
    assert losses(out) == losses(straight)


def test_a_rank_killed_mid_step_is_restarted_and_resumes(tmp_path, straight):
    """kill -9 of rank 1 after step 25 (what the kernel's OOM killer does), with torchrun allowed
    one restart (KIT_MAX_RESTARTS=1; the Slurm and Kubernetes files set 3): run.sh starts
    torchrun again, whose ranks resume from step 20 by themselves and finish as if nothing
    happened."""
    out = tmp_path / "run"
    run = launch(TINY, [f"run.output_dir={out}", *ARGS], nproc=2, env={
        "KIT_FAIL_RANK": "1", "KIT_FAIL_STEP": "25", "KIT_FAIL_SIGNAL": "SIGKILL",
        "KIT_MAX_RESTARTS": "1"})
    ended(run, timeout=300)
    assert run.exit_code == 0, run.output()[-3000:]
    text = run.output()
    assert "=== restart 1 of 1 after exit code 1" in text
    assert "a restart of this run (KIT_RESTART_COUNT=1)" in text
    assert f"resumed from {out / 'checkpoints' / 'step-000020'} at step 20" in text
    assert losses(out, 20) == losses(straight, 20) and same_adapter(out, straight)
    assert json.loads((out / "result.json").read_text())["status"] == "completed"


@pytest.mark.full  # CI time: notebook 08 section 7 resumes a 2-rank run on 1 rank, its test asserts the reshard line
@pytest.mark.parametrize("before, after", [(2, 1), (1, 2)], ids=["2-to-1", "1-to-2"])
def test_a_run_resumes_on_another_number_of_ranks(tmp_path, before, after):
    """Stopped at step 6 on `before` ranks, resumed on `after`: the sharded adapter and optimizer
    state reshard, the run says what differs, the data goes on from the samples it had reached
    (counted: step 6's position plus 6 steps of `after` ranks' rows) and the loss continues."""
    from kit.config import load_config
    from kit.recipe import checkpoint

    out = tmp_path / "run"
    args = [*ARGS[:2], "training.steps=12", "training.eval_every=0", "checkpointing.save_every=6"]
    torchrun(out, *args, "training.stop_at_step=6", nproc=before)
    run = torchrun(out, *args, "training.resume=auto", nproc=after)
    step6 = out / "checkpoints" / "step-000006"
    assert f"{step6} was written by {before} ranks, this run has {after}: the adapter and " \
           "optimizer state are resharded and the data continues where it stopped" in run.stdout
    assert f"resumed from {step6} at step 6" in run.stdout
    t = load_config(TINY).training
    seen = [checkpoint.read_trainer(out / "checkpoints" / f"step-{s:06d}")["batches"]["samples"]
            for s in (6, 12)]
    assert seen == [6 * t.batch_size * t.grad_accum * before,
                    6 * t.batch_size * t.grad_accum * (before + after)]
    result, metrics = read_run(out)
    train = [m["loss"] for m in metrics if m["split"] == "train"]
    assert result["status"] == "completed" and result["world_size"] == after and len(train) == 12
    assert max(train[6:]) < train[0] and abs(train[6] - train[5]) < 0.5  # it went on, no restart


@pytest.mark.full  # CI time: a save that fails midway is resumed past in notebook 08 section 4
def test_a_full_disk_while_saving_ends_the_run_resumable(tmp_path, straight):
    """Checkpoint 40 meets a full disk (KIT_FAIL_DISK_STEP: each rank's files may not grow past
    64 KiB, so writes fail as on a full disk): the run ends with one line per rank naming the
    step and what to do, no checkpoint half-written, step 20 byte-identical; with space again a
    restart resumes from step 20 and finishes as if nothing happened."""
    out = tmp_path / "run"
    run = launch(TINY, [f"run.output_dir={out}", *ARGS], nproc=2, env={"KIT_FAIL_DISK_STEP": "40"})
    ended(run, timeout=300)
    text = run.output()
    assert run.status == "failed" and run.exit_code != 0
    said = [line for line in text.splitlines() if "CheckpointError: " in line]
    assert said and "checkpoint step-000040 cannot be written ([Errno 27] File too large); it " \
                    "stays step-000040.tmp, which no resume takes" in said[0], text[-3000:]
    assert "Traceback" not in "\n".join(line for line in text.splitlines() if line.startswith("[default"))
    names = sorted(p.name for p in (out / "checkpoints").iterdir())
    assert names == ["step-000020", "step-000040.tmp"], names
    saved = tree(out / "checkpoints" / "step-000020")
    proc = restart(out)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert f"resumed from {out / 'checkpoints' / 'step-000020'} at step 20" in proc.stdout
    assert losses(out, 20) == losses(straight, 20) and same_adapter(out, straight)
    assert tree(out / "checkpoints" / "step-000020") == saved
