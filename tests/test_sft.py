"""kit.sft.trainer: TRL's SFTTrainer under `accelerate launch`, on the kit's model, LoRA, data and save.

One real launch (2 CPU processes): on CPU, accelerate cannot run FSDP, so what runs is what
accelerate really does there, multi-process CPU DDP over gloo (its state says MULTI_CPU). The
accelerate config that gets there says `distributed_type: MULTI_GPU`: accelerate's own
`MULTI_CPU` type goes through its simple launcher, which on one machine starts ONE process
without mpirun (measured with accelerate 1.15), and kit.sft.trainer refuses that start (`launched_alone`).
The rest are fast unit tests of the config mapping and the launch checks (no launch).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time

import pytest
import torch
from conftest import ROOT, TINY

from kit.config import ConfigError, load_config

pytest.importorskip("trl")

# On one machine without GPUs: accelerate launches through torchrun (MULTI_GPU's launcher) and,
# with SFTConfig(use_cpu=True), each process's accelerate state is MULTI_CPU over gloo.
CPU_DDP_YAML = """\
compute_environment: LOCAL_MACHINE
distributed_type: MULTI_GPU
num_machines: 1
num_processes: 2
machine_rank: 0
mixed_precision: 'no'
main_training_function: main
"""


@pytest.fixture
def fresh_accelerate_state():
    """SFTConfig creates accelerate's process-wide state in this process: forget it after."""
    env = dict(os.environ)
    yield
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(reset_partial_state=True)
    os.environ.clear()
    os.environ.update(env)


def _cfg(*overrides, out="/tmp/kit-sft-unit"):
    return load_config(TINY, [f"run.output_dir={out}", "sharding.engine=ddp", *overrides])


