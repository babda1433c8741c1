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
