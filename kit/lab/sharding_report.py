"""Notebook 04's view of sharding, kernel side: start the per-rank report, read it back, tabulate.

    report = launch_report("launch/nb04", engines=("fsdp2", "fsdp1", "ddp"))
    shard_table(report["fsdp2"], "q_proj")   # full shape and each rank's piece, per parameter
    bytes_per_rank(report["fsdp1"])          # frozen, trainable, quantization constants

The report itself runs rank side (`python -m kit.lab.sharding`, kit/lab/sharding.py): each rank builds the
model as the recipe does, shards it and writes what it holds into <out>/<engine>/rank<R>.json.
This module only starts that run and reads the files: it imports no torch.
"""

from __future__ import annotations

from pathlib import Path

from kit.folder import jsonl
from kit.run.launch import run_to_end


def launch_report(out, engines=("fsdp2", "fsdp1", "ddp"), nproc: int = 2,
                  overrides: list[str] | None = None, config: str = "tiny-cpu") -> dict:
    """Run the report under torchrun (`python -m kit.lab.sharding`, separate processes, through the
    kit's captured-run helper: the folder `out` gets config.yaml and run.sh) and read it back."""
    out = Path(out).resolve()
    run_to_end(config, [f"run.output_dir={out}", *(overrides or [])], nproc=nproc,
               module="kit.lab.sharding",
               args=["{config}", "{run_dir}", *engines])
    found = read_report(out)
    return {engine: found[engine] for engine in engines}


def read_report(out) -> dict[str, list[dict]]:
    """{engine: [rank 0's report, rank 1's, ...]}"""
    found = {}
    for folder in sorted(Path(out).iterdir()):
        ranks = jsonl.read_ranks(folder) if folder.is_dir() else []
        if ranks:
            found[folder.name] = ranks
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
    bytes of each kind (kit.lab.sharding.Collectives), against the whole model's bytes (its 4-bit
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


def _short(unit: str) -> str:
    return unit.removeprefix("base_model.model.model.")


def plot_timeline(report: dict[str, list[dict]], engines=("fsdp2", "fsdp1")):
    """Rank 0's step in the order its operations ran (kit.lab.sharding.Timeline): per FSDP unit, when
    its parameters are held gathered (light) and when an operation reads them (dark), with the
    total gathered bytes underneath; the dashed line is where backward starts."""
    import matplotlib.pyplot as plt

    engines = [e for e in engines if e in report and report[e][0].get("timeline")]
    fig, axes = plt.subplots(2, len(engines), figsize=(6 * len(engines), 4.2), squeeze=False,
                             gridspec_kw={"height_ratios": [3, 1.4]}, sharex="col")  # fmt: skip
    for col, engine in enumerate(engines):
        tl = report[engine][0]["timeline"]
        top, bottom = axes[0][col], axes[1][col]
        for row in range(len(tl["units"])):
            y = len(tl["units"]) - 1 - row
            top.broken_barh([(a, b - a) for a, b in tl["gathered"][row]], (y - 0.35, 0.7),
                            color="tab:blue", alpha=0.3)  # fmt: skip
            top.broken_barh([(a, b - a) for a, b in tl["computing"][row]], (y - 0.35, 0.7),
                            color="tab:blue")  # fmt: skip
        top.set_yticks(range(len(tl["units"])), [_short(u) for u in reversed(tl["units"])])
        top.set_title(f"{engine}: light = gathered, dark = computing")
        xs, ys = zip(*[*tl["total"], [tl["ops"], tl["total"][-1][1]]], strict=True)
        bottom.step(xs, [b / 2**10 for b in ys], where="post", color="tab:blue")
        bottom.set_ylabel("gathered KiB")
        bottom.set_xlabel("operations of one step, in order")
        for ax in (top, bottom):
            ax.axvline(tl["marks"]["backward"], color="gray", linestyle="--", linewidth=0.8)
    fig.tight_layout()
    return fig


