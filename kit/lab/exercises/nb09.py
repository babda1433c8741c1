"""Exercises of notebook 09 (benchmarks): numbers recomputed from a recorded GPU run's rows."""

from __future__ import annotations

from kit.lab.exercises import Exercise, close_to

RECORDED = "2026-11-23-speed-8b-2xh200"  # benchmarks/records/: a recorded GPU run, its rows and matrix


def _best_kit_80() -> tuple[dict, dict]:
    from kit.bench import records, report

    rows, matrix = records.rows(RECORDED), records.matrix(RECORDED)
    return report.fastest(report.best_by_case(rows), matrix, "kit", 80), matrix


def _mfu() -> float:
    """tokens/s per GPU x model FLOPs per token / the GPU's dense bf16 peak."""
    from kit.bench import report
    from kit.budget import shapes

    row, matrix = _best_kit_80()
    flops = shapes.flops_per_token(shapes.shape_of(matrix["model"]), matrix["seq_len"])
    return row["tokens_per_s_gpu"] * flops / report.PEAK_BF16_FLOPS["H200"]


def _step_seconds() -> float:
    """tokens/s per GPU is batch x sequence length / the median step time: solved for the step."""
    row, matrix = _best_kit_80()
    return row["batch"] * matrix["seq_len"] / row["tokens_per_s_gpu"]


def _check_mfu(answer) -> str | None:
    if isinstance(answer, (int, float)) and 1 < answer <= 100:
        return "give MFU as a fraction of the peak (0.25 for 25%), not a percentage."
    return close_to(_mfu(), rel=0.01, hint=(
        "MFU = tokens/s per GPU x model FLOPs per token / the peak in FLOP/s; use the FLOPs "
        "per token the cell printed (forward, input gradients and attention: frozen layers "
        "compute no weight gradients), not 6 x parameters, and one GPU's tokens."))(answer)


EXERCISES = [
    Exercise(
        key="09.1",
        question=(
            "The recorded 2x H200 run's fastest kit case at 80 GiB trained 13,122 tokens/s per "
            "GPU. From the model FLOPs per token printed above and the H200's dense bf16 peak "
            "(bench_report.PEAK_BF16_FLOPS), what is its MFU? (the answer: a fraction, e.g. 0.3)"),
        check=_check_mfu,
        solution=_mfu,
        wrong=(42.0, 0.64, 0.84),
    ),
    Exercise(
        key="09.2",
        question=(
            "The same row: batch 8 of 2,048-token sequences per GPU, 13,122 tokens/s per GPU. "
            "How many seconds did its median optimizer step take? (the answer: seconds)"),
        check=lambda answer: close_to(_step_seconds(), rel=0.01, hint=(
            "tokens/s per GPU counts one GPU's tokens (its batch x the sequence length) over "
            "one step; both GPUs step at the same time, so the other GPU's tokens do not add "
            "time."))(answer),
        solution=_step_seconds,
        wrong=(0.62, 0.00061, 2.5),
    ),
]
