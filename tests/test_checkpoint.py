"""Checkpoints: exact resume, interrupted or damaged saves, retention, merge, empty files, the
manifest and the command line. Tests marked slow launch the recipe on 2 CPU processes; the others
build checkpoint folders by hand.

(The adapter round trip for every engine is in test_train.py.)"""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch
from conftest import ROOT, read_run, torchrun

from kit.config import Config
from kit.folder import manifest
from kit.inference import merge
from kit.recipe import checkpoint, trainer_state, verify

FP32 = ["model.dtype=float32", "quantization.method=none"]  # exact arithmetic on CPU
ONE = SimpleNamespace(rank=0, world_size=1, device=torch.device("cpu"))  # a process of one


def losses(out) -> list[tuple[str, int, float]]:
    return [(m["split"], m["step"], m["loss"]) for m in read_run(out)[1]]


def sha_tree(root) -> dict[str, str]:
    """Relative path -> sha256 of every file under `root`."""
    return {p.relative_to(root).as_posix(): manifest.sha256(p)
            for p in sorted(root.rglob("*")) if p.is_file()}


# Resume over a damaged newest checkpoint (named, kept in earlier/, the previous one resumed,
# bit-exact against the run that never stopped, every earlier file byte-identical): notebook 08's
# section 3, asserted in test_notebook_08_runs_under_papermill (not run twice).
# Killed in the middle of a save (KIT_FAIL_SAVE_STEP): the launcher names the step-N.tmp, keeps
# it in earlier/ and resumes from the previous checkpoint: notebook 08's section 4, asserted in
# test_notebook_08_runs_under_papermill (not run twice).


@pytest.mark.slow
def test_resume_nf4_bf16_fsdp1_full_format(tmp_path):
    """The run that never stopped wrote its step-10 checkpoint on its way to step 14 (what a run
    stopped at step 10 writes, as notebook 08's stop-and-resume=auto shows for FSDP2): a second
    run resumed from it (training.resume=PATH) repeats steps 11-14. Two launches, not three."""
    engine, fmt = "fsdp1", "full"
    args = [f"sharding.engine={engine}", f"checkpointing.format={fmt}", "checkpointing.save_every=10",
            "training.steps=14", "training.eval_every=0"]
    straight, resumed = tmp_path / "a", tmp_path / "b"
    torchrun(straight, *args)
    step10 = straight / "checkpoints" / "step-000010"
    run = torchrun(resumed, *args, f"training.resume={step10}")
    assert f"resumed from {step10} at step 10" in run.stdout
    a, b = [x for x in losses(straight) if x[1] > 10], losses(resumed)
    assert [x[:2] for x in a] == [x[:2] for x in b] == [*(("train", s) for s in range(11, 15)),
                                                         ("val", 14)]  # fmt: skip
    assert max(abs(x[2] - y[2]) for x, y in zip(a, b, strict=True)) < 1e-3  # bf16: within tolerance
    marker = json.loads((step10 / manifest.MARKER).read_text())
    assert marker["format"] == fmt and marker["bytes"] > 0
    assert {"full.json", "full.safetensors", "trainer.json"} <= set(marker["files"])
    assert marker["config"]["sharding.engine"] == engine


