"""What a QLoRA model really holds, measured with torch: the bytes autograd saves for backward,
and a rank's runtime before any model. The estimate these are checked against is kit.budget.estimate.

    m = measured_vs_estimated("kit:tiny-llama", batch_size=8)   # builds on CPU, in this process
    m = child.call("kit.lab.memory:measured_vs_estimated", batch_size=8)   # from a notebook kernel
    saved = measure_saved_activations(built.model, batch_size=1, seq_len=256)
    rows = long_context_levers("kit:tiny-llama", seq_len=256)   # attention tiles, lean norms

Rank/child side: each function runs torch in the process that calls it (a rank, a script, a test,
a kit.run.child process started from notebook 01's kernel); `runtime_baseline_gib` starts a fresh
interpreter of its own. torch is imported inside the functions, so importing this module is cheap.
`plot_against_measured` is kernel side: it draws rows of kit.budget.measured.compare_with_reference.
"""

from __future__ import annotations

from kit import ROOT
from kit.budget.estimate import Setup, activation_bytes_per_token_layer
from kit.budget.shapes import shape_of


def saved_bytes(fn, exclude=frozenset()):
    """(fn()'s result, bytes autograd saves for backward while fn runs): each storage once, less
    those whose data pointers are in `exclude` (weights, an input alive anyway)."""
    import torch

    seen: dict[int, int] = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in exclude:
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return out, sum(seen.values())


def measure_saved_activations(model, batch_size: int, seq_len: int, vocab: int | None = None) -> int:
    """Bytes autograd saves for backward in one forward of `model` (a torch module on CPU or GPU),
    counted through saved-tensor hooks, each storage once. Parameters that autograd saves are
    included; compare two sequence lengths to get the per-token part."""
    import torch

    vocab = vocab or model.config.vocab_size
    ids = torch.randint(0, vocab, (batch_size, seq_len), generator=torch.Generator().manual_seed(0))
    ids = ids.to(next(model.parameters()).device)
    loss, kept = saved_bytes(lambda: model(input_ids=ids, labels=ids, use_cache=False).loss)
    loss.backward()
    model.zero_grad(set_to_none=True)
    return kept


def measured_vs_estimated(model: str = "kit:tiny-llama", batch_size: int = 8,
                          seq_lens: tuple[int, int] = (32, 64)) -> dict:  # fmt: skip
    """Bytes autograd saves per token per decoder layer, measured on a kit model built on CPU in
    this process (kit.recipe.model.build: NF4 + LoRA as the recipe builds it, no process group), vs the
    estimate.

    Measured as (saved without recompute - saved with it) per token per layer at two sequence
    lengths; the difference removes parameters and everything outside the decoder layers."""
    import torch

    from kit.config import load_config
    from kit.recipe import model as kmodel

    saved, cfg = {}, None
    for recompute in (False, True):
        cfg = load_config(ROOT / "kit" / "configs" / "tiny-cpu.yaml",
                          [f"model.name={model}", "training.device=cpu",
                           f"training.recompute.enabled={str(recompute).lower()}"])  # fmt: skip
        built = kmodel.build(cfg, torch.device("cpu"))
        saved[recompute] = [measure_saved_activations(built.model, batch_size, s) for s in seq_lens]
    shape = shape_of(model)
    tokens = batch_size * (seq_lens[1] - seq_lens[0])
    per_layer = ((saved[False][1] - saved[False][0]) - (saved[True][1] - saved[True][0]))
    setup = Setup.from_config(cfg, world_size=1)
    return {
        "measured_bytes_per_token_layer": per_layer / tokens / shape.layers,
        "estimated_bytes_per_token_layer": activation_bytes_per_token_layer(shape, setup),
        "saved_bytes": {"no checkpointing": saved[False], "checkpointing": saved[True]},
        "seq_lens": seq_lens,
    }


