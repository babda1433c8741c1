"""job.sbatch under a real Slurm: a one-node cluster on this machine (kit.run.slurm: munged,
slurmctld, slurmd on localhost), started by the tests where Slurm is installed and they run as
root (CI: .ci/run installs it), skipped in one line elsewhere. No stand-ins: sbatch runs the file
`kit jobs` writes for a CPU run of 2 processes, Slurm signals it, requeues it and starts it again.

Each run is compared with the same config and seed under the kit's own start (run_to_end, as
`kit train`): fp32 without quantization, so the losses are exact on CPU."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import ROOT, TINY, read_run, torchrun

from kit.folder import jsonl, manifest
from kit.run import jobs, slurm

pytestmark = pytest.mark.slow
STEPS = 24
ARGS = ["training.device=cpu", "model.dtype=float32", "quantization.method=none",
        f"training.steps={STEPS}", "training.eval_every=0", "checkpointing.save_every=8",
        "checkpointing.keep_last=0"]
TIMEOUT_S = 600  # a job's whole life; a 2-core machine shared with other work is slow


@pytest.fixture(scope="session")
def cluster():
    """The local cluster (kit.run.slurm): started here and stopped after, or the one that
    `python -m kit.run.slurm start` left running (kept); never another cluster."""
    why = slurm.cannot_start()
    if why and not slurm.running():
        pytest.skip(f"no Slurm cluster here: {why}")
    started = slurm.start() if not why else False
    yield
    if started:
        slurm.stop()


@pytest.fixture(scope="module")
def straight(tmp_path_factory) -> Path:
    """The same run under the kit's own start, never interrupted."""
    out = tmp_path_factory.mktemp("straight") / "run"
    torchrun(out, *ARGS)
    return out


def submitted(folder: Path, *args: str) -> str:
    jobs.write(TINY, ARGS, nnodes=1, nproc_per_node=2, out=folder)
    assert "#SBATCH --cpus-per-task=2" in (folder / "job.sbatch").read_text().splitlines()
    return slurm.submit(folder, *args)


def output(folder: Path, job: str) -> str:
    path = folder / "logs" / f"slurm-{job}.out"
    return path.read_text() if path.exists() else f"({path} not written)"


def node() -> str:
    return subprocess.run(["sinfo", "-h", "-N", "-o", "%t"], capture_output=True,
                          text=True).stdout.strip()


def losses(out: Path) -> dict[int, float]:
    return {m["step"]: m["loss"] for m in read_run(out)[1] if m["split"] == "train"}