@pytest.mark.slow
def test_keep_best_keeps_the_lowest_held_out_loss_checkpoint_that_keep_last_prunes(tmp_path):
    """A run whose held-out loss is lowest at its first evaluation (it trains on one sentence and
    is evaluated on digits, tokens it learns to expect less): keep_last=1 alone would keep step
    8's checkpoint only; keep_best keeps step 2's too, says so in a `best:` line, names it in
    result.json, and `kit checkpoints list` marks it. Rank 0's progress: one line per logged
    step (log_every=2). fp32: the same losses on every CPU."""
    train, val = tmp_path / "train.jsonl", tmp_path / "val.jsonl"
    train.write_text("".join(json.dumps({"text": "the cat sat on the mat " * 4}) + "\n"
                             for _ in range(64)))
    val.write_text("".join(json.dumps({"text": " ".join(str((i * 7 + k) % 10) for k in range(24))})
                           + "\n" for i in range(32)))
    out = tmp_path / "run"
    run = torchrun(out, *FP32, "training.steps=8", "training.eval_every=2", "training.log_every=2",
                   "checkpointing.save_every=2", "checkpointing.keep_last=1",
                   "checkpointing.keep_best=true", f"data.path={train}", f"data.val_path={val}")
    result, metrics = read_run(out)
    val_losses = [m["loss"] for m in metrics if m["split"] == "val"]
    assert len(val_losses) == 4 and val_losses[0] < min(val_losses[1:]), val_losses
    step2 = out / "checkpoints" / "step-000002"
    assert result["best"] == {"step": 2, "val_loss": val_losses[0], "path": str(step2)}
    assert [f.name for _, f in manifest.scan(out)[0]] == ["step-000002", "step-000008"]
    assert [line for line in run.stdout.splitlines() if ":best: " in line] == [
        f"[default0]:best: step 2, held-out loss {val_losses[0]:.4f}: {step2} (the lowest so far: "
        "checkpointing.keep_best keeps it)"]
    assert [r["folder"] for r in manifest.summary(out) if r.get("best")] == ["step-000002"]
    assert [line.split(" (")[0] for line in run.stdout.splitlines() if "train: step" in line] == [
        f"[default0]:train: step {k}/8" for k in (2, 4, 6, 8)]


# --------------------------------------------------------------------------- the manifest, by hand

CONFIG = Config().to_dict()  # lora.r=8, what the hand-made checkpoints below were "made with"
LORA_KEY = "base_model.model.layer.lora_A.weight"


def changed(**fields) -> dict:
    """CONFIG with e.g. lora__r=16 set (section__field)."""
    tree = copy.deepcopy(CONFIG)
    for name, value in fields.items():
        section, key = name.split("__")
        tree[section][key] = value
    return tree


def save_adapter_file(folder, tensors) -> None:
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    (folder / "adapter_config.json").write_text(json.dumps({"r": 8}))
    save_file(tensors, str(folder / "adapter_model.safetensors"))


def fake_checkpoint(out, step: int, world_size: int = 2, val_loss: float | None = None):
    """checkpoints/step-N with a 4,096-byte 'shard', a trainer file and a real adapter, manifest
    written by kit.folder.manifest as save_training_state writes it (with the step's held-out
    loss when given)."""
    folder = out / "checkpoints" / f"step-{step:06d}"
    (folder / "dcp").mkdir(parents=True)
    (folder / "dcp" / "__0_0.distcp").write_bytes(bytes(range(256)) * 16)
    (folder / "trainer.json").write_bytes(b"trainer state " * 8)
    save_adapter_file(folder / "adapter", {LORA_KEY: torch.ones(8, 16)})
    manifest.write(folder, CONFIG, step, world_size, {"format": "sharded", "seconds": 0.1, **(
        {} if val_loss is None else {"val_loss": val_loss})})
    return folder


def test_manifest_records_files_checksums_and_the_config_that_made_it(tmp_path):
    folder = fake_checkpoint(tmp_path, 5)
    saved = json.loads((folder / manifest.MARKER).read_text())
    assert saved["step"] == 5 and saved["world_size"] == 2 and saved["format"] == "sharded"
    assert sorted(saved["files"]) == ["adapter/adapter_config.json",
                                      "adapter/adapter_model.safetensors", "dcp/__0_0.distcp",
                                      "trainer.json"]
    assert saved["files"]["dcp/__0_0.distcp"] == {
        "bytes": 4096, "sha256": manifest.sha256(folder / "dcp" / "__0_0.distcp")}
    assert saved["config"]["lora.r"] == 8 and saved["config"]["quantization.method"] == "nf4"
    assert saved["config"]["data.max_seq_len"] == CONFIG["data"]["max_seq_len"]
    assert "training.steps" not in saved["config"]  # more steps may continue a run
    assert manifest.problem(folder, CONFIG, 2) is None
    assert manifest.problem(folder, changed(training__steps=999), 2) is None
    assert manifest.problem(folder) is None  # files only
    assert verify.verify_checkpoint(folder, CONFIG)["adapter_tensors"] == 1
    assert manifest.summary(tmp_path) == [{
        "folder": "step-000005", "step": 5, "world_size": 2, "bytes": saved["bytes"],
        "format": "sharded", "seconds": 0.1, "complete": True, "files": 4}]


