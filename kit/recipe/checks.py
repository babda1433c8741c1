"""In-run checks: what the recipe asks on its ranks, each step or once, and what it does with the
answer (stop with one line, or warn). Rank side: imports neither the doctor nor the launcher; the
doctor's `diagnose_run` reads the same checks' verdicts back from a finished run folder.

    check_step({"step": 3, "loss": float("nan")})   # -> [Finding(error, loss_nonfinite, ...)]
    check_rank_times([0.2, 0.9], step=5)             # -> [Finding(warning, slow_rank, ...)]
    check_val_rising(history, step=40)               # -> [Finding(warning, val_loss_rising, ...)]
    check_graph_breaks(graph_breaks())               # compiled layers that run in pieces
    check_checkpointing_active(model)                # recompute switched on in eval mode
    check_adapter("launch/tiny-cpu/adapter")         # saved, complete, finite and trained
"""

from __future__ import annotations

import math
from pathlib import Path

from kit.findings import Finding
from kit.folder.manifest import CheckpointError
from kit.recipe.verify import verify_adapter

RISING_EVALS = 3  # held-out loss above the evaluation before it, this many in a row: warn
SLOW_RANK_RATIO = 1.5  # a rank this much slower than the median holds every collective back
# Smallest change that counts as training: real learning rates move LoRA weights by >= ~1e-7 per
# step; a weight that moved less (lr=1e-30, frozen, not in the optimizer) is not learning.
STILL = 1e-10


def check_step(row: dict) -> list[Finding]:
    """One metrics row (split/step/loss/grad_norm...): NaN/inf, or no gradient reaching LoRA."""
    step, out = row.get("step"), []
    for key in ("loss", "grad_norm"):
        value = row.get(key)
        if isinstance(value, (int, float)) and not math.isfinite(value):
            out.append(
                Finding(
                    "error",
                    "loss_nonfinite",
                    f"step {step}: {key} is {value}",
                    "lower training.lr, keep max_grad_norm > 0, prefer bfloat16 to float16",
                )
            )
    if row.get("split", "train") == "train" and row.get("grad_norm") == 0:
        out.append(
            Finding(
                "error",
                "lora_not_training",
                f"step {step}: gradient norm is exactly 0: no gradient reaches the adapters",
                "check requires_grad on LoRA params, use_orig_params=true",
            )
        )
    return out


def trainable_snapshot(model) -> dict:
    """A CPU copy of this rank's trainable parameters (local shards under FSDP2)."""
    out = {}
    for name, p in model.named_parameters():
        if p.requires_grad:
            local = p.to_local() if hasattr(p, "to_local") else p
            out[name] = local.detach().float().cpu().clone()
    return out


def check_lora_changed(before: dict, after: dict, step: int) -> list[Finding]:
    """Error if no trainable tensor changed between two snapshots `step` steps apart."""
    if not before:
        return [
            Finding(
                "error",
                "lora_not_training",
                "the model has no trainable parameters",
                "apply LoRA before sharding; check target_modules",
            )
        ]
    changed = [
        k
        for k in before
        if k in after and before[k].numel() and (after[k] - before[k]).abs().max() > STILL
    ]
    if changed:
        return []
    return [
        Finding(
            "error",
            "lora_not_training",
            f"after {step} steps none of {len(before)} trainable tensors changed",
            "check the optimizer holds the LoRA params, use_orig_params=true under FSDP1, lr > 0",
        )
    ]


