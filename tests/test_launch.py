"""kit.run.launch for real: run.sh's torchrun command, runs under the handle on 2 CPU processes,
stop() leaving no process behind, a crash on one rank, and notebook 07 under papermill."""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from conftest import ROOT, alive

from kit.config import ConfigError
from kit.run.check import Refused
from kit.run.launch import Run, RunFailed, begin, launch, prepare, resolve
from kit.run.widgets import Dashboard

ENV = {"OMP_NUM_THREADS": "1"}
# run.sh honours KIT_ROOT: where the ranks' `python -m kit.train` runs (default: this checkout).
RANK_ROOT = Path(os.environ.get("KIT_ROOT", ROOT))


# --------------------------------------------------------------------------- no launch


def test_resolve_names_and_bundled_configs():
    cfg = resolve("tiny-cpu", ["training.steps=3"], name="abc")
    assert (cfg.run.name, cfg.training.steps) == ("abc", 3)
    with pytest.raises(ConfigError, match="run.name"):
        resolve("tiny-cpu", name="a/b")
    assert resolve(cfg, ["lora.r=4"]).lora.r == 4 and cfg.lora.r == 8  # a Config is not mutated


def test_run_sh_builds_the_torchrun_command(tmp_path):
    """run.sh with a stand-in for python: the exact torchrun arguments and environment."""
    folder = prepare("tiny-cpu", [f"run.output_dir={tmp_path / 'r'}"], nproc=3)
    stub = tmp_path / "python"
    stub.write_text('#!/usr/bin/env bash\necho "ARGS $*"\n'
                    'for v in TOKENIZERS_PARALLELISM PYTORCH_CUDA_ALLOC_CONF KIT_START '
                    'TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC OMP_NUM_THREADS; do echo "$v=${!v:-}"; done\n'
                    'exit "${STUB_EXIT:-0}"\n')
    stub.chmod(stub.stat().st_mode | stat.S_IEXEC)
    with pytest.raises(RuntimeError, match="never started"):
        Run(folder).wait(timeout=1)
    base = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "NNODES")}

    def sh(*args, **env):
        proc = subprocess.run(["bash", str(folder / "run.sh"), *args], capture_output=True,
                              text=True, env={**base, "PYTHON": str(stub), **env}, cwd=tmp_path)
        return proc, dict(line.split("=", 1) for line in proc.stdout.splitlines()
                          if "=" in line and not line.startswith(("ARGS", "===")))

    proc, env = sh("training.steps=2", DIST_TIMEOUT_MIN="5")
    assert proc.returncode == 0, proc.stderr
    check, args = [line.split()[1:] for line in proc.stdout.splitlines()
                   if line.startswith("ARGS")]
    # First the check step (kit.run.check), with the same arguments, in one process: it writes
    # the start (start.json), which run.sh names to the ranks.
    assert check == ["-m", "kit.run.check", f"{folder}/config.yaml", f"run.output_dir='{folder}'",
                     "run.dist_timeout_min=5", "training.steps=2", "--nproc", "3", "--nnodes", "1",
                     "--start"]
    assert env["KIT_START"] == f"{folder}/start.json"
    assert args[:4] == ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node=3"]
    assert args[4:8] == ["--log-dir", f"{folder}/logs", "--redirects", "3"]
    assert args[args.index("kit.train") + 1:] == [
        f"{folder}/config.yaml", f"run.output_dir='{folder}'", "run.dist_timeout_min=5",
        "training.steps=2"]
    assert env["TOKENIZERS_PARALLELISM"] == "false"
    assert env["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"
    assert env["TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC"] == str(5 * 60 + 60)
    if shutil.which("nvidia-smi") is None:
        assert env["OMP_NUM_THREADS"] == "1"
    assert (folder / "exit_code").read_text().strip() == "0"
    assert (folder / "pid").read_text().strip().isdigit()

    proc, _ = sh(NNODES="2", NODE_RANK="1", MASTER_ADDR="10.1.2.3", MASTER_PORT="29999",
                 NPROC_PER_NODE="8", KIT_CHECK="0")
    args = next(line for line in proc.stdout.splitlines() if line.startswith("ARGS")).split()
    assert "--standalone" not in args
    for flag in ("--nnodes=2", "--rdzv-backend=c10d", "--rdzv-endpoint=10.1.2.3:29999",
                 "--rdzv-id=tiny-cpu", "--rdzv-conf=is_host=0", "--nproc_per_node=8"):
        assert flag in args

    proc, _ = sh(STUB_EXIT="7", KIT_CHECK="0")  # torchrun's failure is the script's, recorded
    assert proc.returncode == 7 and (folder / "exit_code").read_text().strip() == "7"
    assert Run(folder).status == "failed"
    (folder / "exit_code").unlink()
    proc, _ = sh(STUB_EXIT="2")  # the check step refuses: run.sh stops before torchrun, and
    assert proc.returncode == 2 and sum(line.startswith("ARGS") for line in  # writes nothing
                                        proc.stdout.splitlines()) == 1
    assert not (folder / "exit_code").exists()
    proc, _ = sh(STUB_EXIT="3")  # the check step says the run is finished: nothing to do
    assert proc.returncode == 0 and not (folder / "exit_code").exists()


def test_preflight_error_refuses_to_start(tmp_path):
    """The doctor's error-level finding stops the launch before anything is written, as the one
    error every start raises (kit.run.check.Refused: a line per problem); force=True starts
    despite it, the finding said."""
    bad = ["lora.target_modules=[nope_proj]"]
    out = tmp_path / "refused"
    with pytest.raises(Refused, match="nope_proj") as e:
        launch("tiny-cpu", [*bad, f"run.output_dir={out}"])
    assert e.value.problems and all("\n" not in line for line in e.value.problems)
    assert not out.exists()  # nothing written, nothing started
    forced = begin(resolve("tiny-cpu", [*bad, f"run.output_dir={out}"]), force=True)
    assert any(f.level == "error" and "nope_proj" in f.message for f in forced.findings)
    assert not out.exists()


# --------------------------------------------------------------------------- real launches


@pytest.mark.full  # CI time: tests/test_trust_signals.py's detached run is stopped from another process (kit runs --stop: Run.attach(...).stop()), every process gone, its checkpoint verified
def test_stop_from_another_process_leaves_no_process_alive(tmp_path):
    run = launch("tiny-cpu", ["training.steps=100000", f"run.output_dir={tmp_path / 'stop'}"],
                 nproc=2, env=ENV)
    try:
        run.wait(timeout=600, step=2)
        procs = run.processes()
        cmdlines = [" ".join(p.cmdline()) for p in procs]
        agents = [c for c in cmdlines if "-m torch.distributed.run" in c]
        ranks = [c for c in cmdlines if "-m kit.train" in c and c not in agents]
        assert (len(agents), len(ranks)) == (1, 2), cmdlines  # torchrun and both ranks found
        pids = [p.pid for p in procs]
        start = time.monotonic()
        # Re-attach from a fresh interpreter, as a new kernel would, and stop from there.
        code = f"from kit.run.launch import Run; print(Run.attach({str(run.folder)!r}).stop())"
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                              timeout=120, cwd=ROOT)
        assert proc.stdout.strip().splitlines()[-1] == "stopped", proc.stderr
        assert time.monotonic() - start < 30
        run.processes()  # reaps our bash child
        assert [pid for pid in pids if alive(pid)] == []
        # The ranks saved the step they were in (kit.recipe.preempt): a stopped run can be continued.
        assert run.status == "stopped" and run.result()["status"] == "preempted"
        assert (run.folder / "checkpoints" / f"step-{run.result()['steps']:06d}").is_dir()
    finally:
        run.stop(grace_s=2)