def damage(folder, how: str) -> None:
    shard = folder / "dcp" / "__0_0.distcp"
    if how == "truncated":
        os.truncate(shard, 1024)
    elif how == "changed byte":
        data = bytearray(shard.read_bytes())
        data[100] ^= 1
        shard.write_bytes(bytes(data))
    elif how == "missing file":
        (folder / "trainer.json").unlink()
    elif how == "old kit, no manifest":
        (folder / manifest.MARKER).write_text(json.dumps({"step": 5, "format": "sharded",
                                                          "world_size": 2, "bytes": 1}))
    elif how == "damaged manifest":
        (folder / manifest.MARKER).write_text('{"step": 5, "fi')
    elif how == "no marker":
        (folder / manifest.MARKER).unlink()


@pytest.mark.parametrize("how, config, world_size, expected", [
    ("truncated", None, None,
     "{f}: dcp/__0_0.distcp is 1,024 bytes, the manifest says 4,096 (truncated)"),
    ("changed byte", None, None, "{f}: dcp/__0_0.distcp has sha256 "),
    ("missing file", None, None, "{f}: trainer.json is missing (the manifest lists it)"),
    ("", changed(lora__r=16), 2, "{f}: made with lora.r=8, this run has lora.r=16"),
    ("", changed(lora__r=16, model__name="kit:tiny-qwen2"), 2,
     "{f}: made with model.name=kit:tiny-llama, this run has model.name=kit:tiny-qwen2 "
     "(also differs: lora.r)"),
    ("old kit, no manifest", None, None, "{f}: COMPLETE.json holds no manifest (saved by an older "
                                         "kit): its files cannot be verified, so it is never resumed"),
    ("damaged manifest", None, None, "{f}: COMPLETE.json is not readable JSON (damaged)"),
    ("no marker", None, None, "{f}: not a complete checkpoint (no COMPLETE.json"),
], ids=lambda x: x if isinstance(x, str) and len(x) < 24 else None)
def test_a_checkpoint_problem_is_one_line_naming_the_file_or_field(
        tmp_path, how, config, world_size, expected):
    folder = fake_checkpoint(tmp_path, 5)
    damage(folder, how)
    found = manifest.problem(folder, config, world_size)
    assert found is not None and found.startswith(expected.format(f=folder)), found
    assert "\n" not in found
    if how == "changed byte":
        assert found.endswith("(changed after it was saved)")
    with pytest.raises(checkpoint.CheckpointError) as raised:  # an explicit path must be valid
        checkpoint.find_resume(str(folder), tmp_path, config, world_size)
    assert str(raised.value) == f"training.resume: {found}"
    assert len(manifest.summary(tmp_path)) == 1  # listed, whatever the damage


def test_resume_path_must_be_a_complete_checkpoint(tmp_path):
    with pytest.raises(checkpoint.CheckpointError,
                       match="training.resume: .*: not a complete checkpoint \\(no COMPLETE.json"):
        checkpoint.find_resume(str(tmp_path), tmp_path)


