"""Activation recomputation measured: the recipe, run once per setting, side by side.

    rows = sweep(["training.recompute.enabled=false", "training.recompute.every=2",
                  "training.recompute.keeps=matmuls"], nproc=1, steps=4)
    plot(rows)

A setting is named by the config values themselves: one or more `key=value` overrides, separated
by spaces, exactly as a command line or run.sh takes them; there is no other vocabulary. Each one
is a run of the recipe (kit.train: NF4, LoRA, FSDP) through kit.run.launch.run_to_end, the same path
on CPU and GPU: a run folder under `out_dir` (run.sh, config.yaml, metrics.jsonl, run.log) that a
person can open or re-run. Peak memory is the recipe's own `peak_mem_gib` (GPU: the rank's
max_memory_allocated; CPU: the rank process's peak RSS, which includes the interpreter and its
libraries, so only differences between settings mean anything there).

Kernel side: imports no torch; the ranks are torchrun's processes.
"""

from __future__ import annotations

import re
import statistics
from pathlib import Path

from kit.run import launch
from kit.run.check import check

# What every run of the sweep gets, before its setting: a short run that writes nothing but
# metrics (no adapter, no probe logits, no validation until the end) and may start over
# (an earlier run of the same setting moves into its earlier/).
SHORT_RUN = ("training.eval_every=0", "checkpointing.save_adapter=false",
             "checkpointing.save_probe_logits=false", "run.start_over=true")  # fmt: skip


def folder_name(setting: str) -> str:
    """The run folder of a setting: its overrides with '=' and spaces made folder-safe."""
    return re.sub(r"[^A-Za-z0-9._-]+", "-", setting.strip())


def sweep(settings, model: str = "kit:tiny-llama", nproc: int = 1, steps: int = 4,
          seq_len: int = 256, batch_size: int = 4, device: str = "auto",
          config: str = "tiny-cpu", overrides=(), out_dir="launch/recompute",
          timeout: float = 900) -> list[dict]:  # fmt: skip
    """One `torchrun --nproc_per_node=NPROC -m kit.train` run per setting, in turn; a row each.

    settings: override strings, e.g. "training.recompute.every=2" (several: separated by
    spaces). `overrides` go to every run, before its setting. Every config is resolved first, so
    a bad setting is a ConfigError naming the field before anything runs. A run that fails or
    passes `timeout` seconds (it is stopped, every process of it) is a row with its error.

    Row: setting; enabled, every, keeps (training.recompute as the run read it); peak_mem_gib
    (the largest of the train steps'); step_s and tokens_per_s (medians over the steps after the
    first, which warms up); final_loss; error; folder."""
    common = [f"model.name={model}", f"training.steps={steps}", f"data.max_seq_len={seq_len}",
              f"training.batch_size={batch_size}", f"training.device={device}", *SHORT_RUN,
              *overrides]  # fmt: skip
    if nproc < 1:
        raise ValueError(f"nproc: {nproc} is not allowed; expected the processes per run, >= 1 "
                         "(every setting is a torchrun run, on CPU too)")  # fmt: skip
    if not all(s.strip() for s in settings):
        raise ValueError(f"settings: {list(settings)} holds an empty setting; name its overrides, "
                         "e.g. 'training.recompute.enabled=true'")  # fmt: skip
    if len({folder_name(s) for s in settings}) != len(settings):
        raise ValueError(f"settings: {list(settings)} name the same run folder twice")
    runs = []
    for setting in settings:
        name = folder_name(setting)
        cfg = launch.resolve(config, [*common, f"run.output_dir={Path(out_dir) / name}",
                                      *setting.split()], name=name)  # fmt: skip
        check(cfg, nproc)  # the check step: model, data, machine, run folder; nothing written
        runs.append((setting, cfg))
    return [_row(setting, cfg, nproc, timeout) for setting, cfg in runs]


def _row(setting: str, cfg, nproc: int, timeout: float) -> dict:
    recompute = cfg.training.recompute
    row = {"setting": setting, "enabled": recompute.enabled, "every": recompute.every,
           "keeps": recompute.keeps, "nproc": nproc, "peak_mem_gib": None, "step_s": None,
           "tokens_per_s": None, "final_loss": None, "error": None,
           "folder": str(launch.run_dir(cfg))}  # fmt: skip
    try:
        run = launch.run_to_end(cfg, nproc=nproc, timeout=timeout, check=False)
    except TimeoutError as e:
        return {**row, "error": str(e).splitlines()[0]}
    if run.status != "completed":
        failure = run.failure()
        where = f"rank {failure.rank}: " if failure.rank is not None else ""
        return {**row, "error": (where + failure.message.splitlines()[0])[:400]}
    train = [r for r in run.metrics() if r["split"] == "train"]
    if not train:
        return {**row, "error": f"no train steps in {run.files.metrics}"}
    timed = train[1:] or train
    # keeps "auto": the policy the run's plan chose (result.json, kit.budget.plan)
    chosen = {f: v for f, v, _ in ((run.result() or {}).get("plan") or {}).get("choices", [])}
    row["keeps"] = chosen.get("training.recompute.keeps", row["keeps"])
    return {**row, "peak_mem_gib": max(r["peak_mem_gib"] for r in train),
            "step_s": statistics.median(r["step_s"] for r in timed),
            "tokens_per_s": statistics.median(r["tokens_per_s"] for r in timed),
            "final_loss": (run.result() or {}).get("final_loss")}  # fmt: skip


def plot(rows: list[dict], axes=None):
    """Peak memory and step time per setting (bars; the settings that ran)."""
    import matplotlib.pyplot as plt

    ok = [r for r in rows if r["error"] is None]
    axes = axes if axes is not None else plt.subplots(1, 2, figsize=(11, 0.8 + 0.45 * len(ok)))[1]
    names = [r["setting"] for r in ok]
    axes[0].barh(names, [r["peak_mem_gib"] for r in ok])
    axes[0].set_xlabel("peak GiB per rank")
    axes[1].barh(names, [r["step_s"] for r in ok], color="tab:orange")
    axes[1].set_xlabel("seconds per step (median)")
    axes[1].set_yticklabels([])
    for ax in axes:
        ax.invert_yaxis()  # the settings top to bottom, in the order they ran
    axes[0].figure.tight_layout()
    return axes