def test_sft_config_carries_the_kit_values(fresh_accelerate_state):
    from kit.sft import setup

    args = setup.sft_config(_cfg(
        "training.lr=3e-4", "training.batch_size=4", "training.grad_accum=2",
        "training.steps=12", "training.warmup_steps=3", "training.weight_decay=0.01",
        "training.max_grad_norm=0.5", "training.scheduler=linear", "training.log_every=2",
        "training.eval_every=3", "checkpointing.save_every=6", "checkpointing.keep_last=0",
        "data.max_seq_len=48", "data.packing=true", "data.text_field=body", "training.seed=7",
    ), use_cpu=True)
    assert (args.learning_rate, args.per_device_train_batch_size, args.per_device_eval_batch_size,
            args.gradient_accumulation_steps, args.max_steps, args.warmup_steps) == (
        3e-4, 4, 4, 2, 12, 3)
    assert (args.weight_decay, args.max_grad_norm, args.logging_steps) == (0.01, 0.5, 2)
    assert args.lr_scheduler_type.value == "linear"
    assert (args.eval_strategy.value, args.eval_steps) == ("steps", 3)
    assert (args.save_strategy.value, args.save_steps, args.save_total_limit) == ("steps", 6, None)
    assert (args.max_length, args.packing, args.dataset_text_field) == (48, True, "body")
    assert (args.seed, args.data_seed, args.bf16, args.fp16, args.use_cpu) == (7, 7, True, False, True)
    assert args.gradient_checkpointing is True
    assert args.gradient_checkpointing_kwargs == {"use_reentrant": False}
    assert args.report_to in ([], "none", ["none"])
    assert args.output_dir == "/tmp/kit-sft-unit/trainer"

    args = setup.sft_config(_cfg("training.scheduler=constant", "training.eval_every=0",
                               "model.dtype=float32", "training.recompute.enabled=false"), True)
    assert args.lr_scheduler_type.value == "constant_with_warmup"
    assert (args.eval_strategy.value, args.save_strategy.value) == ("no", "no")
    assert (args.bf16, args.fp16, args.gradient_checkpointing) == (False, False, False)

    # Under FSDP with fsdp_activation_checkpointing accelerate wraps every decoder layer itself,
    # and the Trainer refuses gradient_checkpointing beside it (ValueError, transformers 5.17).
    fsdp = {"ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "2"}
    cfg = _cfg("sharding.engine=fsdp2")
    assert setup.sft_config(cfg, True, {**fsdp, "FSDP_ACTIVATION_CHECKPOINTING": "true"}
                          ).gradient_checkpointing is False
    assert setup.sft_config(cfg, True, {**fsdp, "FSDP_ACTIVATION_CHECKPOINTING": "false"}
                          ).gradient_checkpointing is True


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without a bf16 GPU")
def test_a_value_sftconfig_refuses_is_one_line_naming_the_kit_field(fresh_accelerate_state):
    """bf16 on a device without bf16 (here: no GPU, use_cpu off; on GPUs a V100 or T4):
    transformers' error, traced back to model.dtype."""
    from kit.sft import setup

    with pytest.raises(ConfigError) as e:
        setup.sft_config(_cfg("model.dtype=bfloat16"), use_cpu=False)
    line = str(e.value)
    assert "\n" not in line
    assert line.startswith("model.dtype: 'bfloat16' is not allowed here; it makes "
                           "SFTConfig(bf16=True)"), line


@pytest.mark.parametrize("override, first", [
    ("training.recompute.keeps=matmuls", "training.recompute.keeps: 'matmuls' is not allowed"),
    ("training.recompute.every=2", "training.recompute.every: 2 is not allowed"),
    ("training.loss=fused", "training.loss: 'fused' is not allowed"),
    ("training.resume=auto", "training.resume: 'auto' is not allowed"),
    ("checkpointing.keep_best=true checkpointing.save_every=10",
     "checkpointing.keep_best: True is not allowed with kit.sft.trainer"),
])
def test_what_kit_sft_cannot_honour_is_refused_in_one_line(override, first):
    from kit.sft import setup

    with pytest.raises(ConfigError) as e:
        setup.sft_config(_cfg(*override.split()), use_cpu=True)  # refused before SFTConfig is built
    assert str(e.value).startswith(first) and "\n" not in str(e.value), str(e.value)


def test_the_launch_checks():
    from kit.sft import setup, trainer

    # accelerate's simple launcher (MULTI_CPU / --cpu) with 2 processes asked: one started
    alone = {"ACCELERATE_USE_CPU": "True", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}
    assert setup.launched_alone(alone).startswith("accelerate launch: started 1 process")
    with pytest.raises(ConfigError, match="^accelerate launch: started 1 process"):
        trainer.check_launch(_cfg(), alone, cuda=False)
    assert setup.launched_alone({**alone, "WORLD_SIZE": "2"}) is None  # torchrun started them
    fsdp = {"ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "2", "WORLD_SIZE": "2"}
    assert setup.accelerate_engine(fsdp) == "fsdp2"
    with pytest.raises(ConfigError, match="^sharding.engine: accelerate cannot run FSDP on CPU"):
        trainer.check_launch(_cfg("sharding.engine=fsdp2"), fsdp, cuda=False)
    with pytest.raises(ConfigError, match="^sharding.engine: 'fsdp2' is not allowed here; the "
                                          "accelerate config runs ddp"):
        trainer.check_launch(_cfg("sharding.engine=fsdp2"), {"WORLD_SIZE": "2"}, cuda=False)
    assert trainer.check_launch(_cfg(), {"WORLD_SIZE": "2"}, cuda=False) == torch.device("cpu")
    # accelerate's FSDP recomputes every layer (fsdp_activation_checkpointing) where the kit
    # config says no recompute: refused (checked as on a GPU; nothing touches one here)
    recomputes = {**fsdp, "FSDP_ACTIVATION_CHECKPOINTING": "true", "LOCAL_RANK": "0"}
    gpu = ["sharding.engine=fsdp2", "training.device=cuda"]
    with pytest.raises(ConfigError, match="^training.recompute.enabled: False is not allowed here; "
                                          "the accelerate config recomputes every decoder layer"):
        trainer.check_launch(_cfg(*gpu, "training.recompute.enabled=false"), recomputes, cuda=True)
    assert trainer.check_launch(_cfg(*gpu), recomputes, cuda=True) == torch.device("cuda", 0)
    # FSDP1 on one process (accelerate --num_processes 1): what kit.train and kit.run.jobs refuse
    # (pitfall fsdp1_no_shard); on one H100 it trained step 1, then the adapter's gather failed
    one = {"ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "1", "WORLD_SIZE": "1", "LOCAL_RANK": "0"}
    with pytest.raises(ConfigError, match="^sharding.engine: 'fsdp1' is not allowed; on 1 process"):
        trainer.check_launch(_cfg("sharding.engine=fsdp1", "training.device=cuda"), one, cuda=True)
    two = {**one, "WORLD_SIZE": "2"}
    assert trainer.check_launch(_cfg("sharding.engine=fsdp1", "training.device=cuda"), two,
                            cuda=True) == torch.device("cuda", 0)


def test_packed_rows_must_fill_a_batch_and_eval_keeps_eval_batches():
    """TRL packs the texts into fewer rows; the Trainer's loaders drop an incomplete batch, so
    an evaluation on fewer packed rows than a batch reported no loss, silently."""
    from types import SimpleNamespace

    from datasets import Dataset

    from kit.sft import trainer as sft

    rows = lambda n: Dataset.from_dict({"input_ids": [[1, 2]] * n})  # noqa: E731
    cfg = _cfg("data.packing=true", "training.batch_size=4", "training.eval_batches=2")
    trainer = SimpleNamespace(train_dataset=rows(12), eval_dataset=rows(11))
    sft.fit_packed(trainer, cfg, world=1)
    assert len(trainer.eval_dataset) == 8  # eval_batches x batch_size x world, as kit.train
    with pytest.raises(ConfigError, match=r"^training.batch_size: 4 is not allowed; 3 packed "
                                          r"validation rows \(data.packing, data.max_seq_len="):
        sft.fit_packed(SimpleNamespace(train_dataset=rows(12), eval_dataset=rows(3)), cfg, 1)
    with pytest.raises(ConfigError, match="^training.batch_size: 4 is not allowed; 7 packed training"):
        sft.fit_packed(SimpleNamespace(train_dataset=rows(7), eval_dataset=rows(8)), cfg, 2)
    unpacked = SimpleNamespace(train_dataset=rows(1), eval_dataset=rows(1))
    sft.fit_packed(unpacked, _cfg("training.batch_size=4"), 1)  # rows checked before (texts)
    assert len(unpacked.eval_dataset) == 1


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_sft_trainer_under_accelerate_launch_cpu_ddp_two_processes_saves_a_whole_adapter(tmp_path):
    from peft import PeftModel
    from safetensors.torch import load_file

    from kit.folder import jsonl
    from kit.recipe import checkpoint, model, quantize, verify

    config = tmp_path / "accelerate.yaml"
    config.write_text(CPU_DDP_YAML)
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "accelerate.commands.accelerate_cli", "launch",
           "--config_file", str(config), "--num_processes", "2",
           "--main_process_port", str(_free_port()), "-m", "kit.sft.trainer", str(TINY),
           f"run.output_dir={out}", "sharding.engine=ddp", "training.steps=4",
           "training.eval_every=2", "model.loading=rank0"]  # rank 1 receives the model
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TOKENIZERS_PARALLELISM": "false"}
    started = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    log = (proc.stdout + proc.stderr)[-6000:]
    assert proc.returncode == 0, log
    print(f"accelerate launch: {time.perf_counter() - started:.1f} s")

    result = json.loads((out / "result.json").read_text())
    assert (result["status"], result["steps"], result["world_size"]) == ("completed", 4, 2), result
    assert (result["distributed_type"], result["engine"]) == ("MULTI_CPU", "ddp"), result
    assert result["loading"] == "rank0", result
    assert len(set(result["lora_checksums"])) == 1, result  # both ranks hold the same adapter
    rows = jsonl.read(out / "metrics.jsonl")
    train = [r for r in rows if r["split"] == "train"]
    assert [r["step"] for r in train] == [1, 2, 3, 4], rows
    assert all(torch.isfinite(torch.tensor(r["loss"])) for r in train), rows
    assert [r["step"] for r in rows if r["split"] == "val"] == [2, 4], rows
    assert result["final_loss"] == train[-1]["loss"]

    # Whole: the file's shapes are the unsharded LoRA shapes of the model as the kit builds it.
    adapter = out / "adapter"
    cfg = load_config(out / "config.yaml")
    assert cfg.model.loading == "rank0"  # kit.recipe.loading under accelerate's process group
    unsharded = checkpoint.AdapterLayout(model.build(cfg, torch.device("cpu"), train=False).model)
    assert verify.saved_shapes(adapter) == unsharded.shapes
    verify.verify_adapter(adapter, unsharded.shapes)  # reads every tensor back
    tensors = load_file(str(adapter / "adapter_model.safetensors"))
    assert any(t.abs().max() > 0 for k, t in tensors.items() if "lora_B" in k)  # B starts at 0

    # Plain PEFT loads it onto the base the kit builds (kit.inputs.builtin.resolve through kit.recipe.quantize),
    # and it changes the logits on a fixed input.
    base, _ = quantize.load_model(cfg, torch.device("cpu"))
    ids = torch.arange(3, 19).reshape(1, 16)
    with torch.no_grad():
        before = base(input_ids=ids).logits.float()
        peft_model = PeftModel.from_pretrained(base, str(adapter)).eval()
        after = peft_model(input_ids=ids).logits.float()
    for name, module in peft_model.named_modules():
        if hasattr(module, "lora_A") and "default" in module.lora_A:
            base_layer = module.get_base_layer()
            assert tuple(module.lora_A["default"].weight.shape) == (8, base_layer.in_features), name
            assert tuple(module.lora_B["default"].weight.shape) == (base_layer.out_features, 8), name
    assert (after - before).abs().max().item() > 1e-4
