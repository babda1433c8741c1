"""What the SFTTrainer path (kit.sft.trainer) is given: the SFTConfig built from a kit config, and what
`accelerate launch` started (its engine, its recompute, a start of one process where several
were asked for). Split from kit/sft/trainer.py, which runs the trainer. Rank side.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import re

from kit.budget import plan as kplan
from kit.config import Config, ConfigError
from kit.folder.layout import RunFolder

SCHEDULERS = {"cosine": "cosine", "linear": "linear", "constant": "constant_with_warmup"}


def _refuse_unmapped(cfg: Config) -> None:
    """Kit fields whose value this path cannot honour: one line naming the field."""
    t, rc = cfg.training, cfg.training.recompute
    rules = [  # (holds, field, value, why)
        (t.resume == "", "training.resume", t.resume, "kit.sft.trainer starts fresh runs (kit.train "
         "resumes exactly from its own checkpoints); allowed: ''"),
        (t.stop_at_step == 0, "training.stop_at_step", t.stop_at_step, "allowed: 0"),
        (t.loss == "hf", "training.loss", t.loss, "SFTTrainer computes its own loss (TRL's "
         "fused LM head, no full logits); allowed: 'hf'"),
        (not t.compile, "training.compile", t.compile, "kit.sft.trainer does not compile (kit.train "
         "compiles each decoder layer after sharding); allowed: false"),
        (not cfg.checkpointing.keep_best, "checkpointing.keep_best", True, "kit.sft.trainer "
         "prunes checkpoints by age only (kit.train keeps the lowest held-out loss's); allowed: "
         "false"),
        (rc.keeps == "inputs" and rc.every == 1, "training.recompute.keeps" if rc.keeps !=
         "inputs" else "training.recompute.every", rc.keeps if rc.keeps != "inputs" else
         rc.every, "SFTTrainer's gradient checkpointing recomputes every whole decoder layer; "
         "allowed: keeps=inputs, every=1 (kit.train has the selective policies)"),
    ]
    for holds, name, value, why in rules:
        if not holds:
            raise ConfigError(f"{name}: {value!r} is not allowed with kit.sft.trainer; {why}")


def sft_config(cfg: Config, use_cpu: bool, environ=None):
    """trl.SFTConfig from the kit config. A value SFTConfig refuses is one ConfigError line
    naming the kit field it came from. environ: the launch's (accelerate's variables)."""
    from trl import SFTConfig

    cfg = kplan.plain(cfg)  # this path plans nothing: auto takes the recipe's plain values
    _refuse_unmapped(cfg)
    t, d, c = cfg.training, cfg.data, cfg.checkpointing
    names = {f.name for f in dataclasses.fields(SFTConfig)}
    recompute = next(n for n in ("activation_checkpointing", "gradient_checkpointing") if n in names)
    fields = {  # SFTConfig key: (value, kit field)
        "output_dir": (str(RunFolder(cfg.output_dir).trainer), "run.output_dir"),
        "max_steps": (t.steps, "training.steps"),
        "per_device_train_batch_size": (t.batch_size, "training.batch_size"),
        "per_device_eval_batch_size": (t.batch_size, "training.batch_size"),
        "gradient_accumulation_steps": (t.grad_accum, "training.grad_accum"),
        "learning_rate": (t.lr, "training.lr"),
        "lr_scheduler_type": (SCHEDULERS[t.scheduler], "training.scheduler"),
        "warmup_steps": (t.warmup_steps, "training.warmup_steps"),
        "weight_decay": (t.weight_decay, "training.weight_decay"),
        "max_grad_norm": (t.max_grad_norm, "training.max_grad_norm"),
        "bf16": (cfg.model.dtype == "bfloat16", "model.dtype"),
        "fp16": (cfg.model.dtype == "float16", "model.dtype"),
        "logging_steps": (t.log_every, "training.log_every"),
        "eval_strategy": ("steps" if t.eval_every else "no", "training.eval_every"),
        "eval_steps": (t.eval_every or None, "training.eval_every"),
        "save_strategy": ("steps" if c.save_every else "no", "checkpointing.save_every"),
        "save_steps": (c.save_every or 500, "checkpointing.save_every"),
        "save_total_limit": (c.keep_last or None, "checkpointing.keep_last"),
        "seed": (t.seed, "training.seed"),
        "data_seed": (t.seed, "training.seed"),
        # auto: set by kit.sft.trainer once the tokenizer has read the data.
        "max_length": (d.max_seq_len if d.max_seq_len != "auto" else None, "data.max_seq_len"),
        "packing": (d.packing, "data.packing"),
        "dataset_text_field": (d.text_field, "data.text_field"),
        # transformers 5.23 renamed these activation_checkpointing*; 5.17 has only the old names.
        # Under FSDP with fsdp_activation_checkpointing (kit.run.jobs writes it from the same field)
        # accelerate wraps every decoder layer itself, and the Trainer refuses both at once.
        recompute: (t.recompute.enabled and not fsdp_recomputes(
            os.environ if environ is None else environ), "training.recompute.enabled"),
        f"{recompute}_kwargs": ({"use_reentrant": False}, "training.recompute.enabled"),
        "use_cpu": (use_cpu, "training.device"),
    }
    fixed = dict(report_to="none", optim="adamw_torch",  # the kit's optimizer: torch AdamW
                 dataloader_drop_last=True, ddp_find_unused_parameters=False)
    try:
        return SFTConfig(**{k: v for k, (v, _) in fields.items()}, **fixed)
    except (ValueError, TypeError) as e:
        said = str(e).splitlines()[0] if str(e) else type(e).__name__
        # The SFTConfig key the message names first (as a whole word) is the culprit.
        at = {k: m.start() for k in fields
              if (m := re.search(rf"(?<![\w]){k}(?![\w])", said))}
        if not at:
            raise ConfigError(f"kit.sft.trainer: SFTConfig refuses this config ({said})") from None
        key = min(at, key=at.get)
        value, field = fields[key]
        kit_value = functools.reduce(getattr, field.split("."), cfg)
        raise ConfigError(f"{field}: {kit_value!r} is not allowed here; it makes "
                          f"SFTConfig({key}={value!r}), which refuses it: {said}") from None


def launched_alone(environ) -> str | None:
    """One line when `accelerate launch` was asked for several processes and started one:
    its simple launcher (distributed_type MULTI_CPU, or --cpu) sets MASTER_ADDR for more than
    one process but starts a single one without mpirun, which then trains alone."""
    launcher_vars = ("WORLD_SIZE", "PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "MV2_COMM_WORLD_SIZE")
    if "ACCELERATE_USE_CPU" in environ and "MASTER_ADDR" in environ and not any(
            v in environ for v in launcher_vars):
        return ("accelerate launch: started 1 process where several were asked for: its "
                "MULTI_CPU (or --cpu) launch starts several only under mpirun; on one machine "
                "use distributed_type: MULTI_GPU (accelerate then starts them through torchrun, "
                "and without a GPU they run MULTI_CPU over gloo)")
    return None


def accelerate_engine(environ) -> str:
    """What accelerate runs: fsdp1/fsdp2 under an FSDP config, else ddp (or one process)."""
    if environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true":
        return "fsdp2" if environ.get("FSDP_VERSION", "1") == "2" else "fsdp1"
    return "ddp"


def fsdp_recomputes(environ) -> bool:
    """Whether accelerate's FSDP recomputes every decoder layer itself (its config's
    fsdp_activation_checkpointing: FSDP_ACTIVATION_CHECKPOINTING in the launch's environment)."""
    return (accelerate_engine(environ).startswith("fsdp")
            and environ.get("FSDP_ACTIVATION_CHECKPOINTING", "false").lower() == "true")
