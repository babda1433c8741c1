"""Notebook 05's order of operations, kernel side: run every case in one torchrun launch, read what
each measured, and show the code that ran.

    results = run(out="launch/nb05")      # python -m kit.lab.order_rank under torchrun, 2 ranks
    source("optimizer_first")             # a case's code, read from kit/lab/order_rank.py
    table(results, "optimizer")           # each order next to the recipe's, measured (a DataFrame)
    losses(results)                       # every step's loss of every run (a DataFrame)

The cases are kit/lab/order_rank.py (rank side): `recipe_order`, the order the recipe follows, and the
same lines with one step moved. Rank 0 writes <out>/cases/<function>-<engine>-<base>.json for
each run; this module starts the launch (kit.run.launch.run_to_end: <out>/config.yaml, run.sh,
run.log) and reads the files. No torch.
"""

from __future__ import annotations

import ast
import json
import shutil
from pathlib import Path

import pandas as pd

from kit.run.launch import run_to_end

RANK_SIDE = Path(__file__).with_name("order_rank.py")

# Each case of the notebook: the runs its table sets side by side, and the columns it shows.
CASES = {
    "optimizer": ([("optimizer_first", "fsdp2", "nf4"), ("recipe_order", "fsdp2", "nf4"),
                   ("optimizer_first", "fsdp1", "nf4"), ("recipe_order", "fsdp1", "nf4")],
                  ("loss", "moved", "losses vs recipe_order", "optimizer holds",
                   "with a gradient")),
    "lora": ([("lora_after_shard", "fsdp2", "nf4"), ("lora_after_shard", "fsdp1", "nf4"),
              ("recipe_order", "fsdp2", "nf4"), ("recipe_order", "fsdp1", "nf4"),
              ("lora_after_shard", "fsdp2", "bf16"), ("recipe_order", "fsdp2", "bf16")],
             ("loss", "LoRA trainable", "LoRA sharded", "ranks' LoRA")),
    "checkpointing": ([("checkpointing_after_shard", "fsdp2", "nf4"), ("recipe_order", "fsdp2", "nf4"),
                       ("checkpointing_after_shard", "fsdp1", "nf4"), ("recipe_order", "fsdp1", "nf4")],
                      ("layer forwards", "bytes kept", "loss", "losses vs recipe_order")),
    "train": ([("no_train_mode", "fsdp2", "nf4"), ("recipe_order", "fsdp2", "nf4"),
               ("no_train_mode", "fsdp1", "nf4"), ("recipe_order", "fsdp1", "nf4")],
              ("layers in train mode", "LoRA dropout on", "layer forwards", "bytes kept",
               "losses vs recipe_order")),
    "device_map": ([("device_map_auto", "fsdp2", "nf4"), ("recipe_order", "fsdp2", "nf4"),
                    ("device_map_auto", "fsdp1", "nf4"), ("recipe_order", "fsdp1", "nf4")],
                   ("weights on", "hf_device_map", "accelerate hooks", "loss",
                    "losses vs recipe_order")),
}  # fmt: skip


def _of(r: dict, a: str, b: str) -> str:
    return f"{r[a]} of {r[b]}" if a in r and b in r else "-"


def _loss(r: dict, results: dict) -> str:
    if r["error"]:
        return r["error"]
    # One decimal: after six bf16 steps the loss differs in the third decimal between CPUs whose
    # bf16 kernels differ (recipe_order ended at 6.6747 on one, 6.675 or above on another, so two
    # decimals printed 6.67 and 6.68). What the table teaches is that it moved; the columns
    # beside it compare the losses at full precision.
    return f"{r['losses'][0]:.1f} -> {r['losses'][-1]:.1f}"


def _moved(r: dict, results: dict) -> str:
    if not r.get("losses"):
        return "-"
    return "yes" if len(set(r["losses"])) > 1 else "no: the same at every step"


def _as_recipe(r: dict, results: dict) -> str:
    """The run's losses against recipe_order's (same engine and base), step by step."""
    recipe = results.get(("recipe_order", r["engine"], r["base"]), {}).get("losses")
    if not r.get("losses") or not recipe or r["function"] == "recipe_order":
        return "-"
    return "identical" if r["losses"] == recipe else "differ"


