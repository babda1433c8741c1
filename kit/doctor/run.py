"""During and after a run: pure checks the recipe can call each step, and `diagnose_run` on a
run folder (metrics.jsonl, result.json, adapter/, logs) written by kit.train / kit.launch.

    check_step({"step": 3, "loss": float("nan")})   # -> [Finding(error, loss_nonfinite, ...)]
    diagnose_run("launch/tiny-cpu")
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from kit.doctor.explain import explain
from kit.doctor.findings import Finding, errors, ordered

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
    """A saved PEFT adapter: present, not empty, complete and finite (kit.checkpoint), trained
    (PEFT starts every lora_B at zero: all-zero lora_B means the adapter never changed)."""
    from safetensors import safe_open

    from kit.checkpoint import CheckpointError, verify_adapter

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
    with safe_open(str(weights), "pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    if not tensors:
        return [
            Finding(
                "error",
                "adapter_empty",
                f"{weights} holds 0 tensors ({weights.stat().st_size} bytes): FSDP1 full state "
                "dict keys did not match PEFT's",
                "save through kit.checkpoint (keys mapped before wrapping)",
            )
        ]
    if expected is None:
        expected = {k: tuple(t.shape) for k, t in tensors.items()}
    try:
        verify_adapter(folder, expected)
    except CheckpointError as e:
        return [Finding("error", "adapter_invalid", str(e), "save again through kit.checkpoint")]
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


def _read_jsonl(path: Path) -> list[dict]:
    rows = []
    if path.is_file():
        for line in path.read_text().splitlines():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                pass  # a line being written
    return rows


def diagnose_run(run_dir: str | Path) -> list[Finding]:
    """Findings for a run folder (launch/<run>/): metrics.jsonl, result.json, adapter/, logs."""
    run = Path(run_dir)
    if not run.is_dir():
        return [Finding("error", "run_missing", f"{run} is not a folder", "give a run folder")]
    out: list[Finding] = []
    rows = _read_jsonl(run / "metrics.jsonl")
    train = [r for r in rows if r.get("split") == "train"]
    for r in rows:
        out += check_step(r)
    finite = [
        r["loss"]
        for r in train
        if isinstance(r.get("loss"), (int, float)) and math.isfinite(r["loss"])
    ]
    norms = [r.get("grad_norm") for r in train]
    if len(train) >= 3 and all(n == 0 for n in norms):
        out.append(
            Finding(
                "error",
                "lora_not_training",
                f"gradient norm is 0 at all {len(train)} steps",
                "check requires_grad on LoRA, use_orig_params=true",
            )
        )
    elif len(finite) >= 4 and max(finite) - min(finite) == 0:
        out.append(
            Finding(
                "error",
                "lora_not_training",
                f"loss identical at all {len(finite)} steps: nothing is learning",
                "check the optimizer holds the LoRA params and lr > 0",
            )
        )
    per_rank = [r["step_s_per_rank"] for r in train if isinstance(r.get("step_s_per_rank"), list)]
    if per_rank:  # median over steps of each rank's time (needs the recipe hook)
        cols = list(zip(*per_rank, strict=False))
        out += check_rank_times([sorted(c)[len(c) // 2] for c in cols])
    result = None
    if (run / "result.json").is_file():
        result = json.loads((run / "result.json").read_text())
        sums = result.get("lora_checksums") or []
        if len(set(sums)) > 1:
            out.append(
                Finding(
                    "error",
                    "ranks_diverged",
                    f"ranks ended with different LoRA weights: {sums}",
                    "gradients were not synchronised: check the engine's reduction",
                )
            )
    if (run / "adapter").is_dir():
        out += check_adapter(run / "adapter")
    logs = [run / "run.log", *sorted(run.glob("logs/**/*.log")), *sorted(run.glob("*.err"))]
    text = "\n".join(p.read_text(errors="replace") for p in logs if p.is_file())
    out += explain(text)
    if result is None and not errors(out):
        out.append(
            Finding(
                "warning",
                "run_incomplete",
                f"{run} has no result.json and no known error in its logs",
                "still running, or see run.log for the last lines",
            )
        )
    first = {}  # one finding per problem: the first step / file that showed it
    for f in out:
        first.setdefault(f.code, f)
    return ordered(list(first.values()))
