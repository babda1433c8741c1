"""unsloth as a baseline: its own QLoRA path, as its documentation has a user write it.

The third baseline kit.bench measures the kit against, beside the article recipe
(kit.bench.article) and the peer stack (kit.bench.peer). A measurement only, never a dependency
of the kit: unsloth pins trl <= 1.15 and datasets < 5 (the kit's SFT trainer needs trl >= 1.16),
so it lives in a folder of its own, put in front of the case's PYTHONPATH by the runner
(`KIT_UNSLOTH_PATH`; benchmarks/run.sh fills it from .whl/unsloth, which
benchmarks/tools/fetch_unsloth_wheels.sh fetches). Every choice is unsloth's own default:

- `FastLanguageModel.from_pretrained(load_in_4bit=True)`: its NF4 (double quant) loading, bf16;
  for a mixture of experts it keeps the expert stacks in 4-bit and runs them through its grouped
  GEMM kernels;
- `FastLanguageModel.get_peft_model`: LoRA r 16, alpha 32 on q/k/v/o and gate/up/down (which it
  maps onto every expert's stacks in a MoE model), its default dropout 0 (its fast LoRA kernels
  need it), its "unsloth" gradient checkpointing;
- one process (its multi-GPU path is not what is compared), AdamW, clipping at 1.0, the same
  synthetic tokens and steps as every recipe (kit.bench.worker).

unsloth patches transformers when it is imported: the worker imports it before anything imports
transformers (`prepare`). Without a CUDA GPU, or without the folder, `unavailable` says why in
one line and the runner skips the case before starting a process. No torch at import.
"""

from __future__ import annotations

import os
from pathlib import Path

from kit.bench.matrix import no_cuda_gpu

VERSION = "2026.10.9"  # the version benchmarks/tools/fetch_unsloth_wheels.sh fetches
PATH_VARIABLE = "KIT_UNSLOTH_PATH"
# LoRA's targets as unsloth names them: it adds every expert's gate_up/down stacks of a MoE model
# for gate/up/down (its get_moe_target_parameters), as the kit's all-linear does.
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def folder() -> Path | None:
    """The folder unsloth and its pins are installed in, or None."""
    where = os.environ.get(PATH_VARIABLE)
    return Path(where) if where else None


def unavailable(device, nproc: int = 1) -> str | None:
    """One line saying why unsloth cannot run here (the matrix's device and the case's processes),
    None when it can."""
    why = no_cuda_gpu(device, "unsloth trains on a CUDA GPU only")
    if why:
        return why
    if nproc != 1:
        return f"unsloth is measured on one process; this case runs {nproc}"
    where = folder()
    if where is None or not (where / "unsloth" / "__init__.py").is_file():
        return (f"unsloth is not installed apart ({PATH_VARIABLE} names no folder holding it): "
                "bash benchmarks/tools/fetch_unsloth_wheels.sh, then benchmarks/run.sh installs it")
    return None


def prepare() -> None:
    """Import unsloth before transformers is imported, as its documentation asks (it patches
    transformers' and PEFT's classes on import)."""
    import unsloth  # noqa: F401


def build(model_path: str, device, *, seq_len: int, r: int = 16, alpha: int = 32,
          dropout: float = 0.0, checkpointing: str | bool = "unsloth", lr: float = 2e-4,
          seed: int = 42):
    """(model, optimizer): unsloth's loading and LoRA, one process."""
    import torch
    from unsloth import FastLanguageModel

    model, _ = FastLanguageModel.from_pretrained(
        model_name=model_path, max_seq_length=seq_len, dtype=torch.bfloat16, load_in_4bit=True,
        device_map={"": device.index or 0},
    )
    model = FastLanguageModel.get_peft_model(
        model, r=r, lora_alpha=alpha, lora_dropout=dropout, target_modules=list(TARGETS),
        bias="none", use_gradient_checkpointing=checkpointing, random_state=seed,
    )
    model.train()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr)
    return model, optimizer


def train_step(model, optimizer, batch: dict) -> float:
    """One optimizer step; returns the loss."""
    import torch

    loss = model(**batch).loss
    loss.backward()
    torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.requires_grad], 1.0)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss.item()