def long_context_levers(model: str = "kit:tiny-llama", seq_len: int = 256, tile: int = 64) -> list:
    """One sequence through a bf16 `model` (its weights trained, as a long-context step trains
    them), once per setting: the attention block whole; in tiles of `tile` queries
    (kit.recipe.levers.attention_tiles); and tiled with lean RMSNorms (kit.recipe.levers.norms). Per setting:
    the bytes autograd keeps (weights not counted), the loss, and the largest gradient difference
    from the whole block's, relative to the largest gradient."""
    import torch
    from transformers import AutoModelForCausalLM

    from kit.inputs import builtin
    from kit.recipe.levers.attention_tiles import tile_attention
    from kit.recipe.levers.norms import lean_norms

    ids = torch.randint(3, 1000, (1, seq_len), generator=torch.Generator().manual_seed(0))
    rows, base = [], None
    for name in ("attention whole", "attention in tiles", "tiles + lean norms"):
        torch.manual_seed(0)
        m = AutoModelForCausalLM.from_pretrained(builtin.resolve(model), dtype=torch.bfloat16)
        m.train()
        if name != "attention whole":
            tile_attention(m, tile)
        if name == "tiles + lean norms":
            lean_norms(m)
        weights = {p.untyped_storage().data_ptr() for p in m.parameters()}
        loss, kept = saved_bytes(lambda m=m: m(input_ids=ids, labels=ids, use_cache=False).loss,
                                 weights)
        loss.backward()
        grads = torch.cat([p.grad.float().flatten() for p in m.parameters() if p.grad is not None])
        base = grads if base is None else base
        rows.append({"setting": name, "kept_kib": round(kept / 1024, 1),
                     "loss": round(loss.item(), 4),
                     "grad_difference": round(((grads - base).abs().max()
                                               / base.abs().max()).item(), 4)})
    return rows


def runtime_baseline_gib() -> float:
    """Peak RSS of a fresh Python that imported what a rank imports (torch, transformers, peft,
    bitsandbytes, datasets, the recipe): the part of a CPU rank's memory that does not depend on
    the model. Read from /proc's VmHWM: getrusage's ru_maxrss survives exec on Linux, so a child
    of a large notebook kernel would report the kernel's size."""
    import subprocess
    import sys

    code = (
        "import resource, torch, torch.distributed, transformers, peft, bitsandbytes, datasets\n"
        "from transformers import AutoModelForCausalLM\nimport kit.train\n"
        "try:\n    print([l for l in open('/proc/self/status') if l.startswith('VmHWM')][0].split()[1])\n"
        "except (OSError, IndexError):\n"
        "    print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)\n"
    )  # fmt: skip
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=ROOT)  # fmt: skip
    return int(out.stdout.split()[-1]) / 2**20  # KiB -> GiB


def plot_against_measured(groups: dict[str, list[dict]], band: float = 0.10, ax=None):
    """Estimated against measured peak GiB, one point per row of
    kit.budget.measured.compare_with_reference, one marker per group (label -> rows); the
    diagonal is an exact estimate, the grey band +-`band` around it."""
    import matplotlib.pyplot as plt

    ax = ax or plt.subplots(figsize=(5.5, 5))[1]
    rows = [r for group in groups.values() for r in group]
    top = 1.1 * max(max(r["measured_gib"], r["estimated_gib"]) for r in rows)
    line = [0, top]
    ax.fill_between(line, [0, top * (1 - band)], [0, top * (1 + band)], color="0.9",
                    label=f"within {band:.0%}")  # fmt: skip
    ax.plot(line, line, color="k", lw=1, label="estimate = measured")
    for (label, group), marker in zip(groups.items(), "osD^vP*X", strict=False):
        ax.scatter([r["measured_gib"] for r in group], [r["estimated_gib"] for r in group],
                   marker=marker, label=label, zorder=3)  # fmt: skip
    ax.set(xlim=(0, top), ylim=(0, top), xlabel="measured peak, GiB (max_memory_allocated)",
           ylabel="estimated, GiB (kit.budget.estimate)", aspect="equal")  # fmt: skip
    ax.legend(fontsize=8, loc="lower right")
    return ax
