"""kit: learn and do multi-GPU QLoRA fine-tuning (NF4 + LoRA + FSDP), from notebooks.

The house has two sides that meet only through files in a run folder (``launch/<run>/``):

- the kernel side (what a notebook imports: config, estimate, launch, widgets, doctor, bench
  reports, tour) never creates a process group or touches CUDA;
- the rank side (what torchrun runs: train, model, quantize, lora, recompute, sharding, data,
  loss, checkpoint, checks) never imports ipywidgets, the launcher or the doctor.

``tests/test_house.py`` holds both rules and the import graph without cycles. This file imports
nothing: every module may import ``ROOT`` from it.
"""

from pathlib import Path

# The checkout: ranks run here, launch/ lives here, relative data paths resolve here.
ROOT = Path(__file__).resolve().parents[1]
