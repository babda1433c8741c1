"""The recipe on one page (notebooks/plain_recipe.py, no kit inside) against the kit's own run:
the same model folder, the same rows, the same settings, each under torchrun; their losses step
by step, and what the kit adds beyond the page.

    rows = write_rows("launch/nb05a/rows.jsonl", 32)       # the kit's sample text, first 32 rows
    folder = model_folder()                                # kit:tiny-llama, built once (a child)
    plain = run_plain(folder, rows, steps=6, out_dir="launch/nb05a")
    kit = run_kit(rows, steps=6, out_dir="launch/nb05a")
    plot(plain, kit); print(table(plain, kit)); print(additions())

The page takes the tiny config's values as its defaults (batch 8 per process, 32 tokens, lr 1e-2,
warmup 2 then cosine, clipping at 1.0, LoRA r 8 / alpha 16 on every linear layer, seed 42), and
KIT_SETTINGS makes the kit's run the page's where the two differ: no LoRA dropout (the page has
none, so the two draw no random numbers in training), every row trains (no held-out split), and
nothing written but metrics.

Kernel side: imports no torch; the ranks are torchrun's processes.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

from kit import ROOT

SCRIPT = ROOT / "notebooks" / "plain_recipe.py"
SAMPLE = ROOT / "kit" / "data" / "sample.jsonl"
MODEL = "kit:tiny-llama"
CONFIG = "tiny-cpu"  # the page's defaults are this config's values
# The page's options and the kit's config fields that take the same values.
PAGE_FLAGS = {"--steps": "training.steps", "--batch": "training.batch_size",
              "--seq": "data.max_seq_len", "--lr": "training.lr", "--seed": "training.seed",
              "--device": "training.device"}  # fmt: skip
# What else makes the kit's training the page's: the page has no LoRA dropout (the tiny config
# 0.05) and holds no rows out (the tiny config 10%).
SAME_TRAINING = ("lora.dropout=0", "data.val_fraction=0")
# And what keeps the kit's run short: no evaluation but the last, nothing written but metrics.
KIT_SETTINGS = (*SAME_TRAINING, "training.eval_every=0", "checkpointing.save_adapter=false",
                "checkpointing.save_probe_logits=false", "run.start_over=true")  # fmt: skip
LOSS_LINE = re.compile(r"^step (\d+) loss ([0-9.eE+-]+|nan|inf)$", re.M)


def write_rows(path: str | Path, n: int = 32) -> Path:
    """The first `n` rows of the kit's sample text (kit/data/sample.jsonl) into `path`."""
    lines = SAMPLE.read_text().splitlines()
    if not 1 <= n <= len(lines):
        raise ValueError(f"rows: {n} is not allowed; expected 1 to {len(lines)} (the sample's rows)")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines[:n]) + "\n")
    return path


def model_folder(model: str = MODEL) -> str:
    """The folder from_pretrained reads for `model` (a kit model is built there once, in a child
    process: this kernel imports no torch)."""
    from kit.run import child

    return child.call("kit.inputs.builtin:resolve", name=model, timeout=600)


def command(folder: str, rows: str | Path, steps: int = 6, nproc: int = 2,
            device: str = "cpu") -> list[str]:  # fmt: skip
    """The torchrun command line that runs the page (--standalone: a free port of its own)."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone",
            f"--nproc_per_node={nproc}", str(SCRIPT), str(folder), str(rows),
            f"--steps={steps}", f"--device={device}"]  # fmt: skip


def run_plain(folder: str, rows: str | Path, steps: int = 6, nproc: int = 2, device: str = "cpu",
              out_dir: str | Path = "launch/nb05a", timeout: float = 600) -> list[float]:
    """Run the page under torchrun; its output goes to OUT_DIR/plain.log. Returns rank 0's loss
    per step (the mean over the ranks); RuntimeError with the log's tail if it fails."""
    from kit.run import child

    log = _rooted(Path(out_dir) / "plain.log")
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "w") as out:
        proc = subprocess.Popen(command(folder, rows, steps, nproc, device), cwd=ROOT,
                                stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)  # fmt: skip
        try:
            proc.wait(timeout=timeout)
        except BaseException:  # a timeout, or a stop in the notebook: no rank left behind
            child.kill_tree(proc)
            raise
    losses = read_losses(log.read_text())
    if proc.returncode != 0 or len(losses) != steps:
        raise RuntimeError(f"{SCRIPT.name} exited with {proc.returncode} after {len(losses)} of "
                           f"{steps} steps; its log {log}:\n{log.read_text()[-3000:]}")
    return losses


def read_losses(text: str) -> list[float]:
    """The page's loss per step from its output (`step N loss X` lines, rank 0's)."""
    return [float(loss) for _, loss in LOSS_LINE.findall(text)]


