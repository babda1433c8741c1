"""The primer's ranks and collectives, kernel side: start the launch, read what each rank
recorded, tabulate and draw it.

    results = run(out="launch/nb00-primer")   # torchrun -m kit.lab.collectives_rank, 2 ranks
    print(source("all_gather"))               # the code that ran, read from the rank-side file
    table(results, "all_gather")              # each rank's input and output
    bytes_table(results)                      # bytes each rank wrote, against a ring's
    plot(results)                             # every collective, drawn

The ranks run kit/lab/collectives_rank.py (rank side) and write <out>/<case>/rank<R>.json; this
module starts the launch (kit.run.launch.run_to_end: <out>/config.yaml, run.sh, run.log) and reads
the files. No torch.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from kit.folder import jsonl
from kit.lab import order
from kit.run.launch import run_to_end

RANK_SIDE = Path(__file__).with_name("collectives_rank.py")
JOIN = Path(__file__).parents[1] / "recipe" / "dist.py"  # how every rank of the kit joins
COLLECTIVES = ("all_gather", "reduce_scatter", "all_reduce", "broadcast")
CASES = ("environment", *COLLECTIVES, "fsdp_step")


def run(out: str | Path = "launch/nb00-primer", nproc: int = 2, device: str = "cpu",
        config: str = "tiny-cpu") -> dict[str, list[dict]]:  # fmt: skip
    """Every case of kit/lab/collectives_rank.py in one torchrun launch of `nproc` ranks on
    `device` (cpu: gloo; cuda: nccl, one GPU per rank); returns read(out)."""
    out = Path(out).resolve()
    for case in CASES:  # no row of an earlier launch is read
        shutil.rmtree(out / case, ignore_errors=True)
    run_to_end(config, [f"run.output_dir={out}", f"training.device={device}"], nproc=nproc,
               module="kit.lab.collectives_rank", args=["{config}", "{run_dir}", *CASES])
    return read(out)


def read(out: str | Path) -> dict[str, list[dict]]:
    """{case: [rank 0's row, rank 1's, ...]}"""
    found = {case: jsonl.read_ranks(Path(out) / case) for case in CASES}
    missing = [case for case, rows in found.items() if not rows]
    if missing:
        raise FileNotFoundError(f"{out}: no rows for {missing} (run() writes them)")
    return found


def source(*names: str, path: Path = RANK_SIDE) -> str:
    """The code of functions of kit/lab/collectives_rank.py (or of `path`), read from the file."""
    return order.source(*names, path=path)


def torchrun_line(out: str | Path = "launch/nb00-primer") -> str:
    """The command that started the ranks, as run.sh ran it (its `set -x` line in run.log:
    `python -m torch.distributed.run` is what the `torchrun` command runs)."""
    lines = (Path(out) / "run.log").read_text().splitlines()
    return next(line.removeprefix("+ exec ") for line in lines if "torch.distributed.run" in line
                and line.startswith("+"))


def environment(results: dict) -> list[dict]:
    """Per rank: the variables torchrun set, and the process it ran in."""
    return [{"rank": r["rank"], **r["variables"], "pid": r["pid"], "parent pid": r["parent pid"],
             "backend": r["backend"], "device": r["device"]}
            for r in results["environment"]]  # fmt: skip


def table(results: dict, case: str) -> list[dict]:
    """Per rank: its input and its output of one collective."""
    return [{"rank": r["rank"], "input": r["input"], "output": r["output"]} for r in results[case]]


def ring_writes(case: str, input_bytes: int, rank: int, world: int) -> int:
    """Bytes a rank writes in the ring (pipelined chain for broadcast) algorithm NCCL uses, for an
    input of `input_bytes` per rank: the textbook's count, to set beside what gloo wrote."""
    if case == "all_gather":
        return (world - 1) * input_bytes  # its own shard, then every other one it forwards
    if case == "reduce_scatter":
        return (world - 1) * input_bytes // world  # one partial sum per slice but its own
    if case == "all_reduce":
        return 2 * (world - 1) * input_bytes // world  # a reduce-scatter, then an all-gather
    if case == "broadcast":
        return input_bytes if rank < world - 1 else 0  # every rank forwards but the last
    raise KeyError(case)


