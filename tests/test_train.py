"""The recipe, run for real: torchrun, 2 CPU processes, gloo, the tiny embedded model."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest
from conftest import ROOT, TINY, read_run, torchrun

pytestmark = pytest.mark.slow
BF16_TOLERANCE = 0.02  # relative to the largest logit: a few bf16 ulps


def reload_and_compare(out) -> dict:
    proc = subprocess.run(
        [sys.executable, str(ROOT / "tests" / "reload_adapter.py"), str(out)],
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def check_trained_and_saved(out, steps: int = 20) -> dict:
    result, metrics = read_run(out)
    train = [m["loss"] for m in metrics if m["split"] == "train"]
    assert len(train) == steps
    # Visible learning: the last steps are well below the first (6.95 -> ~6.1 on the tiny model).
    assert sum(train[-3:]) / 3 < train[0] - 0.3, train
    assert [m["step"] for m in metrics if m["split"] == "val"] == [10, 20]
    # The LoRA weights gathered on each rank are bit-identical.
    sums = result["lora_checksums"]
    assert len(sums) == 2 and sums[0] == sums[1]
    # all-linear on 2 decoder layers: 7 linear modules x 2 layers x (lora_A, lora_B).
    assert result["adapter"]["tensors"] == 28
    # Plain PEFT, one process, no FSDP: same logits as the trained sharded model.
    cmp = reload_and_compare(out)
    assert cmp["max_diff"] < BF16_TOLERANCE * cmp["scale"], cmp
    assert cmp["max_diff_without_adapter"] > 10 * cmp["max_diff"], cmp  # the adapter matters
    return result


# Chat messages (the chat template) with gradient accumulation, and packing (64-token rows hold
# ~3.5 samples; the validation split packs to 14 rows), each in one of the cases.
CHAT_ACCUM = ("data.path=kit:sample-chat", "training.grad_accum=2", "training.batch_size=4",
              "training.recompute.enabled=false")
PACKED = ("data.packing=true", "data.max_seq_len=64", "training.batch_size=4")


# The loading modes (kit.recipe.loading) train: rank0 under FSDP1 (rank 1 builds on meta and receives
# every tensor, the 4-bit ones with their quantization state), stream under FSDP2 (each unit read,
# quantized and sharded in turn) and under FSDP1 (test_second_architecture_qwen2); every other run
# loads fully on every rank.
RANK0, STREAM = ("model.loading=rank0",), ("model.loading=stream",)


# Every engine with NF4 (the recipe), and unquantized once (CI time: each case is a torchrun).
# FSDP2 + NF4 with stream loading is what model.loading=auto gives FSDP2: every default run (the
# tiny_run fixture, notebooks 07, 08, 12) trains and reloads so, and test_loading compares stream
# loading's shards and logits with the other modes; its case here runs with `pytest -m full`.
@pytest.mark.parametrize("engine,quant,extra", [
    pytest.param("fsdp2", "nf4", STREAM, marks=pytest.mark.full),
    ("fsdp1", "nf4", RANK0), ("ddp", "nf4", PACKED), ("fsdp2", "none", CHAT_ACCUM),
], ids=["fsdp2-nf4-stream-loading", "fsdp1-nf4-rank0-loading", "ddp-nf4-packed",
        "fsdp2-none-chat-accum"])  # fmt: skip
def test_engine_trains_and_saves_reloadable_adapter(tmp_path, engine, quant, extra):
    out = tmp_path / "run"
    torchrun(out, f"sharding.engine={engine}", f"quantization.method={quant}", *extra)
    result = check_trained_and_saved(out)
    assert result["world_size"] == 2
    default = "full" if engine == "ddp" else "stream"  # model.loading=auto
    assert result["load"]["mode"] == next((o.split("=")[1] for o in extra if "loading" in o),
                                          default)


@pytest.mark.full  # CI time: stream loading under FSDP1 also runs in test_engine_trains_and_saves_reloadable_adapter's fsdp1 case (rank0) and notebook 10; qwen2's biases in the family matrix
@pytest.mark.parametrize("engine", ["fsdp1"])  # FSDP1's one-dtype-per-unit rules are the strict case
def test_second_architecture_qwen2(tmp_path, engine):
    """Qwen2 (biases on q/k/v), loaded with stream: FSDP1's param_init_fn fills each unit."""
    out = tmp_path / "run"
    torchrun(out, "model.name=kit:tiny-qwen2", f"sharding.engine={engine}", *STREAM)
    assert check_trained_and_saved(out)["load"]["mode"] == "stream"
    config = json.loads((out / "adapter" / "adapter_config.json").read_text())
    # The base as the config names it, not the folder under this machine's KIT_HOME it came from.
    assert config["base_model_name_or_path"] == "kit:tiny-qwen2"


@pytest.mark.slow
def test_without_torchrun_the_recipe_says_it_runs_one_process(tmp_path):
    """python -m kit.train (no torchrun) trains as a world of one, and says so first: the same
    config under torchrun --nproc_per_node=2 sees twice the rows per step."""
    # None of torchrun's variables, nor the port an in-process test's group of one left behind.
    started = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    env = {k: v for k, v in os.environ.items()
           if k not in started and not k.startswith("TORCHELASTIC_")}
    proc = subprocess.run([sys.executable, "-m", "kit.train", str(TINY), "training.steps=1",
                           f"run.output_dir={tmp_path / 'run'}"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    first = proc.stdout.splitlines()[0]
    assert first.startswith("kit.train: started without torchrun, so it runs one process"), first
    assert "world=1" in proc.stdout
    # Not a terminal (a pipe): rank 0's progress is one plain line, no bar on stderr.
    assert "\ntrain: step 1/1 (100%): loss " in proc.stdout and "it/s" not in proc.stderr


PROGRESS = re.compile(r"^\[default(\d)\]:train: step (\d+)/(\d+) \(\d+%\): loss \d+\.\d{4}, "
                      r"\d+\.\d\d s/step, \d+[smh][\dms]* left$")


def progress_steps(log: str) -> list[int]:
    """The steps of the progress lines in a run's log, each checked whole and rank 0's."""
    found = [m for line in log.splitlines() if "train: step" in line
             for m in [PROGRESS.match(line)]]
    assert all(found) and {m[1] for m in found} <= {"0"}, [m and m[0] for m in found]
    return [int(m[2]) for m in found]


def test_rank_0_prints_one_progress_line_per_logged_step_through_torchrun(tiny_run):
    """Under torchrun's --tee a carriage-return bar became two prefixed lines a step; now rank 0
    alone prints one plain line per logged step (training.log_every=1: every step; the keep_best
    run in test_checkpoint.py logs every second one), and run.log holds no \\r."""
    log = (tiny_run / "run.log").read_text()
    assert progress_steps(log) == [1, 2, 3, 4], log[-3000:]
    assert "\r" not in log and "it/s" not in log