def test_newest_valid_falls_back_past_damaged_and_interrupted_checkpoints(tmp_path):
    five, ten = fake_checkpoint(tmp_path, 5), fake_checkpoint(tmp_path, 10)
    (tmp_path / "checkpoints" / "step-000015.tmp").mkdir()  # a save killed midway
    damage(ten, "truncated")
    notes = [f"skipping {ten.parent / 'step-000015.tmp'}: incomplete (interrupted while saving); "
             "using step-000005",
             f"skipping {ten}: dcp/__0_0.distcp is 1,024 bytes, the manifest says 4,096 "
             "(truncated); using step-000005"]
    assert manifest.newest_valid(tmp_path, CONFIG, 2) == (five, 5, notes)
    assert checkpoint.find_resume("auto", tmp_path) == (five, notes)  # train.py's call today
    assert checkpoint.find_resume("auto", tmp_path, Config(), 2) == (five, notes)
    # Made with another LoRA shape: none is valid; the caller decides what to do.
    folder, notes = checkpoint.find_resume("auto", tmp_path, changed(lora__r=16), 2)
    assert folder is None and len(notes) == 3
    assert notes[-1] == (f"skipping {five}: made with lora.r=8, this run has lora.r=16; "
                         "no valid checkpoint left to resume from")


def test_load_names_the_file_it_cannot_read(tmp_path):
    """The last line of defence, behind the manifest: a real (1-process) DCP checkpoint whose
    shard or trainer file cannot be read gives one line naming the file, not a traceback."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    model = torch.nn.Linear(4, 4)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.ones(1, 4)).sum().backward()
    optimizer.step()
    options = StateDictOptions(ignore_frozen_params=True, strict=False)
    folder = tmp_path / "step-000001"
    dcp.save({"model": get_model_state_dict(model, options=options),
              "optim": get_optimizer_state_dict(model, optimizer, options=options)},
             checkpoint_id=str(folder / "dcp"))
    trainer_state.write(folder, "trainer", {"step": 1, "format": "sharded", "world_size": 1})
    shard = folder / "dcp" / "__0_0.distcp"
    size, saved = shard.stat().st_size, shard.read_bytes()

    def load():
        checkpoint.load_training_state(folder, wrapped=model, optimizer=optimizer,
                                       scheduler=None, batches=None, env=ONE)

    os.truncate(shard, size // 2)
    with pytest.raises(checkpoint.CheckpointError) as raised:  # no manifest: the folder
        load()
    assert str(raised.value) == f"{folder / 'dcp'}: cannot be loaded (EOFError)"
    shard.write_bytes(saved)
    manifest.write(folder, None, 1, 1)
    os.truncate(shard, size // 2)
    with pytest.raises(checkpoint.CheckpointError) as raised:  # the manifest names the shard
        load()
    assert str(raised.value) == (f"{folder}: dcp/__0_0.distcp is {size // 2:,} bytes, the "
                                 f"manifest says {size:,} (truncated)")
    os.truncate(folder / "trainer.json", 20)
    with pytest.raises(checkpoint.CheckpointError) as raised:
        load()
    assert str(raised.value).startswith(f"{folder / 'trainer.json'}: not a JSON file the kit "
                                        "wrote (JSONDecodeError: ")
    # Another shape (as another LoRA r would give): one line, not one per tensor.
    full = tmp_path / "full"
    full.mkdir()
    options = StateDictOptions(full_state_dict=True, ignore_frozen_params=True, strict=False)
    trainer_state.write(full, "full", {
        "model": get_model_state_dict(model, options=options),
        "optim": get_optimizer_state_dict(model, optimizer, options=options)})
    trainer_state.write(full, "trainer", {"step": 1, "format": "full", "world_size": 1})
    wider = torch.nn.Linear(4, 8)
    with pytest.raises(checkpoint.CheckpointError) as raised:
        checkpoint.load_training_state(full, wrapped=wider, optimizer=torch.optim.AdamW(
            wider.parameters()), scheduler=None, batches=None, env=ONE)
    assert str(raised.value).startswith(f"{full}: its weights do not fit this model")
    assert "size mismatch for weight" in str(raised.value) and "\n" not in str(raised.value)


# --------------------------------------------------------------------------- the command line


def cli(*args) -> subprocess.Popen:
    """Start `kit checkpoints ARGS` (several run side by side: each imports torch)."""
    return subprocess.Popen([sys.executable, "-m", "kit", "checkpoints", *map(str, args)], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_command_line_failures_are_one_line_naming_the_path_exit_2(tmp_path, capsys):
    """kit checkpoints, for real: a missing run, a run with no adapter, a truncated
    adapter file, an empty adapter, a damaged checkpoint, a merge into a folder that exists."""
    run = tmp_path / "run"  # a run folder whose run saved no adapter
    run.mkdir()
    (run / "config.yaml").write_text(Config().to_yaml())
    cut = tmp_path / "cut"
    save_adapter_file(cut, {LORA_KEY: torch.ones(64, 64)})
    weights = cut / "adapter_model.safetensors"
    os.truncate(weights, weights.stat().st_size // 2)
    empty = tmp_path / "empty"
    save_adapter_file(empty, {})
    damaged = fake_checkpoint(tmp_path / "ckrun", 5)
    damage(damaged, "truncated")
    out = tmp_path / "merged"
    (out / "mine.txt").parent.mkdir()
    (out / "mine.txt").write_text("a user's file")
    cases = [  # the first four as a person types them (a process each), the rest in-process
        (("list", tmp_path / "nope"), f"list: run: '{tmp_path / 'nope'}' does not exist"),
        (("merge", run, tmp_path / "new"), f"merge: {run / 'adapter' / 'adapter_model.safetensors'}"
                                           ": does not exist (no adapter saved there)"),
        (("verify", cut), f"verify: {weights}: cannot be read (SafetensorError: "),
        (("merge", run, out), f"merge: out: '{out}' exists; choose a new folder"),
        (("verify", run), f"verify: {run / 'adapter' / 'adapter_model.safetensors'}: does not exist"),
        (("verify", empty), f"verify: {empty / 'adapter_model.safetensors'}: holds 0 tensors"),
        (("verify", damaged), f"verify: {damaged}: dcp/__0_0.distcp is 1,024 bytes, the manifest"),
    ]
    procs = [cli(*args) for args, _ in cases[:4]]
    for i, (args, expected) in enumerate(cases):
        if i < 4:
            stdout, stderr = procs[i].communicate(timeout=120)
            code = procs[i].returncode
        else:
            code = merge.main([str(a) for a in args])
            stdout, stderr = capsys.readouterr()
        assert code == 2, (args, stderr[-2000:])
        assert stderr.startswith(f"kit checkpoints {expected}"), stderr[-2000:]
        assert stderr.count("\n") == 1 and stdout == "", stderr
    assert (out / "mine.txt").read_text() == "a user's file" and not (tmp_path / "new").exists()
    with pytest.raises(checkpoint.CheckpointError, match="out: '.*' exists; choose a new folder"):
        merge.merge_adapter(run, out)  # refused before anything is loaded
    assert (out / "mine.txt").read_text() == "a user's file"
    assert merge.fresh_folder(out) == tmp_path / "merged-2"


def test_command_line_verifies_and_lists_a_good_checkpoint(tmp_path, capsys):
    fake_checkpoint(tmp_path, 5)
    (tmp_path / "checkpoints" / "step-000010.tmp").mkdir()
    assert merge.main(["verify", str(tmp_path / "checkpoints" / "step-000005")]) == 0
    assert "'adapter_tensors': 1" in capsys.readouterr().out
    assert merge.main(["list", str(tmp_path)]) == 0
    listed = capsys.readouterr().out.splitlines()
    assert "'folder': 'step-000005'" in listed[0] and "'files': 4" in listed[0]
    assert listed[1] == "step-000010.tmp: INCOMPLETE (never resumed)"


def test_keep_best_spares_the_lowest_held_out_loss_from_keep_last(tmp_path, capsys):
    """prune on hand-made checkpoints whose manifests record their step's held-out loss:
    keep_last=1 keeps the newest alone; with keep_best also the lowest loss's (of equal ones the
    earliest; one saved at a step with no evaluation is never it), which `kit checkpoints list`
    marks best. kit.train's run of it: tests/test_train.py."""
    import shutil

    for step, loss in ((2, 6.5), (4, 6.1), (6, 6.3), (8, None), (10, 6.1)):
        fake_checkpoint(tmp_path / "a", step, val_loss=loss)
    shutil.copytree(tmp_path / "a", tmp_path / "b")
    names = lambda run: [f.name for _, f in manifest.scan(run)[0]]  # noqa: E731
    assert manifest.best(tmp_path / "a") == {
        "step": 4, "val_loss": 6.1, "path": str(tmp_path / "a" / "checkpoints" / "step-000004")}
    checkpoint.prune(tmp_path / "a", keep_last=1, keep_best=True)
    assert names(tmp_path / "a") == ["step-000004", "step-000010"]
    checkpoint.prune(tmp_path / "b", keep_last=1)
    assert names(tmp_path / "b") == ["step-000010"]
    assert merge.main(["list", str(tmp_path / "a")]) == 0
    listed = capsys.readouterr().out.splitlines()
    assert "'val_loss': 6.1" in listed[0] and listed[0].endswith("'best': True}"), listed
    assert "'best'" not in listed[1]
    assert manifest.best(tmp_path / "nothing") is None