def _ranks(r: dict, results: dict) -> str:
    if "ranks_differ_by" not in r:
        return "-"  # FSDP1: each rank holds a piece of one flat buffer, nothing to compare
    return "equal" if r["ranks_differ_by"] == 0 else "differ"


def _sharded(r: dict, results: dict) -> str:
    # FSDP2 shards each parameter into a DTensor; FSDP1's pieces of a flat buffer are not counted
    return _of(r, "lora_sharded", "lora_tensors") if "ranks_differ_by" in r else "-"


# column -> what a run's record shows under it ("-": not measured, e.g. the run raised first)
COLUMNS = {
    "loss": _loss,
    "moved": _moved,
    "losses vs recipe_order": _as_recipe,
    "optimizer holds": lambda r, _: _of(r, "optimizer_holds", "trainable"),
    "with a gradient": lambda r, _: _of(r, "optimizer_with_grad", "optimizer_tensors"),
    "LoRA trainable": lambda r, _: _of(r, "lora_trainable", "lora_tensors"),
    "LoRA sharded": _sharded,
    "ranks' LoRA": _ranks,
    "layer forwards": lambda r, _: f"{r['layer_forwards']} ({r['layers']} layers)"
    if "layer_forwards" in r else "-",
    "bytes kept": lambda r, _: f"{r['bytes_kept']:,}" if "bytes_kept" in r else "-",
    "layers in train mode": lambda r, _: _of(r, "layers_in_train_mode", "layers"),
    "LoRA dropout on": lambda r, _: _of(r, "lora_dropout_active", "lora_dropouts"),
    "weights on": lambda r, _: ", ".join(r.get("placed", [])) or "-",
    "hf_device_map": lambda r, _: str(r.get("device_map") or "none"),
    "accelerate hooks": lambda r, _: str(r.get("accelerate_hooks", "-")),
}


def run(nproc: int = 2, steps: int = 6, device: str = "cpu", out: str | Path = "launch/nb05",
        config: str = "tiny-cpu") -> dict[tuple, dict]:  # fmt: skip
    """Every case of kit/lab/order_rank.py, each under FSDP2 and FSDP1, in turn in one torchrun
    launch of `nproc` ranks on `device`, `steps` optimizer steps each; returns read(out)."""
    out = Path(out).resolve()
    shutil.rmtree(out / "cases", ignore_errors=True)  # no result of an earlier launch is read
    overrides = [f"run.output_dir={out}", f"training.device={device}", f"training.steps={steps}"]
    run_to_end(config, overrides, nproc=nproc, module="kit.lab.order_rank",
               args=["{config}", "{run_dir}"])  # fmt: skip
    return read(out)


def read(out: str | Path) -> dict[tuple, dict]:
    """{(function, engine, base): what rank 0 recorded}, in the order the runs ran."""
    records = [json.loads(p.read_text()) for p in (Path(out) / "cases").glob("*.json")]
    if not records:
        raise FileNotFoundError(f"{out}: no cases here (run() writes them)")
    return {(r["function"], r["engine"], r["base"]): r
            for r in sorted(records, key=lambda r: r["index"])}  # fmt: skip


def summary(results: dict) -> str:
    """One line: how many runs, where, and the library versions that ran them."""
    first = next(iter(results.values()))
    failed = sum(not r["ok"] for r in results.values())
    versions = ", ".join(f"{k} {v}" for k, v in first.get("versions", {}).items())
    return (f"{len(results)} runs ({failed} raised), {first['ranks']} ranks on {first['device']}, "
            f"{len(first.get('losses', []))} steps each; {versions}")


def table(results: dict, case: str) -> pd.DataFrame:
    """The runs of one case (CASES) side by side: engine, base, order, then its columns."""
    runs, columns = CASES[case]
    rows = [(e, b, f, *(COLUMNS[c](results[(f, e, b)], results) for c in columns)) for f, e, b in runs]
    return pd.DataFrame(rows, columns=["engine", "base", "order", *columns])


