"""kit: learn and do multi-GPU QLoRA fine-tuning (NF4 + LoRA + FSDP), from notebooks.

The house has two sides that meet only through files in a run folder (``launch/<run>/``):

- the kernel side (what a notebook imports: config, estimate, launch, widgets, doctor, bench
  reports, tour) never creates a process group or touches CUDA;
- the rank side (what torchrun runs: train, model, quantize, lora, recompute, sharding, data,
  loss, checkpoint, checks) never imports ipywidgets, the launcher or the doctor.

``tests/test_house.py`` holds both rules and the import graph without cycles. This file imports
nothing of the kit: every module may import ``ROOT`` from it.
"""

import logging
import warnings
from pathlib import Path

# The checkout: ranks run here, launch/ lives here, relative data paths resolve here.
ROOT = Path(__file__).resolve().parents[1]


class _NoHubKernelLine(logging.Filter):
    """Drops bitsandbytes' one line about its optional hub kernel, and nothing else it logs.

    On a CPU with AVX512-BF16, importing bitsandbytes (>= 0.50) tries to fetch a faster 4-bit
    gemm from a model hub through the `kernels` package and logs a warning when it cannot, then
    uses its own built-in kernel. Installing `kernels` does not help (it downloads at run time,
    which machines without a hub cannot), so every CPU run, notebook cell and rank would print
    it. No library switch silences only this line: a logging filter on that one logger does."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("Failed to load CPU gemm_4bit_forward")


logging.getLogger("bitsandbytes.backends.cpu.ops").addFilter(_NoHubKernelLine())

# transformers 5 renamed `is_gradient_checkpointing`; PEFT still calls the old name when it wraps a
# model, so every rank of every run printed the notice, which only PEFT's authors can act on.
warnings.filterwarnings("ignore", message="`is_gradient_checkpointing` is deprecated",
                        category=FutureWarning)