def check_rank_times(
    times: list[float], step: int | None = None, ratio: float = SLOW_RANK_RATIO
) -> list[Finding]:
    """Seconds per step of each rank: one much slower than the median stalls all others."""
    if len(times) < 2:
        return []
    slow = max(range(len(times)), key=lambda r: times[r])
    others = sorted(t for r, t in enumerate(times) if r != slow)
    median = others[len(others) // 2]  # of the other ranks: with 2 ranks, the other one
    if median <= 0 or times[slow] < ratio * median:
        return []
    at = f" at step {step}" if step is not None else ""
    return [
        Finding(
            "warning",
            "slow_rank",
            f"rank {slow} takes {times[slow]:.2f}s per step{at} vs {median:.2f}s for the others "
            "(every collective waits for it)",
            "check that GPU's clocks/thermals (nvidia-smi), CPU pinning, and uneven batch lengths",
        )
    ]


def step_warnings(row: dict, step: int, history: list[dict]) -> list[Finding]:
    """What kit.train says after a step and goes on: a slow rank, held-out loss rising."""
    return check_rank_times(row["step_s_per_rank"], step) + check_val_rising(history, step)


def graph_breaks(since: dict[str, int] | None = None) -> dict[str, int]:
    """torch.compile's graph breaks in this process (reason -> how many), those since `since`."""
    from torch._dynamo.utils import counters  # a process's count: torch._dynamo.reset keeps it

    since = since or {}
    return {k: n - since.get(k, 0) for k, n in counters["graph_break"].items()
            if n > since.get(k, 0)}


def check_graph_breaks(breaks: dict[str, int]) -> list[Finding]:
    """Graph breaks after the first step of compiled layers (`graph_breaks()`): the code between
    them runs eagerly, outside the fused kernels and the recompute policy the plan counted on; the
    step runs slower and keeps more (a late import inside a layer's trace once ran the 8B plan at
    5,626 tokens/s and 30 GiB instead of ~14,900 and 18.5, with nothing said)."""
    if not breaks:
        return []
    lines = [line.strip() for line in max(breaks, key=breaks.get).strip().splitlines()]
    why = next((line.removeprefix("Explanation:").strip() for line in lines
                if line.startswith("Explanation:")), lines[0])[:200]
    n = sum(breaks.values())
    return [Finding("warning", "graph_breaks",
                    f"torch.compile broke the compiled layers' graphs {n} time{'s' * (n > 1)} "
                    f"in the first step (most often: {why}); what lies between runs "
                    "eagerly: slower, keeping more memory than planned",
                    "TORCH_LOGS=graph_breaks names each place; training.compile=false if it "
                    "cannot compile", "training.compile")]


def check_val_rising(history: list[dict], step: int | None = None,
                     evals: int = RISING_EVALS) -> list[Finding]:
    """Held-out loss that rose at `evals` evaluations in a row (the adapter learns its training
    rows, not the task), said once a run: at the step whose evaluation first made such a run of
    rises, with the steps and values. `history`: the run's metrics rows (rank 0's holds a resumed
    run's earlier rows too, so a resumed run does not say it again); step None: wherever it
    happened (the doctor, reading a finished run's metrics.jsonl)."""
    val = [(r["step"], r["loss"]) for r in history if r.get("split") == "val"]
    rises, first = 0, None
    for i in range(1, len(val)):
        rises = rises + 1 if val[i][1] > val[i - 1][1] else 0
        if rises == evals:
            first = i
            break
    if first is None or step is not None and (first != len(val) - 1 or val[first][0] != step):
        return []
    best_step, best = min(val[: first + 1], key=lambda sv: sv[1])
    seen = ", ".join(f"step {s} {loss:.4f}" for s, loss in val[first - evals: first + 1])
    return [Finding("warning", "val_loss_rising",
                    f"held-out loss rose at {evals} evaluations in a row: {seen} (lowest "
                    f"{best:.4f} at step {best_step})",
                    f"the adapter is fitting its training rows: fewer steps (training.steps="
                    f"{best_step}), a lower training.lr or more rows; checkpoints/ keeps "
                    "earlier steps (checkpointing.save_every; checkpointing.keep_best=true keeps "
                    "the lowest held-out loss's)", "training.steps")]


def check_checkpointing_active(model) -> list[Finding]:
    """Gradient checkpointing switched on in modules left in eval mode does nothing."""
    idle = [
        n
        for n, m in model.named_modules()
        if getattr(m, "gradient_checkpointing", False) is True and not m.training
    ]
    if not idle:
        return []
    return [
        Finding(
            "error",
            "eval_mode_checkpointing",
            f"gradient checkpointing is on in {len(idle)} modules in eval mode: no recompute, "
            "activation memory as without it",
            "call model.train() before training",
        )
    ]


def check_adapter(folder: str | Path, expected: dict | None = None) -> list[Finding]:
    """A saved PEFT adapter: present, not empty, complete and finite (verify_adapter), trained
    (PEFT starts every lora_B at zero: all-zero lora_B means the adapter never changed)."""
    from safetensors import safe_open

    folder = Path(folder)
    weights = folder / "adapter_model.safetensors"
    if not weights.is_file():
        return [
            Finding(
                "error",
                "adapter_missing",
                f"{weights} does not exist",
                "save the adapter (checkpointing.save_adapter=true)",
            )
        ]
    try:
        with safe_open(str(weights), "pt") as f:
            tensors = {k: f.get_tensor(k) for k in f.keys()}
    except Exception as e:  # noqa: BLE001 - truncated or not safetensors: one finding, the file named
        return [Finding("error", "adapter_unreadable",
                        f"{weights}: cannot be read ({type(e).__name__}: {str(e).splitlines()[0]})",
                        "save it again; an older verified copy is in checkpoints/step-N/adapter")]
    if not tensors:
        return [
            Finding(
                "error",
                "adapter_empty",
                f"{weights} holds 0 tensors ({weights.stat().st_size} bytes): FSDP1 full state "
                "dict keys did not match PEFT's",
                "save through kit.recipe.checkpoint (keys mapped before wrapping)",
            )
        ]
    if expected is None:
        expected = {k: tuple(t.shape) for k, t in tensors.items()}
    try:
        verify_adapter(folder, expected)
    except CheckpointError as e:
        return [Finding("error", "adapter_invalid", str(e), "save again through kit.recipe.checkpoint")]
    lora_b = [t for k, t in tensors.items() if "lora_B" in k]
    if lora_b and all(float(t.float().abs().max()) <= STILL for t in lora_b):
        return [
            Finding(
                "error",
                "lora_not_training",
                f"all {len(lora_b)} lora_B tensors in {weights.name} are (near) zero, as PEFT "
                "initialised them: the adapter never trained",
                "check use_orig_params, lr, that the optimizer holds the LoRA params",
            )
        ]
    return []


def same_init(peft_model, world_size: int) -> None:
    """Every rank must start from the same adapter: FSDP keeps each rank's own slice of it, so a
    rank that initialised differently would silently train a stitched-together model (a
    collective: every rank calls it, before sharding)."""
    import torch.distributed as dist

    from kit.recipe.checkpoint import checksum

    mine = checksum({n: p.detach().cpu() for n, p in peft_model.named_parameters()
                     if p.requires_grad})
    sums = [None] * world_size
    dist.all_gather_object(sums, mine)
    if len(set(sums)) != 1:
        raise RuntimeError(f"LoRA initialisation differs across ranks (checksums {sums})")
