"""Notebook 04's view of sharding, kernel side: start the per-rank report, read it back, tabulate.

    report = launch_report("launch/nb04", engines=("fsdp2", "fsdp1", "ddp"))
    shard_table(report["fsdp2"], "q_proj")   # full shape and each rank's piece, per parameter
    bytes_per_rank(report["fsdp1"])          # frozen, trainable, quantization constants

The report itself runs rank side (`python -m kit.sharding`, kit/sharding.py): each rank builds the
model as the recipe does, shards it and writes what it holds into <out>/<engine>/rank<R>.json.
This module only starts that run and reads the files: it imports no torch.
"""

from __future__ import annotations

import json
from pathlib import Path

from kit.launch import run_to_end


def launch_report(out, engines=("fsdp2", "fsdp1", "ddp"), nproc: int = 2,
                  overrides: list[str] | None = None, config: str = "tiny-cpu") -> dict:
    """Run the report under torchrun (`python -m kit.sharding`, separate processes, through the
    kit's captured-run helper: the folder `out` gets config.yaml and run.sh) and read it back."""
    out = Path(out).resolve()
    run_to_end(config, [f"run.output_dir={out}", *(overrides or [])], nproc=nproc,
               module="kit.sharding",
               args=["{config}", "--report", "{run_dir}", "--engines", ",".join(engines)])
    found = read_report(out)
    return {engine: found[engine] for engine in engines}


def read_report(out) -> dict[str, list[dict]]:
    """{engine: [rank 0's report, rank 1's, ...]}"""
    found = {}
    for folder in sorted(Path(out).iterdir()):
        ranks = sorted(folder.glob("rank*.json"), key=lambda p: int(p.stem[4:]))
        if ranks:
            found[folder.name] = [json.loads(p.read_text()) for p in ranks]
    return found


def shard_table(ranks: list[dict], *contains: str) -> list[dict]:
    """Per parameter whose name contains any of `contains` (all if none): its full shape and the
    shape each rank holds (one engine's report)."""
    params = ranks[0]["params"]
    rows = []
    for name, p in params.items():
        if contains and not any(c in name for c in contains):
            continue
        row = {"param": name.removeprefix("base_model.model."), "dtype": p["dtype"],
               "full": tuple(p["full_shape"])}  # fmt: skip
        for r in ranks:
            row[f"rank {r['rank']}"] = tuple(r["params"][name]["shape"])
        rows.append(row)
    return rows


def bytes_per_rank(ranks: list[dict]) -> list[dict]:
    """What each rank holds, in bytes: frozen params, trainable params, quantization constants."""
    rows = []
    for r in ranks:
        ps = r["params"].values()
        rows.append({
            "rank": r["rank"],
            "frozen": sum(p["bytes"] for p in ps if not p["trainable"]),
            "trainable": sum(p["bytes"] for p in ps if p["trainable"]),
            "quant constants": r["quant_constant_bytes"],
            "full model": sum(p["full_bytes"] for p in ps),
        })  # fmt: skip
    return rows


def traffic(report: dict[str, list[dict]]) -> list[dict]:
    """Per engine, rank 0's collectives in one training step (forward and backward): calls and
    bytes of each kind (kit.sharding.Collectives), against the whole model's bytes (its 4-bit
    weights packed, everything else in its dtype, before sharding) and the trainable part's."""
    rows = []
    for engine, ranks in report.items():
        r = ranks[0]
        ps = r["params"].values()
        model = sum(p["full_bytes"] for p in ps)
        trainable = sum(p["full_bytes"] for p in ps if p["trainable"])
        for op, c in sorted(r.get("collectives", {}).items()):
            rows.append({"engine": engine, "collective": op, "calls": c["calls"],
                         "bytes": c["bytes"], "x the model": round(c["bytes"] / model, 2),
                         "x the trainable": round(c["bytes"] / trainable, 2)})  # fmt: skip
    return rows


def plot_layout(report: dict[str, list[dict]], unit: str = "layers.0.", ax=None):
    """What rank 0 and rank 1 hold of one unit, per engine, drawn from the report: the unit's
    parameters end to end (width: elements), each split where the ranks' pieces meet (rank 1's
    part hatched). FSDP1 cuts its one flat buffer in the middle, wherever a parameter falls;
    FSDP2 splits every parameter by its rows."""
    import math

    import matplotlib.pyplot as plt

    engines = [e for e in ("fsdp1", "fsdp2") if e in report]
    ax = ax or plt.subplots(figsize=(10, 0.9 + 0.8 * len(engines)))[1]
    colors = plt.get_cmap("tab20").colors
    for row, engine in enumerate(engines):
        ranks = report[engine]
        left = 0
        names = [n for n in ranks[0]["params"] if unit in n]
        for i, name in enumerate(names):
            full = math.prod(ranks[0]["params"][name]["full_shape"])
            mine = math.prod(ranks[0]["params"][name]["shape"])  # rank 0's piece
            color = colors[i % len(colors)]
            ax.barh(row, mine, left=left, color=color, edgecolor="white", linewidth=0.3)
            ax.barh(row, full - mine, left=left + mine, color=color, hatch="///",
                    edgecolor="black", linewidth=0.3)  # fmt: skip
            if row == 0 and full > 0.03 * sum(math.prod(ranks[0]["params"][n]["full_shape"])
                                               for n in names):  # fmt: skip
                ax.text(left + full / 2, len(engines) - 0.45,
                        name.split(unit)[1].removesuffix(".weight").replace(".default", ""),
                        rotation=60, fontsize=7, ha="left", va="bottom")  # fmt: skip
            left += full
    ax.set_yticks(range(len(engines)), engines)
    ax.set_xlabel(f"elements of {unit.rstrip('.')}, parameters in order (hatched: rank 1's part)")
    ax.set_ylim(-0.6, len(engines) + 1.2)
    return ax
