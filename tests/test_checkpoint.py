"""Checkpoints on 2 CPU processes: exact resume, interrupted saves, retention, merge, empty files.

(The adapter round trip for every engine is in test_train.py.)"""

from __future__ import annotations

import json
import os

import pytest
import torch
from conftest import read_run, torchrun

from kit import checkpoint

pytestmark = pytest.mark.slow
FP32 = ["model.dtype=float32", "quantization.method=none"]  # exact arithmetic on CPU


def losses(out) -> list[tuple[str, int, float]]:
    return [(m["split"], m["step"], m["loss"]) for m in read_run(out)[1]]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    out = tmp_path_factory.mktemp("ck") / "straight"
    torchrun(out, *FP32)
    return losses(out)


def test_resume_after_stop_equals_uninterrupted_run_exactly(tmp_path, uninterrupted):
    out = tmp_path / "run"
    torchrun(out, *FP32, "checkpointing.save_every=5", "training.stop_at_step=10")
    assert read_run(out)[0]["status"] == "stopped"
    proc = torchrun(out, *FP32, "checkpointing.save_every=5", "training.resume=auto")
    assert "resumed from" in proc.stdout and "step-000010" in proc.stdout
    result, _ = read_run(out)
    assert result["status"] == "completed"
    assert losses(out) == uninterrupted  # every step, bit for bit
    # Retention: keep_last=2 leaves exactly the two newest.
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-000015", "step-000020"]


def test_killed_mid_save_resumes_from_previous_good_checkpoint(tmp_path, uninterrupted):
    out = tmp_path / "run"
    os.environ["KIT_FAIL_SAVE_STEP"] = "10"
    try:
        proc = torchrun(out, *FP32, "checkpointing.save_every=5", check=False)
    finally:
        del os.environ["KIT_FAIL_SAVE_STEP"]
    assert proc.returncode != 0
    complete, incomplete = checkpoint.scan(out)
    assert [s for s, _ in complete] == [5] and [f.name for f in incomplete] == ["step-000010.tmp"]
    proc = torchrun(out, *FP32, "checkpointing.save_every=5", "training.resume=auto")
    assert "skipping" in proc.stdout and "step-000010.tmp: incomplete" in proc.stdout
    assert "step-000005" in proc.stdout.split("resumed from", 1)[1].splitlines()[0]
    assert losses(out) == uninterrupted


def test_resume_nf4_bf16_fsdp1_full_format(tmp_path):
    engine, fmt = "fsdp1", "full"
    args = [f"sharding.engine={engine}", f"checkpointing.format={fmt}", "checkpointing.save_every=10",
            "training.steps=14", "training.eval_every=0"]
    straight, resumed = tmp_path / "a", tmp_path / "b"
    torchrun(straight, *args)
    torchrun(resumed, *args, "training.stop_at_step=10")
    torchrun(resumed, *args, "training.resume=auto")
    a, b = losses(straight), losses(resumed)
    assert [x[:2] for x in a] == [x[:2] for x in b]
    assert max(abs(x[2] - y[2]) for x, y in zip(a, b, strict=True)) < 1e-3  # bf16: within tolerance
    marker = json.loads((resumed / "checkpoints" / "step-000010" / checkpoint.MARKER).read_text())
    assert marker["format"] == fmt and marker["bytes"] > 0


def test_resume_path_must_be_a_complete_checkpoint(tmp_path):
    with pytest.raises(checkpoint.CheckpointError, match="training.resume: .* is not a complete checkpoint"):
        checkpoint.find_resume(str(tmp_path), tmp_path)


def test_verify_rejects_empty_and_wrong_adapters(tmp_path):
    from safetensors.torch import save_file

    (tmp_path / "adapter_config.json").write_text(json.dumps({"r": 8}))
    save_file({}, str(tmp_path / "adapter_model.safetensors"))
    expected = {"base_model.model.layer.lora_A.weight": (8, 16)}
    with pytest.raises(checkpoint.CheckpointError, match="1 of 1 LoRA tensors missing \\(holds 0\\)"):
        checkpoint.verify_adapter(tmp_path, expected)
    save_file({"base_model.model.layer.lora_A.weight": torch.zeros(4, 16)}, str(tmp_path / "adapter_model.safetensors"))
    with pytest.raises(checkpoint.CheckpointError, match="has shape \\(4, 16\\), expected \\(8, 16\\)"):
        checkpoint.verify_adapter(tmp_path, expected)


def test_merged_export_matches_adapter_on_base(tmp_path):
    from transformers import AutoModelForCausalLM

    out = tmp_path / "run"
    torchrun(out, "training.steps=6", "training.eval_every=0")
    merged = checkpoint.merge_adapter(out, tmp_path / "merged")
    assert "quantization_config" not in json.loads((merged / "config.json").read_text())
    plain = AutoModelForCausalLM.from_pretrained(merged).eval()  # no PEFT, no bitsandbytes
    with_adapter, _ = checkpoint.load_for_inference(out)
    probe = torch.load(out / "probe.pt")
    inputs = {k: probe[k] for k in ("input_ids", "attention_mask")}
    mask = inputs["attention_mask"].bool()
    with torch.no_grad():
        a = plain(**inputs).logits.float()[mask]
        b = with_adapter(**inputs).logits.float()[mask]
    assert (a - b).abs().max() < 0.02 * b.abs().max()
    assert plain.dtype == torch.bfloat16


def test_fresh_start_never_replaces_trained_results_unless_asked(tmp_path):
    out = tmp_path / "run"
    torchrun(out, "training.steps=2", "training.eval_every=0")
    proc = torchrun(out, "training.steps=2", check=False)
    assert proc.returncode != 0
    assert "ConfigError: run.output_dir:" in proc.stderr and "run.overwrite=true" in proc.stderr
    assert (out / "adapter" / "adapter_model.safetensors").is_file()  # still there
    torchrun(out, "training.steps=3", "training.eval_every=0", "run.overwrite=true")
    assert read_run(out)[0]["steps"] == 3


def test_notebook_08_runs_under_papermill(tmp_path):
    from conftest import ROOT

    from kit import tour

    path = ROOT / "notebooks" / "08-checkpoints-resume-merge.ipynb"
    outcome = tour.run(path, tmp_path / "08.ipynb", {"steps": 12, "save_every": 3})
    assert outcome.ok, outcome.error
    import nbformat

    text = "".join(
        o.get("text", "") or str(o.get("data", {}).get("text/plain", ""))
        for c in nbformat.read(str(outcome.output), as_version=4).cells if c.cell_type == "code"
        for o in c.outputs
    )
    assert "adapter_model.safetensors holds 0 tensors, no error" in text  # the article's save
    assert "same steps: True, largest difference: 0" in text  # exact resume
    assert "['step-000009', 'step-000012']" in text  # retention
    assert "step-000006.tmp: incomplete" in text and "step-000003 at step 3" in text
    assert "merged vs adapter-on-base: max |logit diff| 0.0000" in text