@pytest.mark.full  # CI time: notebook 07 section 5 crashes rank 1 the same way; its test reads the failure back (crashed_rank_is_named)
def test_crash_on_one_rank_raises_with_its_rank_and_traceback(tmp_path):
    train_py = (RANK_ROOT / "kit" / "train.py").read_text()
    if "faults.maybe_fail(" not in train_py:
        pytest.fail("kit/train.py does not call the failure hook yet: add "
                    "`faults.maybe_fail(step, env.rank)` after `row = self.train_step()`")
    run = launch("tiny-cpu", [f"run.output_dir={tmp_path / 'crash'}"], nproc=2,
                 env={**ENV, "KIT_FAIL_RANK": "1", "KIT_FAIL_STEP": "2"})
    with pytest.raises(RunFailed) as e:
        run.wait(timeout=600)
    raised = time.time()
    assert e.value.rank == 1 and "maybe_fail" in e.value.traceback
    # Surfaced within seconds of the crash: the failed rank's error file is the clock.
    assert raised - os.path.getmtime(os.path.join(os.path.dirname(e.value.log), "error.json")) < 20
    crashed_rank_is_named(run, step=2)


def crashed_rank_is_named(run: Run, step: int) -> None:
    """A run whose rank 1 raised at `step` (KIT_FAIL_RANK=1): the failure names the rank, its
    error and traceback, from that rank's own log; the run ended within seconds of the crash
    (torchrun stopped rank 0, nothing hung), and the dashboard shows it."""
    assert run.status == "failed" and run.processes() == []
    e = run.failure()
    assert e.rank == 1
    assert e.message.startswith(f"InjectedFailure: injected failure on rank 1 at step {step}")
    assert "maybe_fail" in e.traceback and "rank 1" in str(e)
    assert os.path.basename(os.path.dirname(e.log)) == "1"  # the failed rank's own log
    error_file = os.path.join(os.path.dirname(e.log), "error.json")
    assert os.path.getmtime(run.files.exit_code) - os.path.getmtime(error_file) < 20
    dash = Dashboard(run, live=True)
    dash.poll()
    assert dash.progress.bar_style == "danger"
    assert "failed on rank 1" in dash.error.value and "InjectedFailure" in dash.error.value


