"""Exercises of notebook 11 (troubleshooting): what the doctor says, before and after a run."""

from __future__ import annotations

import re

from kit.lab.exercises import Exercise, one_of

H100X2 = {"gpus": [{"name": "NVIDIA H100", "memory_gib": 79.6}] * 2, "vars": {},
          "host_ram_gib": 64}
BIG = ["model.name=kit:llama-8b", "data.max_seq_len=4096", "training.batch_size=8",
       "training.recompute.enabled=false", "run.dist_timeout_min=2"]
ERROR = "RuntimeError: Cannot flatten integer dtype tensors"


def _batch_at_8192() -> int:
    from kit import ROOT, doctor

    found = doctor.preflight(ROOT / "kit" / "configs" / "tiny-cpu.yaml", env=H100X2,
                             overrides=BIG + ["data.max_seq_len=8192"])
    fix = next(f.fix for f in found if f.code == "memory_over_gpu")
    return int(re.search(r"training\.batch_size=(\d+)", fix)[1])


def _fsdp1_fix() -> str:
    from kit import doctor

    fix = next(f.fix for f in doctor.explain(ERROR))
    return re.search(r"kit: ([\w.]+=\w+)", fix)[1]


EXERCISES = [
    Exercise(
        key="11.1",
        question=(
            "The 2x H100 setup above (`h100`, `big`) with data.max_seq_len=8192 instead of 4096: "
            "which training.batch_size does the doctor name as the smallest change that fits? "
            "Predict it, then ask preflight (overrides=big + ['data.max_seq_len=8192']). "
            "(the answer: a number)"),
        check=lambda answer: one_of(_batch_at_8192(), {
            2: "that is the answer at 4,096 tokens; without recomputation the activations grow "
               "with batch x sequence length.",
            4: "8 did not fit at 4,096 tokens; the memory line prints the GiB per GPU a batch "
               "needs at 8,192: does 4 fit in 79.6 GiB?",
        }, default="run doctor.preflight with the override, read memory_over_gpu's fix.")(answer),
        solution=_batch_at_8192,
        wrong=(2, 4),
    ),
    Exercise(
        key="11.2",
        question=(
            f"A job under FSDP1 died with {ERROR!r}. Which override of the kit fixes it while "
            "keeping sharding.engine=fsdp1? (doctor.explain reads the error; the answer: a "
            "'key=value' string)"),
        check=lambda answer: one_of(_fsdp1_fix(), {
            "sharding.engine=fsdp2": "that avoids it too, but the question keeps FSDP1: what "
                                     "must the 4-bit bytes be stored in for FSDP1 to flatten "
                                     "them?",
            "quantization.method=none": "that drops 4-bit altogether (4x the weight memory); "
                                        "the fix keeps NF4.",
            "sharding.use_orig_params=true": "another FSDP1 pitfall; this error is about the "
                                             "dtype of the packed 4-bit weights.",
        }, default="doctor.explain(text) gives findings; the fix names the kit's key.")(answer),
        solution=_fsdp1_fix,
        wrong=("sharding.engine=fsdp2", "quantization.method=none",
               "sharding.use_orig_params=true"),
    ),
]