def overrides_for(page_args: list[str]) -> list[str]:
    """The kit's key=value overrides for a page command line's options (["--lr", "5e-3", ...]),
    with SAME_TRAINING: on the tiny config, the kit then trains as that command does."""
    if len(page_args) % 2 or any(flag not in PAGE_FLAGS for flag in page_args[::2]):
        raise ValueError(f"page_args: {page_args} is not allowed; expected option, value pairs "
                         f"of {', '.join(PAGE_FLAGS)}")
    return [f"{PAGE_FLAGS[flag]}={value}" for flag, value in zip(page_args[::2], page_args[1::2],
                                                                 strict=True)] + list(SAME_TRAINING)


def kit_overrides(rows: str | Path, steps: int, device: str, out_dir: str | Path) -> list[str]:
    """What the kit's run is given on top of its tiny config: the page's model, rows, steps and
    device, SAME_TRAINING, and a short run's settings; its folder OUT_DIR/kit."""
    return [f"model.name={MODEL}", f"data.path={rows}",
            *overrides_for(["--steps", str(steps), "--device", device]), *KIT_SETTINGS[2:],
            f"run.output_dir={Path(out_dir) / 'kit'}"]  # fmt: skip


def kit_choices(out_dir: str | Path = "launch/nb05a") -> str:
    """What the kit's run (OUT_DIR/kit) chose for itself: its plan line and how it loaded."""
    from kit.run.runs import Run

    result = Run(_rooted(Path(out_dir) / "kit")).result() or {}
    return f"{result['plan']['line']}\nmodel loading: {result['load']['mode']}"


def _rooted(path: str | Path) -> Path:
    """A relative path under the checkout, where runs and their folders live."""
    return Path(path) if Path(path).is_absolute() else ROOT / path


def run_kit(rows: str | Path, steps: int = 6, nproc: int = 2, device: str = "cpu",
            out_dir: str | Path = "launch/nb05a", timeout: float = 600) -> list[float]:
    """The kit's recipe (torchrun -m kit.train, through kit.run.launch) on the same rows; its
    run folder is OUT_DIR/kit. Returns the loss per step from its metrics.jsonl."""
    from kit.run import launch

    run = launch.run_to_end(CONFIG, kit_overrides(rows, steps, device, out_dir), nproc=nproc,
                            timeout=timeout)  # fmt: skip
    return [r["loss"] for r in run.metrics() if r["split"] == "train"]


class MarkdownText(str):
    """Markdown that a notebook renders (a table) and that stays readable as plain text where no
    frontend does (an executed copy read as text, a terminal)."""

    def _repr_markdown_(self) -> str:
        return str(self)

    def __repr__(self) -> str:
        return str(self)


def table(plain: list[float], kit: list[float]) -> MarkdownText:
    """A Markdown table: step, the page's loss, the kit's, their relative difference."""
    lines = ["| step | plain_recipe.py | kit.train | relative difference |", "|---:|---:|---:|---:|"]
    for step, (a, b) in enumerate(zip(plain, kit, strict=True), 1):
        lines.append(f"| {step} | {a:.8f} | {b:.8f} | {abs(a - b) / abs(b):.1e} |")
    return MarkdownText("\n".join(lines))


def plot(plain: list[float], kit: list[float]):
    """The two loss curves side by side, on one scale; each panel shows the other run faintly."""
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 3.2), sharey=True)
    runs = [("plain_recipe.py (no kit)", plain, "tab:blue"), ("kit.train", kit, "tab:orange")]
    for ax, (name, losses, color), (_, other, other_color) in zip(axes, runs, runs[::-1],
                                                                  strict=True):
        steps = range(1, len(losses) + 1)
        ax.plot(range(1, len(other) + 1), other, color=other_color, lw=6, alpha=0.25,
                label="the other run")
        ax.plot(steps, losses, "o-", color=color, label=name.split(" ")[0])
        ax.set(title=name, xlabel="step", xticks=list(steps))
        ax.legend(frameon=False)
    axes[0].set_ylabel("training loss (mean over ranks)")
    fig.tight_layout()
    return axes


def page_facts(path: Path = SCRIPT) -> dict:
    """The page's length (lines; code lines: neither blank nor comment nor docstring) and the
    top-level packages it imports."""
    text = path.read_text()
    tree = ast.parse(text)
    doc = tree.body[0] if tree.body and isinstance(tree.body[0], ast.Expr) else None
    skip = set(range(doc.lineno, doc.end_lineno + 1)) if doc else set()
    code = [n for n, line in enumerate(text.splitlines(), 1)
            if n not in skip and line.strip() and not line.strip().startswith("#")]
    imported = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import)
                for a in n.names}  # fmt: skip
    imported |= {n.module.split(".")[0] for n in ast.walk(tree)
                 if isinstance(n, ast.ImportFrom) and n.module}  # fmt: skip
    return {"lines": len(text.splitlines()), "code_lines": len(code), "imports": sorted(imported)}