def test_rank_side_config_error_names_the_field(tmp_path):
    """A failure without error.json: the recipe exits 2 on a ConfigError on every rank (started
    by hand, past the check step), each printing one "[rank N] ConfigError: ..." line; and a
    refusal of run.sh's check step, before any rank. (kit.recipe.lora's own line: tests/test_lora.py.)"""
    folder = prepare("tiny-cpu", [f"run.output_dir={tmp_path / 'bad'}"], nproc=2)
    (folder / "pid").write_text("999999999\n")
    (folder / "exit_code").write_text("1\n")
    line = "lora.target_modules: 'nope_proj' matches no module of kit:tiny-llama"
    (folder / "run.log").write_text(f"[default1]:[rank 1] ConfigError: {line}\n"
                                    f"[default0]:[rank 0] ConfigError: {line}\n"
                                    "torch.distributed.elastic.multiprocessing.errors."
                                    "ChildFailedError:\n")
    failure = Run(folder).failure()
    assert (failure.rank, failure.message) == (1, f"ConfigError: {line}")
    (folder / "run.log").write_text(f"ConfigError: {line}\n")  # the check step's refusal
    failure = Run(folder).failure()
    assert failure.rank is None and failure.message == f"ConfigError: {line}"
    assert "failed on its check step (no rank started)" in str(failure)