def timeline_table(report: dict[str, list[dict]], engines=("fsdp2", "fsdp1")) -> list[dict]:
    """Per engine, unit and pass: the operation at which the unit was gathered, first and last
    computed, and released, and which other units were held when it was gathered."""
    rows = []
    for engine in [e for e in engines if e in report and report[e][0].get("timeline")]:
        tl = report[engine][0]["timeline"]
        backward = tl["marks"]["backward"]
        for i, unit in enumerate(tl["units"]):
            for start, end in tl["gathered"][i]:
                ops = [c for c in tl["computing"][i] if start <= c[0] < end]
                held = [_short(u) for j, u in enumerate(tl["units"]) if j != i and any(
                    a < start < b for a, b in tl["gathered"][j])]  # fmt: skip
                rows.append({"engine": engine, "unit": _short(unit),
                             "pass": "forward" if start < backward else "backward",
                             "gathered": start, "computes": f"{ops[0][0]}-{ops[-1][1]}" if ops else "-",
                             "released": end, "also held then": ", ".join(held) or "-"})  # fmt: skip
    return rows


def layers_at_once(report: dict[str, list[dict]], engines=("fsdp2", "fsdp1")) -> list[dict]:
    """Per engine and pass: the most decoder layers held gathered at the same moment (1: gather,
    compute, release, then the next; 2: the next one was gathered ahead, a prefetch), and the
    share of the step's operations during which the root and the embeddings were held (to 10%:
    the count of operations moves with the torch version, the shape of the step does not)."""
    rows = []
    for engine in [e for e in engines if e in report and report[e][0].get("timeline")]:
        tl = report[engine][0]["timeline"]
        backward, ops = tl["marks"]["backward"], tl["ops"]
        layers = [i for i, u in enumerate(tl["units"]) if ".layers." in f".{_short(u)}"]
        row = {"engine": engine}
        for name, lo, hi in (("forward", 0, backward), ("backward", backward, ops)):
            held = [sum(any(a <= t < b for a, b in tl["gathered"][i]) for i in layers)
                    for t in range(lo, hi)]  # fmt: skip
            row[f"layers at once, {name}"] = max(held, default=0)
        for i, unit in enumerate(tl["units"]):
            if _short(unit) in ("root", "embed_tokens"):
                share = sum(b - a for a, b in tl["gathered"][i]) / ops
                row[f"{_short(unit)} held"] = f"{round(share, 1):.0%} of the step"
        row.setdefault("embed_tokens held", "(in the root)")
        rows.append(row)
    return rows



def one_unit(report: dict[str, list[dict]], engines=("fsdp2", "fsdp2-whole")) -> list[dict]:
    """The kit's FSDP2 wrap (a unit per decoder layer, the embeddings, the root) beside one unit for
    the whole model (the first article's `FSDP(model)`), from rank 0's step: units, all-gathers,
    the share of the step during which every unit was gathered at once (the whole model on every
    rank), and the most bytes held gathered at once (kit.lab.sharding.Timeline; FSDP2's copy-out
    spike included) against the model's bytes."""
    rows = []
    for engine in [e for e in engines if e in report and report[e][0].get("timeline")]:
        r = report[engine][0]
        tl, model = r["timeline"], sum(p["full_bytes"] for p in r["params"].values())
        whole = sum(all(any(a <= t < b for a, b in spans) for spans in tl["gathered"])
                    for t in range(tl["ops"]))  # fmt: skip
        rows.append({"wrap": engine, "units": len(r["units"]),
                     "all-gathers": r["collectives"].get("allgather_base", {}).get("calls", 0),
                     "whole model gathered": f"{whole / tl['ops']:.0%} of the step",
                     "most bytes gathered": tl["peak_gathered_bytes"],
                     "x the model": round(tl["peak_gathered_bytes"] / model, 2)})  # fmt: skip
    return rows


def one_rank_copies(report: dict) -> list[dict]:
    """Per wrap of a one-rank report (fsdp2: the kit's; fsdp2-every: as torch wraps it): the
    copy_ calls and bytes of one step, and how many frozen parameters FSDP2 made its own."""
    rows = []
    for engine, ranks in report.items():
        params = ranks[0]["params"]
        frozen = [p for p in params.values() if not p.get("trainable")]
        rows.append({"wrap": {"fsdp2": "the kit's FSDP2 (frozen weights alone)",
                              "fsdp2-every": "FSDP2 as torch wraps it"}.get(engine, engine),
                     "copy_ calls a step": ranks[0]["copies"]["calls"],
                     "bytes copied": ranks[0]["copies"]["bytes"],
                     "frozen params FSDP2 holds": sum(bool(p.get("dtensor")) for p in frozen),
                     "frozen params": len(frozen)})
    return rows