def test_verify_rejects_empty_and_wrong_adapters(tmp_path):
    from safetensors.torch import save_file

    (tmp_path / "adapter_config.json").write_text(json.dumps({"r": 8}))
    save_file({}, str(tmp_path / "adapter_model.safetensors"))
    expected = {"base_model.model.layer.lora_A.weight": (8, 16)}
    with pytest.raises(checkpoint.CheckpointError, match="1 of 1 LoRA tensors missing \\(holds 0\\)"):
        verify.verify_adapter(tmp_path, expected)
    save_file({"base_model.model.layer.lora_A.weight": torch.zeros(4, 16)}, str(tmp_path / "adapter_model.safetensors"))
    with pytest.raises(checkpoint.CheckpointError, match="has shape \\(4, 16\\), expected \\(8, 16\\)"):
        verify.verify_adapter(tmp_path, expected)


@pytest.mark.slow
def test_merged_export_matches_adapter_on_base(tiny_run, tmp_path):
    from transformers import AutoModelForCausalLM

    out = tiny_run  # the session's shared NF4 run (conftest): read, not changed
    merged = merge.merge_adapter(out, tmp_path / "merged")
    assert "quantization_config" not in json.loads((merged / "config.json").read_text())
    # The merged folder and the run's adapter have the modes any file of the user's gets, not
    # safetensors' 0600 and mkdtemp's 0700 (shareable with the user's group, as the rest).
    mask = os.umask(0)
    os.umask(mask)
    for path in (merged, *merged.iterdir(), out / "adapter", *(out / "adapter").iterdir()):
        assert path.stat().st_mode & 0o777 == (0o777 if path.is_dir() else 0o666) & ~mask, path
    plain = AutoModelForCausalLM.from_pretrained(merged).eval()  # no PEFT, no bitsandbytes
    with_adapter, _ = merge.load_for_inference(out)
    probe = torch.load(out / "probe.pt")
    inputs = {k: probe[k] for k in ("input_ids", "attention_mask")}
    mask = inputs["attention_mask"].bool()
    with torch.no_grad():
        a = plain(**inputs).logits.float()[mask]
        b = with_adapter(**inputs).logits.float()[mask]
        with with_adapter.disable_adapter():
            base = with_adapter(**inputs).logits.float()[mask]
    tolerance = 0.02 * b.abs().max()
    assert (a - b).abs().max() < tolerance
    # The adapter moves the logits far past that tolerance (4 steps: ~1.15 of ~1.31), so an
    # export that lost it would fail here.
    assert (base - b).abs().max() > 10 * tolerance
    assert plain.dtype == torch.bfloat16