def verified(out: Path) -> None:
    """The run's adapter through the kit's own check (`kit checkpoints verify`)."""
    proc = subprocess.run([sys.executable, "-m", "kit", "checkpoints", "verify", str(out / "adapter")],
                          capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr


@pytest.fixture
def cancelled():
    """Jobs a test submitted are cancelled when it ends, passed or not."""
    ids: list[str] = []
    yield ids
    for job in ids:
        subprocess.run(["scancel", job], capture_output=True)


def test_the_job_file_runs_under_slurm_as_under_kit_train(cluster, straight, tmp_path, cancelled):
    """sbatch of the folder `kit jobs` writes for a CPU run (a CPU per rank, no GPU asked: Slurm
    refuses a GPU request on a cluster without GPUs) completes, with a verified adapter and the
    losses and adapter of the same run under the kit's own start."""
    folder = tmp_path / "run"
    job = submitted(folder)
    cancelled.append(job)
    began = time.monotonic()
    info = slurm.wait(job, timeout=TIMEOUT_S)
    log = output(folder, job)
    print(f"job {job}: {info['JobState']} in {time.monotonic() - began:.0f} s "
          f"(RunTime {info['RunTime']})")
    assert (info["JobState"], info["ExitCode"], info["Restarts"]) == ("COMPLETED", "0:0", "0"), \
        log[-3000:]
    result = read_run(folder)[0]
    assert (result["status"], result["steps"], result["world_size"]) == ("completed", STEPS, 2)
    verified(folder)
    assert losses(folder) == losses(straight)  # exact: fp32 on CPU, same seed
    assert result["lora_checksums"] == read_run(straight)[0]["lora_checksums"]


def test_a_job_signalled_ahead_of_its_time_limit_is_requeued_and_resumes(
        cluster, straight, tmp_path, cancelled):
    """SIGUSR1 as the job file's --signal=B:USR1@120 delivers it (to the batch script): the ranks
    save the step under way, run.sh exits 75, the job requeues itself and starts again by itself
    (SLURM_RESTART_COUNT=1), resuming from that checkpoint: the final losses and adapter are the
    uninterrupted run's, and every file the first start left is still there (or kept in
    earlier/), the checkpoint byte for byte, the first start's lines in the job's output."""
    folder = tmp_path / "run"
    job = submitted(folder)
    cancelled.append(job)
    began = time.monotonic()
    while len(jsonl.read(folder / "metrics.jsonl")) < 2:  # training, steps 1-2 done
        state = slurm.job(job).get("JobState")
        assert state in ("PENDING", "RUNNING") and time.monotonic() - began < TIMEOUT_S, \
            output(folder, job)[-3000:]
        time.sleep(0.2)
    subprocess.run(["scancel", "--signal=USR1", "--batch", job], check=True)
    while ((info := slurm.job(job)).get("Restarts") != "1" or info["JobState"] != "PENDING"
           or node() != "idle"):  # the first start's processes all gone, the node cleaned up
        assert info["JobState"] in ("RUNNING", "COMPLETING", "PENDING", "REQUEUED") and \
            time.monotonic() - began < TIMEOUT_S, (info, output(folder, job)[-3000:])
        time.sleep(0.2)
    # Requeued and waiting: Slurm holds a requeued job 120 s (its BeginTime) before it may start
    # again; the test lets it start now. Nothing of the run is running: what the first start left.
    first = {p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file()}
    result = jsonl.read(folder / "metrics.jsonl")
    step = read_run(folder)[0]["steps"]
    saved = folder / "checkpoints" / f"step-{step:06d}"
    assert read_run(folder)[0]["status"] == "preempted" and 2 <= step < STEPS, result
    assert manifest.problem(saved) is None
    digests = {p.name: manifest.sha256(p) for p in saved.rglob("*") if p.is_file()}
    # slurmd revoked the first start's credential when the job requeued, at a time in whole
    # seconds, and refuses any credential of this job made in that second or before (its check
    # is ctime <= revoked): a start let through within the same second was killed, "Job credential
    # revoked" (seen once, 0.6 s after the requeue). Two seconds on, the new one is younger.
    time.sleep(2)
    subprocess.run(["scontrol", "update", f"JobId={job}", "StartTime=now"], check=True)
    info = slurm.wait(job, timeout=TIMEOUT_S)
    log = output(folder, job)
    print(f"job {job}: preempted at step {step}, {info['JobState']} after {info['Restarts']} "
          f"restart(s), {time.monotonic() - began:.0f} s in all")
    assert (info["JobState"], info["ExitCode"], info["Restarts"]) == ("COMPLETED", "0:0", "1"), \
        log[-3000:] + slurm.log_tail()
    assert f"preempted (SIGTERM): checkpoint {saved} at step {step}" in log  # the first start's
    assert "a restart of this run (SLURM_RESTART_COUNT=1): training.resume=auto" in log
    assert f"resumed from {saved} at step {step}" in log
    assert read_run(folder)[0]["status"] == "completed"
    verified(folder)
    assert losses(folder) == losses(straight)
    assert read_run(folder)[0]["lora_checksums"] == read_run(straight)[0]["lora_checksums"]
    lost = [rel for rel in first if not (folder / rel).exists()
            and not list(folder.glob(f"earlier/*/{rel}"))]
    assert not lost, lost
    assert {p.name: manifest.sha256(p) for p in saved.rglob("*") if p.is_file()} == digests


def test_a_job_with_a_bad_config_ends_with_the_kits_one_line(cluster, tmp_path, cancelled):
    """A mistake in the values given to sbatch (key=value after the script) fails the job in
    its check step, before any rank starts: the job's output ends with the kit's one line, no
    traceback."""
    folder = tmp_path / "bad"
    job = submitted(folder, "training.lr=fast")
    cancelled.append(job)
    began = time.monotonic()
    info = slurm.wait(job, timeout=TIMEOUT_S)
    log = output(folder, job)
    print(f"job {job}: {info['JobState']} ({info['ExitCode']}) in "
          f"{time.monotonic() - began:.0f} s")
    assert info["JobState"] == "FAILED" and info["Restarts"] == "0", log
    # After the kit's line only srun's own report of the step's end ("srun: error: ...").
    kit = [line for line in log.splitlines() if line.strip() and not line.startswith("srun: ")]
    assert kit[-1] == "ConfigError: training.lr: 'fast' is not allowed; expected a number", log
    assert sum("ConfigError" in line for line in kit) == 1, log
    assert "Traceback" not in log and not (folder / "metrics.jsonl").exists(), log
