"""Notebook 10's view of loading, kernel side: one load-only torchrun per `model.loading` mode.

    rows = measure("tiny-cpu", ["model.name=kit:llama-135m"], modes=("full", "rank0", "stream"))
    table(rows)    # per mode and rank: seconds, host memory, read the file?, digests

The ranks run `python -m kit.lab.loading_rank CONFIG DIR MODE ...` (kit/lab/loading_rank.py): each loads
the base model as the mode says, adds LoRA, shards with the config's engine and writes its time,
its peak host memory and digests of what it holds and of a forward's logits into DIR/rank<R>.json. This module
starts those runs and reads the files: no torch.
"""

from __future__ import annotations

from pathlib import Path

from kit.folder import jsonl
from kit.run.launch import run_to_end


def measure(config: str, overrides: list[str] | None = None, modes=("full", "rank0", "stream"),
            nproc: int = 2, out: str | Path = "launch/loading", together: bool = False,
            ) -> list[dict]:  # fmt: skip
    """Rows of every rank's report, per mode. One captured torchrun per mode (run folder
    out/<mode>: its own peak memory), or with `together` one torchrun for every mode in turn
    (run folder out/together: the digests compare, the memory peaks are the process's so far)."""
    rows = []
    for group in [modes] if together else [[m] for m in modes]:
        folder = (Path(out) / ("together" if together else group[0])).resolve()
        run_to_end(config, [f"run.output_dir={folder}", *(overrides or [])], nproc=nproc,
                   module="kit.lab.loading_rank",
                   args=["{config}", "{run_dir}/report", *group])
        for mode in group:
            rows += read(folder / "report" / mode)
    return rows


def read(folder: str | Path) -> list[dict]:
    """The rank<R>.json files of one report, in rank order."""
    return jsonl.read_ranks(folder)


def table(rows: list[dict]) -> list[dict]:
    """Per mode and rank: what loading and sharding cost in time and host memory (MiB: the peak
    resident set, and the sampled peaks of its anonymous and file-backed parts), whether the rank
    read the checkpoint, and the first 12 hex digits of the digests of what it holds and of a
    forward's logits (equal: the same bytes)."""
    return [{"mode": r["mode"], "rank": r["rank"], "read the checkpoint": r["read_checkpoint"],
             "seconds": r["seconds"], "host MiB before": r["rss_before_mib"],
             "host MiB peak": r["peak_rss_mib"],
             "load's MiB": round(r["peak_rss_mib"] - r["rss_before_mib"], 1),
             "anon MiB peak": r.get("peak_anon_mib"), "file MiB peak": r.get("peak_file_mib"),
             "model MiB at most": r.get("model_most_mib"),
             "model MiB sharded": r.get("model_sharded_mib"),
             "digest": r["digest"][:12],
             "logits": r.get("logits_digest", "")[:12]} for r in rows]  # fmt: skip


BARS = (("file MiB peak", "peak_file_mib", "the checkpoint file mapped (peak)"),
        ("model MiB at most", "model_most_mib", "the model's bytes while loading (most)"),
        ("model MiB sharded", "model_sharded_mib", "the model's bytes once sharded"))


def plot(rows: list[dict], ax=None):
    """The per-rank memory of each mode as grouped bars: for every (mode, rank) the file mapped,
    the model's bytes at most while loading and once sharded (MiB, the rows' own numbers).
    Draws into `ax` (a new figure when None) and returns the axes."""
    import matplotlib.pyplot as plt

    if ax is None:
        _, ax = plt.subplots(figsize=(9, 3.8))
    groups = [f"{r['mode']}\nrank {r['rank']}" for r in rows]
    width, top = 0.8 / len(BARS), 0.0
    for i, (_, key, label) in enumerate(BARS):
        values = [r.get(key) or 0 for r in rows]
        top = max(top, *values)
        xs = [g + (i - (len(BARS) - 1) / 2) * width for g in range(len(rows))]
        bars = ax.bar(xs, values, width, label=label)
        ax.bar_label(bars, fmt="%.0f", fontsize=7)
    ax.set_xticks(range(len(rows)), groups)
    ax.set_ylim(0, top * 1.3)  # room for the legend above the bars
    ax.set_ylabel("MiB per rank")
    ax.set_title("what each rank held while loading, per model.loading mode")
    ax.legend(fontsize=8, loc="upper center", ncol=len(BARS))
    return ax