@pytest.mark.slow
def test_notebook_08_runs_under_papermill(tmp_path):
    import re

    from conftest import ROOT

    from kit.run import tour

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
    # The article's load (claim A26): each rank fails its own way; the kit's way loads exactly.
    assert "rank 1: TypeError: Expected state_dict to be dict-like, got <class 'NoneType'>" in text
    assert "rank 0: FileNotFoundError: " in text and "adapter_model.bin'" in text
    assert "with the fix: every rank holds the 28 trained adapter tensors, equal" in text
    assert "28 keys in the file: 28 unexpected, 49 of the model's 49 missing" in text
    assert "same steps: True, largest difference: 0" in text  # exact resume
    assert "['step-000009', 'step-000012']" in text  # retention
    assert "step-000006.tmp: incomplete" in text and "step-000003 at step 3" in text
    # The merge's default is a QLoRA run: the killed-and-resumed run trained on an NF4 base, which
    # load_for_inference rebuilds 4-bit and merge_adapter dequantizes before folding the adapter in.
    assert "run: quantization nf4, model.dtype bfloat16; the base as loaded for inference: " \
        "Linear4bit" in text  # fmt: skip
    merged = re.search(r"merged vs adapter-on-base: max \|logit diff\| ([\d.]+) of ([\d.]+) "
                       r"\(one torch.bfloat16 step there: ([\d.]+)\)", text)  # fmt: skip
    diff, top, step = map(float, merged.groups())
    assert diff <= step and step <= top / 64  # within one bf16 step (8 bits of mantissa)
    # PEFT's merge onto the 4-bit layers quantizes the sum again: still 4-bit, further off.
    requantized = re.search(r"still 4-bit: Linear4bit; the adapter moves the logits by up to "
                            r"([\d.]+)\nmax \|logit diff\| from adapter-on-base: merge_and_unload "
                            r"onto 4-bit ([\d.]+), merge_adapter ([\d.]+)", text)  # fmt: skip
    moved, onto_4bit, ours = map(float, requantized.groups())
    assert ours == diff and onto_4bit > ours and moved > 10 * onto_4bit
    # Greedy generation: the adapter changes what the base says; the merged model says the same.
    said = dict(re.findall(r"^(base|adapter|merged): +(.*)$", text, re.MULTILINE))
    assert said["merged"] == said["adapter"] != said["base"], said
    # A damaged newest checkpoint: named, kept aside, the previous one resumed (still exact).
    assert "(truncated); using step-000003" in text
    assert "checkpoints: ['step-000006']" in text  # kept in earlier/, not deleted
    # Section 7: a SIGTERM to run.sh saves the step; the restart on half the processes resumes.
    assert "preempted, run.sh exit code 75, every process gone" in text
    assert "a restart of this run (SLURM_RESTART_COUNT=1): training.resume=auto" in text
    assert "was written by 2 ranks, this run has 1: the adapter and optimizer state are " \
        "resharded" in text  # fmt: skip
    assert "rows: True" in text  # the samples seen, counted
    assert "moved: adapter, result.json, probe.pt, metrics.jsonl, checkpoints/step-000006" in text
    # Every file from before the resume: byte-identical at its path or in earlier/, but for the
    # checkpoint retention pruned (keep_last=2) and the start's own run.sh/pid/exit_code.
    assert "pruned by keep_last: ['step-000003']" in text
    assert "anything else changed or lost: []" in text
    # A start over a finished run: refused, or said finished; nothing started.
    assert "nb08-straight' holds an earlier run (adapter, result.json)" in text
    assert "finished at step 12 of 12; nothing to do" in text and "completed 12" in text