# What the kit adds beyond the page: (what the page does, what the kit does instead, the kit's
# functions as "module:qualified name", the notebooks that teach it).
ADDITIONS = [
    ("finds a mistake in a rank, after loading, as a traceback from every rank",
     "checks the config, model folder, data rows, machine and run folder before any process: one "
     "line per problem", ["kit.run.check:check", "kit.doctor.preflight:preflight"], "07, 11"),
    ("fixes batch, attention and recomputation by hand",
     "plans every value left at auto from the model's shape and the devices' memory",
     ["kit.budget.plan:plan", "kit.budget.estimate:estimate"], "01, 09"),
    ("reads the whole model on every rank",
     "reads each unit just before FSDP shards it (or on rank 0 only)",
     ["kit.recipe.loading:load"], "04, 10"),
    ("keeps the order because its reader does",
     "keeps it in one function, and refuses a run that breaks it: layers in eval mode, ranks "
     "with different adapters, adapters that have not moved after 3 steps",
     ["kit.recipe.model:build", "kit.recipe.checks:check_checkpointing_active",
      "kit.recipe.checks:same_init", "kit.recipe.checks:check_lora_changed"], "05"),
    ("recomputes whole layers",
     "chooses what a layer keeps (its inputs, or the matmuls' results) and the attention kernel",
     ["kit.recipe.recompute:apply", "kit.recipe.quantize:attention_implementation"], "06"),
    ("upcasts the whole batch's logits for the loss",
     "computes the loss a chunk of tokens at a time, or with the output head fused into it",
     ["kit.recipe.levers.loss:install"], "01, 09"),
    ("shards the decoder layers and the root",
     "also the embeddings as a unit of their own, the root kept gathered into backward, no "
     "prefetch of what backward never reaches",
     ["kit.recipe.engines:FSDP2.wrap"], "04"),
    ("steps torch's AdamW over DTensors",
     "the same update on each rank's local shard (less host time per step)",
     ["kit.recipe.optim:ShardAdamW", "kit.recipe.optim:clip_grad_norm"], "05"),
    ("reads {\"text\"} rows, trains on every token",
     "text, chat and ShareGPT rows checked row by row, loss on the assistant's turns, packing, "
     "a held-out split, gradient accumulation",
     ["kit.recipe.data:build_datasets", "kit.inputs.datafile:read_checked"], "12"),
    ("saves nothing",
     "saves and verifies the adapter, checkpoints every N steps, resumes step for step, merges",
     ["kit.recipe.checkpoint:save_training_state", "kit.recipe.checkpoint:load_training_state",
      "kit.inference.merge:merge_adapter"], "08"),
    ("prints a loss",
     "writes metrics.jsonl, evaluates held-out loss, stops on NaN, names a slow rank",
     ["kit.train:Recipe.evaluate", "kit.recipe.checks:check_step",
      "kit.recipe.checks:step_warnings"], "07, 11"),
    ("dies on a stop signal",
     "turns SIGTERM/SIGUSR1 into a checkpoint and exit code 75, resumable",
     ["kit.recipe.preempt:Preemption"], "08"),
    ("is started by typing torchrun",
     "writes a run folder (config.yaml, run.sh) started from the notebook, Slurm or Kubernetes",
     ["kit.run.launch:launch", "kit.run.jobs:write"], "07, 10"),
]


def defined(target: str) -> bool:
    """Whether "module:qualified.name" is defined in the kit's source (read, not imported: the
    rank side's modules import torch)."""
    module, _, qualname = target.partition(":")
    path = ROOT / Path(*module.split("."))
    path = path / "__init__.py" if path.is_dir() else path.with_suffix(".py")
    if not path.is_file():
        return False
    body = ast.parse(path.read_text()).body
    for part in qualname.split("."):
        found = [n for n in body if isinstance(n, (ast.FunctionDef, ast.ClassDef))
                 and n.name == part]  # fmt: skip
        if not found:
            return False
        body = found[0].body
    return True


def additions() -> MarkdownText:
    """ADDITIONS as a Markdown table; a function that moved or was renamed raises."""
    missing = [t for *_, targets, _ in ADDITIONS for t in targets if not defined(t)]
    if missing:
        raise LookupError(f"kit.lab.plain_recipe.ADDITIONS names what the kit no longer defines: "
                          f"{', '.join(missing)}")
    lines = ["| the page | the kit | its functions | notebook |", "|---|---|---|---|"]
    for page, kit, targets, notebooks in ADDITIONS:
        names = ", ".join(f"`{t.replace(':', '.')}`" for t in targets)
        lines.append(f"| {page} | {kit} | {names} | {notebooks} |")
    return MarkdownText("\n".join(lines))


def summary(plain: list[float], kit: list[float]) -> str:
    """One line: steps, first and last loss of each, the largest relative difference."""
    worst = max(abs(a - b) / abs(b) for a, b in zip(plain, kit, strict=True))
    return (f"{len(plain)} steps; plain_recipe.py {plain[0]:.4f} -> {plain[-1]:.4f}, kit.train "
            f"{kit[0]:.4f} -> {kit[-1]:.4f}; largest relative difference {worst:.1e}")
