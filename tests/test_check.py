"""Nothing lost, one line for every mistake: the battery of issue 14 (kit.run.check, kit.folder.runfolder,
kit.inputs.sources, the ranks' own refusals).

Every refused case asserts the exit code, one line naming the field or file and what is allowed,
and that every file already in the run folder is byte-identical afterwards. One trained run (a
fixture) serves every case that needs a run folder; three cases start ranks: continuing a finished
run, the early save proof, a rank killed by SIGKILL."""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import ROOT, TINY, TINY_RUN, torchrun

from kit import doctor
from kit.config import ConfigError, load_config
from kit.folder import runfolder
from kit.run.launch import run_to_end

SHORT = TINY_RUN


def snapshot(folder: Path) -> dict[str, str]:
    """sha256 of every file under `folder`, by relative path."""
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def check_cli(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    """python -m kit.run.check, as run.sh's check step runs it."""
    return subprocess.run([sys.executable, "-m", "kit.run.check", *map(str, args)], cwd=cwd,
                          capture_output=True, text=True, timeout=120)


def one_line(text: str) -> str:
    lines = [line for line in text.splitlines() if line.strip()]
    assert len(lines) == 1, text
    return lines[0]


@pytest.fixture
def trained(tiny_run) -> Path:
    """A finished run: 4 steps, checkpoints at 2 and 4, adapter, result, metrics, probe (the
    session's shared run: tests here copy it before changing anything)."""
    return tiny_run


@pytest.fixture
def run_copy(trained, tmp_path) -> Path:
    """The trained run copied to a folder a test may change (config.yaml says where it was)."""
    out = tmp_path / "run"
    shutil.copytree(trained, out)
    return out


# --------------------------------------------------------------------------- 1. a finished run

def test_a_finished_run_is_left_as_it_is_by_every_start_the_kit_advises(run_copy):
    before = snapshot(run_copy)
    base = [f"run.output_dir={run_copy}", *SHORT]
    # A fresh start over it: refused, and the advice names the safe ways on.
    with pytest.raises(ConfigError) as err:
        run_to_end(TINY, base)
    message = str(err.value)
    assert "\n" not in message and message.startswith(f"run.output_dir: '{run_copy}' holds")
    assert "training.resume=auto" in message and "run.start_over=true" in message
    # Following the advice: resume=auto on the finished run says so and starts nothing.
    run = run_to_end(TINY, [*base, "training.resume=auto"])
    assert run.status == "completed"
    # The same through run.sh's check step and the command line.
    proc = subprocess.run(["bash", str(run_copy / "run.sh"), "training.resume=auto"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0
    assert "finished at step 4 of 4; nothing to do" in one_line(proc.stdout + proc.stderr)
    proc = check_cli(TINY, *base, "training.resume=auto")
    assert proc.returncode == 3 and "finished at step 4" in one_line(proc.stdout)
    assert snapshot(run_copy) == before


def test_a_run_without_checkpoints_is_never_retrained_over(tmp_path, trained):
    out = tmp_path / "run"
    shutil.copytree(trained, out, ignore=shutil.ignore_patterns("checkpoints"))
    before = snapshot(out)
    proc = check_cli(TINY, f"run.output_dir={out}", *SHORT, "training.steps=8",
                     "training.resume=auto")
    line = one_line(proc.stderr)
    assert proc.returncode == 2 and "training.resume: 'auto' cannot continue" in line
    assert "no complete valid checkpoint" in line and "checkpointing.save_every" in line
    assert snapshot(out) == before


def test_continuing_a_finished_run_keeps_every_earlier_file(run_copy):
    before = snapshot(run_copy)
    run = torchrun(run_copy, *SHORT, "training.steps=6", "training.resume=auto")
    assert "resumed from" in run.stdout and "step-000004" in run.stdout
    after = snapshot(run_copy)
    earlier = [p for p in (run_copy / "earlier").iterdir()]
    assert len(earlier) == 1
    kept = {str(Path(k).relative_to("earlier", earlier[0].name)): v
            for k, v in after.items() if k.startswith("earlier/")}
    for name, digest in before.items():
        if name in ("run.sh", "start.json", "pid", "exit_code"):  # the start's own files: written anew
            continue
        if name == "metrics.jsonl":  # added to: the earlier rows stay as they were
            assert (run_copy / name).read_bytes().startswith((earlier[0] / name).read_bytes()
                                                            if name in kept else b"")
            continue
        assert after.get(name) == digest or kept.get(name) == digest, name
    assert json.loads((run_copy / "result.json").read_text())["steps"] == 6
    assert json.loads((earlier[0] / "result.json").read_text())["steps"] == 4


def test_start_over_moves_the_earlier_run_and_deletes_nothing(run_copy):
    before = snapshot(run_copy)
    plan = runfolder.decide(load_config(TINY, [f"run.output_dir={run_copy}", *SHORT,
                                             "run.start_over=true"]), 2)
    dest = plan.keep_earlier(run_copy)
    moved = {str(p.relative_to(dest)): hashlib.sha256(p.read_bytes()).hexdigest()
             for p in dest.rglob("*") if p.is_file() and p.name != "why.txt"}
    assert {k: v for k, v in before.items() if k not in runfolder.PLUMBING} == moved
    assert not (run_copy / "adapter").exists() and (dest / "why.txt").is_file()


# --------------------------------------------------------------------------- 2-7. one line each

def _bad_data(tmp_path: Path, text: str, suffix: str = ".jsonl") -> str:
    path = tmp_path / f"data{suffix}"
    path.write_text(text)
    return str(path)


ROWS = "".join(json.dumps({"text": f"row {i} says hello"}) + "\n" for i in range(40))
CASES = {  # name: (overrides, what the one line says)
    "fsdp1_hybrid_shard": (["sharding.engine=fsdp1", "sharding.strategy=HYBRID_SHARD"],
                           "sharding.strategy: 'HYBRID_SHARD' is not allowed"),
    "row_without_text": (lambda t: [f"data.path={_bad_data(t, ROWS + json.dumps({'x': 1}))}"],
                         "row 41"),
    "row_with_null_text": (lambda t: [f"data.path={_bad_data(t, json.dumps({'text': None}) + chr(10) + ROWS)}"],
                           "row 1"),
    "empty_file": (lambda t: [f"data.path={_bad_data(t, '')}"], "holds no rows"),
    "malformed_json_line": (lambda t: [f"data.path={_bad_data(t, ROWS[:60] + '{oops' + chr(10) + ROWS)}"],
                            "line 3"),
    "seq_len_over_positions": (["data.max_seq_len=4096"], "data.max_seq_len: 4096"),
    "target_module_typo": (["lora.target_modules=[q_proj,v_prj]"], "'v_prj'"),
    "nan_lr": (["training.lr=nan"], "training.lr: 'nan' is not allowed; expected a finite number"),
    "cuda_without_gpu": (["training.device=cuda"], "training.device"),
    "flex_on_cpu": (["attention.implementation=flex_attention"],
                    "attention.implementation"),
    "cpu_offload_on_cpu": (["sharding.cpu_offload=true"], "sharding.cpu_offload"),
    "hub_id_offline": (["model.name=meta-llama/Llama-3.1-8B"],
                       "cannot be reached from this machine"),
    "folder_without_config": (lambda t: [f"model.name={t}"], "has no config.json"),
    "unknown_kit_model": (["model.name=kit:nope"], "'kit:nope' is not a kit model; allowed:"),
}


@pytest.mark.parametrize("case", CASES)
def test_each_mistake_is_one_line_before_any_process_starts(case, run_copy, tmp_path):
    overrides, says = CASES[case]
    bad = tmp_path / "bad"
    bad.mkdir()
    overrides = overrides(bad) if callable(overrides) else overrides
    args = [f"run.output_dir={run_copy}", *SHORT, "training.resume=auto", *overrides]
    before = snapshot(run_copy)
    proc = check_cli(TINY, *args)  # run.sh's check step
    line = one_line(proc.stderr)
    assert proc.returncode == 2 and line.startswith("ConfigError: ") and says in line, line
    with pytest.raises(ConfigError) as err:  # the launcher: before writing anything
        run_to_end(TINY, args)
    assert says in str(err.value)
    assert snapshot(run_copy) == before


def test_a_broken_yaml_file_is_one_line_from_the_check_step(tmp_path):
    (tmp_path / "c.yaml").write_text("run:\n  name: x\n model: [\n")
    proc = check_cli(tmp_path / "c.yaml")
    line = one_line(proc.stderr)
    assert proc.returncode == 2 and "c.yaml' line 3 column 2 is not valid YAML" in line


KNOWABLE = ["fsdp1_hybrid_shard", "row_with_null_text", "malformed_json_line", "empty_file",
            "seq_len_over_positions", "target_module_typo", "nan_lr", "cuda_without_gpu",
            "flex_on_cpu", "cpu_offload_on_cpu", "hub_id_offline", "folder_without_config",
            "unknown_kit_model"]


@pytest.mark.parametrize("case", KNOWABLE)
def test_the_doctor_preflight_finds_what_would_fail(case, tmp_path):
    overrides, _ = CASES[case]
    overrides = overrides(tmp_path) if callable(overrides) else overrides
    findings = doctor.preflight(TINY, env={"gpus": [], "vars": {}}, overrides=overrides)
    assert [f for f in findings if f.level == "error"], case


@pytest.mark.slow
def test_the_check_step_says_what_the_run_will_see_before_it_starts(tmp_path):
    """run.sh's check step (a start from a terminal or a cluster's job) prints one line before
    torchrun starts any rank: the data line that rank 0 prints after loading (the same rows per
    split and per rank, tokens, what the loss covers, steps and epochs), and what the start does
    to the run folder. (`kit train` and `launch` run the same check in their own process.)"""
    from kit.run.launch import prepare

    folder = prepare(TINY, [f"run.output_dir={tmp_path / 'run'}", "training.steps=2",
                            "training.eval_every=0"], nproc=2)
    proc = subprocess.run(["bash", str(folder / "run.sh")], capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    log = proc.stdout.splitlines()
    checked = one_line("\n".join(line for line in log if line.startswith("data: ")))
    ranks = [line.split(":", 1)[1] for line in log if line.startswith("[default0]:data: ")]
    planned = [line.split(":", 1)[1] for line in log if line.startswith("[default0]:plan: ")]
    named = "data: kit:sample, model kit:tiny-llama: "
    assert checked.startswith(f"{named}432 training rows (216 per rank), ")
    # The check's line: the file and the model, rank 0's data line, its plan line
    # (kit.budget.plan), the run folder.
    rows = ranks[0].removeprefix("data: ")
    assert [f"{named}{rows}; {planned[0]}; run: {folder}: starting at step 0"] == [checked], (
        checked, ranks, planned)
    assert log.index(checked) < next(i for i, line in enumerate(log) if line.startswith("["))


def test_a_training_split_too_small_for_the_ranks_is_refused_by_the_check(tmp_path):
    """Three short rows pack into one row, which cannot give 2 ranks a batch each (the doctor,
    counting rows without a tokenizer, sees 3): one line from the check step, with remedies that
    exist, before any rank loads the model (it used to come from the ranks after loading)."""
    rows = _bad_data(tmp_path, "".join(json.dumps({"text": f"row {i}"}) + "\n" for i in range(3)))
    proc = check_cli(TINY, f"run.output_dir={tmp_path / 'run'}", f"data.path={rows}",
                     f"data.val_path={rows}", "data.packing=true", "training.batch_size=1")
    assert proc.returncode == 2 and one_line(proc.stderr) == (
        "ConfigError: training.batch_size: 1 is not allowed; the training split has 1 packed "
        "rows, which cannot fill 2 ranks x 1; use more rows in data.path, data.packing=false "
        "(one row per sample), or fewer processes"), proc.stderr
    assert not (tmp_path / "run").exists()


def test_the_success_line_names_the_data_file_the_model_and_a_forgotten_data_path(tmp_path,
                                                                                   capsys):
    """The check step's line names the data file and the model; when key=value overrides changed
    other values but left data.path at the recipe's shipped sample (a user who forgot it), the
    line says so; a data.path of one's own, or no overrides (run.sh's check of a written config),
    says nothing of it."""
    from kit.run import check as check_step

    out = f"run.output_dir={tmp_path / 'run'}"
    assert check_step.main([str(TINY), out, "training.steps=2"]) == 0
    line = one_line(capsys.readouterr().out)
    assert line.startswith("data: kit:sample, model kit:tiny-llama (the recipe's own sample: "
                           "your overrides left data.path as it was; data.path=FILE trains on "
                           "yours): 432 training rows"), line
    mine = tmp_path / "mine.jsonl"
    mine.write_text("".join(json.dumps({"text": f"my row {i}"}) + "\n" for i in range(40)))
    cfg = load_config(TINY, [out, f"data.path={mine}", "training.batch_size=2"])
    line = check_step.success_line(cfg, check_step.check(cfg, 2, here=True),
                                   [out, f"data.path={mine}"])
    assert line.startswith(f"data: {mine}, model kit:tiny-llama: 36 training rows"), line
    assert "recipe's own" not in line
    plain = "kit:sample, model kit:tiny-llama"
    assert check_step.source(load_config(TINY, [out]), []) == plain
    # run.sh's check of the folder's config.yaml, with the overrides the kit's script passes
    assert check_step.source(load_config(TINY), [out, "run.dist_timeout_min=30"]) == plain


# --------------------------------------------------------------------------- ranks

def test_a_run_that_cannot_save_fails_after_its_first_step(tmp_path):
    """A gather that fails (as FSDP1 HYBRID_SHARD's does; injected here, since the config checks
    refuse that one) stops the run at step 1, not after its last step with nothing written."""
    out = tmp_path / "run"
    run = run_to_end(TINY, [f"run.output_dir={out}", "training.steps=20", "training.eval_every=0"],
                     check=False, env={"KIT_FAIL_GATHER": "1"})
    assert run.status == "failed" and "adapter cannot be gathered" in run.failure().message
    assert max(m["step"] for m in run.metrics()) == 1


def test_a_rank_killed_by_sigkill_is_named_with_its_signal(tmp_path, capsys):
    run = run_to_end(TINY, [f"run.output_dir={tmp_path / 'run'}", "training.steps=6",
                            "training.eval_every=0"], check=False,
                     env={"KIT_FAIL_RANK": "1", "KIT_FAIL_STEP": "2", "KIT_FAIL_SIGNAL": "SIGKILL"})
    failure = run.failure()
    assert failure.rank == 1 and failure.message.startswith("killed by SIGKILL (signal 9)")
    # What `kit train` shows of it (kit.run.door leaves torchrun's report out of a stop the user
    # asked for only): a failure's report, whole.
    from kit.run import door
    from kit.run.runs import Follow

    capsys.readouterr()
    shown = door._Output(terminal=False)
    shown.lines(Follow(run.files.log).new_lines())
    shown.flush()
    text = capsys.readouterr().out
    assert "ChildFailedError" in text and "exitcode  : -9" in text, text[-3000:]


def test_a_ranks_own_error_outranks_a_peer_that_died_of_a_signal_in_the_same_second(tmp_path):
    """Rank 1 raised (its error.json); torchrun then stopped rank 0, which aborted in teardown
    in the same second (a clean-clone CI run saw SIGABRT there): rank 1 is the one named."""
    import json

    from kit.run.runs import Run

    err = tmp_path / "logs" / "x" / "attempt_0" / "1"
    err.mkdir(parents=True)
    (err / "error.json").write_text(json.dumps({"message": {
        "message": "InjectedFailure: rank 1 fails at step 3",
        "extraInfo": {"py_callstack": "Traceback ...", "timestamp": "1700000000"}}}))
    (err / "stderr.log").write_text("[rank 1] InjectedFailure: rank 1 fails at step 3\n")
    summary = "".join(f"  time      : 2026-11-24_01:26:08\n  host      : localhost\n"
                      f"  rank      : {r} (local_rank: {r})\n  exitcode  : {c} (pid: 1)\n"
                      for r, c in ((0, -6), (1, 1)))
    (tmp_path / "run.log").write_text(f"Failures:\n{summary}Root Cause (first observed failure):\n"
                                      f"{summary}")
    failure = Run(tmp_path).failure()
    assert failure.rank == 1 and failure.message.startswith("InjectedFailure"), failure


def test_the_hub_kernel_line_of_bitsandbytes_is_the_only_one_dropped():
    """On a CPU with AVX512-BF16, importing bitsandbytes logs that it cannot fetch an optional
    hub kernel; importing the kit drops exactly that record (any CPU: the record is sent by hand
    to the logger bitsandbytes uses), and a kit run's stderr keeps everything else it logs."""
    code = ("import logging, kit, bitsandbytes\n"
            "log = logging.getLogger('bitsandbytes.backends.cpu.ops')\n"
            "log.warning('Failed to load CPU gemm_4bit_forward from kernels-community: %s.', 'x')\n"
            "log.warning('another bitsandbytes warning')\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0 and proc.stderr.strip() == "another bitsandbytes warning", proc.stderr