def bytes_table(results: dict) -> list[dict]:
    """Per collective and rank, at the measured size: the input's bytes, the bytes the rank wrote
    to its sockets (gloo; None under NCCL), what it received (with 2 ranks: what the other one
    wrote), and what the ring algorithm writes."""
    rows = []
    for case in COLLECTIVES:
        ranks = results[case]
        world = len(ranks)
        for r in ranks:
            other = ranks[1 - r["rank"]]["written"] if world == 2 else None
            rows.append({"collective": case, "rank": r["rank"], "input bytes": r["input bytes"],
                         "wrote": r["written"], "received": other,
                         "a ring writes": ring_writes(case, r["input bytes"], r["rank"], world),
                         "wrote, tiny call": r["written small"]})  # fmt: skip
    for row in rows:  # per byte of input: what gloo wrote (gloo's fixed cost is lost here), a ring
        row["wrote / input"] = None if row["wrote"] is None else round(
            row["wrote"] / row["input bytes"], 2)
        row["a ring / input"] = round(row["a ring writes"] / row["input bytes"], 2)
    return rows


def fsdp_calls(results: dict) -> list[dict]:
    """Per rank: the collectives fully_shard issued in forward and in backward (calls, bytes),
    and whether its gradient shards match the ones written out by hand."""
    rows = []
    for r in results["fsdp_step"]:
        for phase in ("forward", "backward"):
            for op, c in r[f"{phase} calls"].items():
                rows.append({"rank": r["rank"], "phase": phase, "collective": op,
                             "calls": c["calls"], "bytes": c["bytes"]})  # fmt: skip
    return rows


def plot(results: dict):
    """Every collective, one panel each: each rank's input (left) and output (right), a cell per
    element, coloured by the rank whose value it holds (grey: a sum over the ranks)."""
    import matplotlib.pyplot as plt

    colors = plt.get_cmap("tab10").colors
    fig, axes = plt.subplots(1, len(COLLECTIVES), figsize=(3.2 * len(COLLECTIVES), 2.4))
    for ax, case in zip(axes, COLLECTIVES, strict=True):
        ranks = results[case]
        for r in ranks:
            y = len(ranks) - 1 - r["rank"]
            for side, (values, x0) in enumerate(((r["input"], 0), (r["output"], 5.5))):
                for i, v in enumerate(values):
                    owner = _owner(case, side, r["rank"], i, len(r["output"]), len(ranks))
                    color = "lightgrey" if owner is None else colors[owner]
                    ax.add_patch(plt.Rectangle((x0 + i, y), 0.95, 0.8, color=color, alpha=0.6))
                    ax.text(x0 + i + 0.47, y + 0.4, f"{v:g}", ha="center", va="center", fontsize=8)
            ax.text(-0.2, y + 0.4, f"rank {r['rank']}", ha="right", va="center", fontsize=8)
        ax.annotate("", xy=(5.3, len(ranks) / 2), xytext=(4.2, len(ranks) / 2),
                    arrowprops={"arrowstyle": "->"})  # fmt: skip
        ax.set(xlim=(-1.6, 9.6), ylim=(-0.3, len(ranks) + 0.1), title=case.replace("_", "-"))
        ax.axis("off")
    fig.tight_layout()
    return fig


def _owner(case: str, side: int, rank: int, i: int, out_len: int, world: int) -> int | None:
    """Which rank's value an element holds (None: a sum over every rank's)."""
    if side == 0:
        return rank
    if case == "all_gather":
        return i // (out_len // world)
    if case == "broadcast":
        return 0
    return None
