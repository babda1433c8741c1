"""Exercises of notebook 09 (choosing a configuration): make an 8B step fit one 24 GiB GPU by
changing levers, not the batch (09.1, hands-on: the check estimates the learner's config and names
the part that is still too large), and a recorded run's MFU computed from its speed (09.2)."""

from __future__ import annotations

from kit.budget.estimate import GiB, Setup, activation_bytes_per_token_layer, estimate
from kit.config import ConfigError, load_config
from kit.lab.exercises import Exercise, close_to

CAP_GIB = 24  # one GPU, as the notebook's plan cell caps an H100
# The articles' way at batch 8: transformers' loss, nothing recomputed.
FIT_BASE = ["model.name=kit:llama-8b", "data.max_seq_len=2048", "lora.r=16", "lora.alpha=32",
            "training.batch_size=8", "training.loss=hf", "training.recompute.enabled=false"]
# What the learner must keep: the work one step does (model, rows, their length, the adapters).
KEPT = {"model.name": lambda c: c.model.name, "data.max_seq_len": lambda c: c.data.max_seq_len,
        "training.batch_size": lambda c: c.training.batch_size, "lora.r": lambda c: c.lora.r,
        "lora.target_modules": lambda c: c.lora.target_modules}
FIT_SOLUTION = ["training.recompute.enabled=true", "training.loss=fused"]


def fit_estimate(overrides: list[str]):
    """The estimate (kit.budget.estimate) of one step of FIT_BASE plus `overrides` on one GPU."""
    cfg = load_config(None, [*FIT_BASE, *overrides])
    return cfg, estimate(cfg.model.name, Setup.from_config(cfg, world_size=1))


def _check_fit(answer) -> str | None:
    if not isinstance(answer, (list, tuple)) or not all(isinstance(x, str) for x in answer):
        return 'give a list of "key=value" overrides, e.g. ["training.loss=chunked"]'
    if not answer:
        return (f"the base config needs {fit_estimate([])[1].needed_gib():.0f} GiB: change at "
                "least one lever")
    try:
        cfg, est = fit_estimate(list(answer))
    except (ConfigError, ValueError) as e:
        return str(e)
    base = load_config(None, FIT_BASE)
    for key, value in KEPT.items():
        if value(cfg) != value(base):
            return (f"{key} is the work the step must do ({value(base)!r}): change how it is "
                    "computed, not how much")
    if est.fits(CAP_GIB) and est.setup.offload_activations and not est.setup.recompute:
        per_token = activation_bytes_per_token_layer(est.shape, est.setup) * est.shape.layers
        kept = per_token * est.setup.batch_size * est.setup.seq_len / GiB
        return (f"it fits on paper ({est.needed_gib():.1f} GiB), but every layer's activations "
                f"(~{kept:.0f} GiB a step) travel to host memory and back, slower than the "
                "compute: notebook 01 measured this estimate 22% low. Recompute instead")
    if est.fits(CAP_GIB):
        return None
    part, size = max(est.parts.items(), key=lambda kv: kv[1])
    return (f"{est.needed_gib():.1f} GiB with headroom, {CAP_GIB} available. The largest part is "
            f"{part}: {size / GiB:.1f} GiB ({est.notes[part]}). Which lever shrinks it?")


def _planned_row() -> dict:
    from kit.bench import records, report

    rows = records.rows("2026-11-25-planned-defaults-1xh100", "8b")
    matrix = records.matrix("2026-11-25-planned-defaults-1xh100", "bench-8b-planned")
    return report.fastest(report.best_by_case(rows), matrix, "kit", 80)


def _mfu() -> float:
    """tokens/s per GPU x model FLOPs per token / the GPU's dense bf16 peak."""
    from kit.budget import shapes
    from kit.budget.step_model import PEAK_BF16_FLOPS

    flops = shapes.flops_per_token(shapes.shape_of("kit:llama-8b"), 2048)
    return _planned_row()["tokens_per_s_gpu"] * flops / PEAK_BF16_FLOPS["H100"]


def _check_mfu(answer) -> str | None:
    if isinstance(answer, (int, float)) and 1 < answer <= 100:
        return "give MFU as a fraction of the peak (0.25 for 25%), not a percentage."
    return close_to(_mfu(), rel=0.01, hint=(
        "MFU = tokens/s per GPU x model FLOPs per token / the peak in FLOP/s; use "
        "shapes.flops_per_token (forward, input gradients and attention: frozen layers compute "
        "no weight gradients), not 6 x parameters."))(answer)


EXERCISES = [
    Exercise(
        key="09.1",
        question=(
            "Hands-on: Llama-3-8B, batch 8 x 2,048 tokens on one 24 GiB GPU, the articles' way "
            "(training.loss=hf, training.recompute.enabled=false): which overrides make one step "
            "fit, the batch, length, model and adapters unchanged? (answer: a list of "
            "'key=value' strings; the check estimates it)"),
        check=_check_fit,
        solution=lambda: list(FIT_SOLUTION),
        wrong=(["training.recompute.enabled=true"], ["training.loss=fused"],
               ["training.loss=fused", "training.offload_activations=true"],
               ["training.batch_size=1"], ["training.loss=fast"], []),
        hands_on=True,
    ),
    Exercise(
        key="09.2",
        question=(
            "The Llama-3-8B plan at 80 GiB trained 13,999 tokens/s on one H100. With the model "
            "FLOPs per token from shapes.flops_per_token(shapes.shape_of('kit:llama-8b'), 2048) "
            "and the H100's dense bf16 peak (step_model.PEAK_BF16_FLOPS['H100']), what is its "
            "MFU? (answer: a fraction, e.g. 0.3)"),
        check=_check_mfu,
        solution=_mfu,
        wrong=(44.8, 0.68, 0.89),
    ),
]
