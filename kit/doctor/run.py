"""After a run: `diagnose_run` on a run folder (metrics.jsonl, result.json, adapter/, logs)
written by kit.train / kit.run.launch. The checks the recipe runs during training live rank side, in
kit/recipe/checks.py; this reads what they and the recipe left behind.

    diagnose_run("launch/tiny-cpu")
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from kit.doctor.explain import explain
from kit.findings import Finding, errors, ordered
from kit.folder.layout import RunFolder
from kit.recipe.checks import check_adapter, check_rank_times, check_step, check_val_rising


def diagnose_run(run_dir: str | Path) -> list[Finding]:
    """Findings for a run folder (launch/<run>/): metrics.jsonl, result.json, adapter/, logs."""
    run = Path(run_dir)
    if not run.is_dir():
        return [Finding("error", "run_missing", f"{run} is not a folder", "give a run folder")]
    out: list[Finding] = []
    folder = RunFolder(run)
    rows = folder.read_metrics(strict=False)
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
    out += check_val_rising(rows)  # what rank 0 said during the run, read back
    result = None
    if folder.result.is_file():
        result = json.loads(folder.result.read_text())
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
    if folder.adapter.is_dir():
        out += check_adapter(folder.adapter)
    logs = [folder.log, *sorted(folder.logs.glob("**/*.log")), *sorted(run.glob("*.err"))]
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