@pytest.mark.slow
def test_notebook_07_runs_under_papermill(tmp_path, monkeypatch):
    papermill = pytest.importorskip("papermill")
    monkeypatch.delenv("JPY_SESSION_NAME", raising=False)  # as in CI: no live frontend
    monkeypatch.delenv("KIT_LIVE", raising=False)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    name = f"test-nb07-{os.getpid()}"
    out = tmp_path / "07.ipynb"
    try:
        papermill.execute_notebook(
            str(ROOT / "notebooks" / "07-launch-multi-gpu.ipynb"), str(out),
            parameters={"run_name": name}, cwd=str(ROOT / "notebooks"),
            kernel_name="python3", progress_bar=False,
        )
        nb = json.loads(out.read_text())
        text, mimes = "", set()
        for cell in nb["cells"]:
            for o in cell.get("outputs", []):
                text += o.get("text", "") if isinstance(o.get("text"), str) else "".join(
                    o.get("text", []))
                mimes |= set(o.get("data", {}))
                text += "".join(o.get("data", {}).get("text/plain", ""))
        assert "step    20/20  loss" in text  # text progress, not widgets
        assert "application/vnd.jupyter.widget-view+json" not in mimes
        assert f"adapter: {ROOT / 'launch' / name / 'adapter'}" in text
        assert "completed 22 metric rows" in text  # re-attached: 20 train + 2 val rows
        assert "stopped | processes left: 0" in text
        assert "image/png" in mimes  # compare()
        # FSDP2 and DDP: close, not bit for bit (bf16 adapter compute under FSDP2, fp32 in DDP).
        gap = float(text.split("largest |FSDP2 - DDP| loss gap over ")[1].split(": ")[1].split()[0])
        assert 0 < gap < 0.05, gap
        assert "rank 1 failed: InjectedFailure" in text
        crashed_rank_is_named(Run.attach(ROOT / "launch" / f"{name}-crash"), step=3)
        # Claim B15, read from the recorded H100 run: fragmentation's out-of-memory steps.
        assert ("capped 1.02x: out of memory on 16 of 60 steps by default, 0 of 60 with "
                "expandable_segments") in text
        # The notebook's first run, read again from its folder: what a launch leaves.
        run = Run.attach(ROOT / "launch" / name)
        metrics, result = run.metrics(), run.result()
        assert [m["step"] for m in metrics if m["split"] == "train"] == list(range(1, 21))
        assert [m["step"] for m in metrics if m["split"] == "val"] == [10, 20]
        for key in ("loss", "lr", "grad_norm", "tokens_per_s", "peak_mem_gib", "elapsed_s"):
            assert key in metrics[0], key
        assert result["status"] == "completed" and result["world_size"] == 2
        assert result["final_loss"] < result["first_loss"]
        assert run.exit_code == 0 and run.processes() == []
        log = "\n".join(run.tail(10_000))  # both ranks, interleaved; and one log per rank
        assert "[default0]:" in log and "[default1]:" in log
        for rank in (0, 1):
            assert run.tail(1000, rank=rank), f"no log for rank {rank}"
    finally:
        for suffix in ("", "-ddp", "-crash"):
            folder = ROOT / "launch" / f"{name}{suffix}"
            if folder.exists():
                Run(folder).stop(grace_s=2)
                shutil.rmtree(folder, ignore_errors=True)


@pytest.mark.slow
def test_run_to_end_timeout_stops_every_process_of_the_run(tmp_path):
    """The captured-run helper's timeout stops bash, torchrun and both ranks (subprocess.run's
    timeout kills only its own child: torchrun's ranks, each in a session of its own, live on)."""
    from kit.run.launch import run_to_end

    folder = tmp_path / "slow"
    # 12 s from run.sh's start: torchrun's ranks start within ~3 s here (~7 s on a slower CI)
    with pytest.raises(TimeoutError, match="stopped after 12s"):
        run_to_end("tiny-cpu", ["training.steps=100000", f"run.output_dir={folder}"], nproc=2,
                   env=ENV, timeout=12)
    left = []
    for p in psutil.process_iter():
        try:
            if str(folder) in " ".join(p.cmdline()) and p.status() != psutil.STATUS_ZOMBIE:
                left.append(p.pid)
        except psutil.Error:
            pass
    assert left == []
    assert Run(folder).status == "stopped" and "-m kit.train" in Run(folder).output()