def losses(results: dict) -> pd.DataFrame:
    """Every step's loss of every run that trained (rank 0's batch): a row per run, a column per
    step; a run that raised shows its error in the first column."""
    rows = {f"{f} {e} {b}": [round(x, 3) for x in r.get("losses", [])] or [r["error"]]
            for (f, e, b), r in results.items()}  # fmt: skip
    frame = pd.DataFrame.from_dict(rows, orient="index").fillna("")
    frame.columns = [f"step {i + 1}" for i in frame.columns]
    return frame


def source(*names: str, path: Path = RANK_SIDE) -> str:
    """The code of functions of kit/lab/order_rank.py ("recipe_order", or a method: "Trial.shard"),
    or of another rank-side file `path`, read from the file: what the notebook shows is what the
    ranks ran."""
    text = path.read_text()
    found = {}
    for node in ast.parse(text).body:
        if isinstance(node, ast.FunctionDef):
            found[node.name] = (node, 0)
        elif isinstance(node, ast.ClassDef):
            for item in node.body:
                if isinstance(item, ast.FunctionDef):
                    found[f"{node.name}.{item.name}"] = (item, item.col_offset)
    out = []
    for name in names:
        if name not in found:
            raise KeyError(f"{path.name} has no function {name!r}")
        node, indent = found[name]
        lines = ast.get_source_segment(text, node, padded=True).splitlines()
        out.append("\n".join(line[indent:] for line in lines))
    return "\n\n".join(out)


def plot_losses(results: dict, axes=None):
    """Rank 0's loss at every step of every run that trained, one panel per engine: the recipe's
    order thick and pale, each case on top of it (dashed where its losses are the recipe's, so
    hidden under it), and a run whose loss never moves in red, named on the plot. A run that
    raised has no line. One color per case in both panels."""
    import matplotlib.pyplot as plt

    engines = sorted({e for _, e, _ in results}, reverse=True)  # fsdp2, fsdp1
    if axes is None:
        _, axes = plt.subplots(1, len(engines), figsize=(5.5 * len(engines), 3.4), sharey=True)
    axes = [axes] if not hasattr(axes, "__len__") else list(axes)
    cases = sorted({f for f, _, _ in results} - {"recipe_order"})
    colors = dict(zip(cases, ["tab:blue", "tab:green", "tab:purple", "tab:brown", "tab:olive"], strict=False))
    for ax, engine in zip(axes, engines, strict=True):
        for (f, e, b), r in results.items():
            if e != engine or not r.get("losses"):
                continue
            steps, ys = range(1, len(r["losses"]) + 1), r["losses"]
            label = f"{f} ({b})"
            if f == "recipe_order":
                ax.plot(steps, ys, label=label, color="black" if b == "nf4" else "gray",
                        linewidth=5, alpha=0.2)  # fmt: skip
            elif len(set(ys)) == 1:  # the loss never moved: the lesson of section 1
                ax.plot(steps, ys, label=label, color="tab:red", linewidth=2.5, marker="o")
                ax.annotate(f"{f}: the loss never moves", (steps[-1], ys[-1]),
                            xytext=(0, -14), textcoords="offset points", ha="right",
                            color="tab:red")  # fmt: skip
            else:
                same = _as_recipe(r, results) == "identical"
                ax.plot(steps, ys, label=label, color=colors.get(f), marker=".",
                        linestyle="--" if same else "-", linewidth=1.2)  # fmt: skip
        ax.set(title=engine, xlabel="step", ylabel="loss (rank 0)")
        ax.legend(fontsize=7, loc="lower left")
    return axes


def excerpt(text: str, first: str, last: str) -> str:
    """The lines of `text` from the first one containing `first` to the next one containing
    `last`, both included, dedented: a part of a function's source, as inspect.getsource
    returns it."""
    import textwrap

    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if first in line)
    end = next(i for i, line in enumerate(lines) if i >= start and last in line)
    return textwrap.dedent("\n".join(lines[start:end + 1]))
