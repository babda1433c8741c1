"""Notebook 03's instruments: what trains and in which parameter groups, a few training steps
in the kernel, the adapter's norms, and the scale conventions run side by side. The recipe's
LoRA is kit/recipe/lora.py."""

from __future__ import annotations

import torch

from kit.lab.quantize_nf4 import load_on_cpu, one_thread
from kit.recipe.lora import sample_rows

TARGET_SETS = {
    "q, v (LoRA paper)": ["q_proj", "v_proj"],
    "attention": ["q_proj", "k_proj", "v_proj", "o_proj"],
    "all-linear (QLoRA paper)": "all-linear",
}


def injected(peft_model) -> list[dict]:
    """One row per layer PEFT wrapped: where, what it wraps, the shapes and dtype of A and B."""
    from peft.tuners.lora import LoraLayer

    rows = []
    for name, module in peft_model.named_modules():
        if isinstance(module, LoraLayer):
            a, b = module.lora_A["default"].weight, module.lora_B["default"].weight
            rows.append({
                "module": name.removeprefix("base_model.model."),
                "wraps": type(module.get_base_layer()).__name__,
                "A": tuple(a.shape), "B": tuple(b.shape), "dtype": str(a.dtype).removeprefix("torch."),
                "scale": module.scaling["default"],
            })  # fmt: skip
    return rows


# Three ways to set the scale s of y = Wx + s·BAx as the rank r changes: (r, alpha) -> what PEFT's
# LoraConfig takes (lora_alpha, use_rslora).
SCALINGS = {
    "alpha/r, alpha fixed (LoRA paper)": lambda r, alpha: (alpha, False),
    "alpha/sqrt(r), alpha fixed (rsLoRA)": lambda r, alpha: (alpha, True),
    "alpha/r, alpha = 2r (scale 2 at every r)": lambda r, alpha: (2 * r, False),
}


def parameter_groups(peft_model) -> list[dict]:
    """Parameters grouped by (trainable, dtype, kind): how many, and the bytes they occupy."""
    import bitsandbytes as bnb

    groups: dict[tuple, list[int]] = {}
    for name, p in peft_model.named_parameters():
        kind = "LoRA" if "lora_" in name else (
            "4-bit packed" if isinstance(p, bnb.nn.Params4bit) else "other")  # fmt: skip
        key = (p.requires_grad, str(p.dtype).removeprefix("torch."), kind)
        count = groups.setdefault(key, [0, 0, 0])
        count[0] += 1
        count[1] += p.numel()
        count[2] += p.numel() * p.element_size()
    return [
        {"trainable": t, "dtype": d, "kind": k, "tensors": n, "elements": e, "bytes": b}
        for (t, d, k), (n, e, b) in sorted(groups.items(), key=lambda kv: (not kv[0][0], kv[0][2]))
    ]


def trainable_table(model, ranks=(4, 8, 16, 64), target_sets=None) -> list[dict]:
    """Trainable LoRA parameters by rank and targets, counted from the model's shape alone (a
    `kit:` name, a config dict or folder: see kit.budget.shapes.shape_of)."""
    from kit.budget.shapes import lora_params, shape_of

    shape = shape_of(model)
    rows = []
    for label, targets in (target_sets or TARGET_SETS).items():
        for r in ranks:
            n = lora_params(shape, r, targets)
            rows.append({"targets": label, "r": r, "trainable": n,
                         "percent": 100 * n / (shape.params + n),  # of all, as PEFT reports it
                         # fp32 weights, gradients and AdamW's two moments: 16 bytes each
                         "train_state_mib": n * 16 / 2**20})  # fmt: skip
    return rows


def adapter_changes_nothing_at_start(peft_model, input_ids) -> float:
    """Max |logits with adapter - logits without| before training: 0, since B starts at zero."""
    with torch.no_grad():
        on = peft_model(input_ids=input_ids).logits.float()
        with peft_model.disable_adapter():
            off = peft_model(input_ids=input_ids).logits.float()
    return (on - off).abs().max().item()


def _pairs(peft_model):
    from peft.tuners.lora import LoraLayer

    for module in peft_model.modules():
        if isinstance(module, LoraLayer):
            for name in module.lora_A:
                yield module.lora_A[name].weight, module.lora_B[name].weight, module.scaling[name]


def adapter_norms(peft_model) -> dict[str, float]:
    """Norms over every adapted layer: A, B and the update s·BA they add to the frozen weights."""
    a = b = update = 0.0
    with torch.no_grad():
        for down, up, scale in _pairs(peft_model):
            a += down.float().norm().item() ** 2
            b += up.float().norm().item() ** 2
            update += (scale * up.float() @ down.float()).norm().item() ** 2
    return {"A": a**0.5, "B": b**0.5, "update": update**0.5}


def train_adapters(peft_model, rows: dict, steps: int, lr: float, batch_size: int = 8,
                   seed: int = 0, track: bool = True) -> list[dict]:  # fmt: skip
    """`steps` AdamW steps on the trainable parameters (the recipe's optimizer, weight decay 0),
    batch after batch of `rows`, dropout seeded; per step: the loss and, if `track`, |B|, how far
    A moved and |s·BA|. The caller's RNG is left as it was."""
    params = [p for p in peft_model.parameters() if p.requires_grad]
    start = [down.detach().clone() for down, _, _ in _pairs(peft_model)]
    optimizer = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    was_training = peft_model.training
    peft_model.train()
    history = []
    with one_thread(), torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        for step in range(steps):
            at = step * batch_size % (len(rows["input_ids"]) - batch_size)
            loss = peft_model(**{k: v[at:at + batch_size] for k, v in rows.items()}).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            history.append({"step": step + 1, "loss": loss.item()})
            if not track:
                continue
            pairs = zip(_pairs(peft_model), start, strict=True)
            moved = sum((d.detach() - s).float().norm().item() ** 2 for (d, _, _), s in pairs)
            norms = adapter_norms(peft_model)
            history[-1].update({"|B|": norms["B"], "|A - A0|": moved**0.5,
                                "|s·BA|": norms["update"]})  # fmt: skip
    peft_model.train(was_training)
    return history


def scaling_runs(model: str, ranks, lrs, steps: int, alpha: int = 16, targets="all-linear",
                 seed: int = 0) -> list[dict]:  # fmt: skip
    """One short run per (learning rate, SCALINGS entry, rank), all from the same base weights, on
    the same rows in the same order: the losses, the held-out loss at the end and |s·BA|. The base
    is unquantized fp32: the scale multiplies the adapter's output whatever the base is stored in,
    and fp32 steps are quick on a CPU."""
    import copy

    from peft import LoraConfig, get_peft_model

    base = load_on_cpu(model, method="none", dtype="float32")
    train, val = sample_rows(model)
    held_out = {k: v[:32] for k, v in val.items()}
    runs = []
    for lr in lrs:
        for label, convention in SCALINGS.items():
            for r in ranks:
                lora_alpha, rslora = convention(r, alpha)
                config = LoraConfig(r=r, lora_alpha=lora_alpha, use_rslora=rslora,
                                    lora_dropout=0.0, target_modules=targets, task_type="CAUSAL_LM")
                with torch.random.fork_rng(devices=[]):
                    torch.manual_seed(seed)  # the same A for a rank, run after run
                    peft_model = get_peft_model(copy.deepcopy(base), config)
                history = train_adapters(peft_model, train, steps, lr, track=False)
                with torch.no_grad(), one_thread():
                    val_loss = peft_model(**held_out).loss.item()
                    update = adapter_norms(peft_model)["update"]
                runs.append({"lr": lr, "scaling": label, "r": r,
                             "scale": next(_pairs(peft_model))[2], "val_loss": val_loss,
                             "|s·BA|": update,
                             "losses": [h["loss"] for h in history]})  # fmt: skip
    return runs


def scaling_summary(runs: list[dict]) -> list[dict]:
    """Per (learning rate, scaling): |s·BA| at the highest rank over the lowest's, and the held-out
    losses the ranks ended with, lowest rank first (rounded: what the text can rely on)."""
    rows = []
    for lr in sorted({run["lr"] for run in runs}):
        for label in SCALINGS:
            group = sorted((run for run in runs if (run["lr"], run["scaling"]) == (lr, label)),
                           key=lambda run: run["r"])  # fmt: skip
            ranks = " / ".join(str(run["r"]) for run in group)
            rows.append({"lr": lr, "scaling": label,
                         f"|s·BA| r={group[-1]['r']} / r={group[0]['r']}":
                             round(group[-1]["|s·BA|"] / group[0]["|s·BA|"], 1),
                         f"held-out loss at r = {ranks}":
                             " / ".join(f"{run['val_loss']:.2f}" for run in group)})  # fmt: skip
    return rows


def scaling_findings(runs: list[dict], flat: float = 0.05) -> list[dict]:
    """Per (learning rate, scaling), in words: does |s·BA| shrink, stay or grow from the lowest
    rank to the highest, and where does the highest rank's held-out loss end among the ranks.

    What section 6's text relies on, in a form every CPU reproduces: at the larger learning rate
    the runs amplify rounding (run_twice_one_ulp_apart), so their second decimal differs between
    CPUs; these words do not (the ratios sit far from 0.8 and 1.25, no near-tie decides one)."""
    rows = []
    for lr in sorted({run["lr"] for run in runs}):
        for label in SCALINGS:
            group = sorted((run for run in runs if (run["lr"], run["scaling"]) == (lr, label)),
                           key=lambda run: run["r"])  # fmt: skip
            ratio = group[-1]["|s·BA|"] / group[0]["|s·BA|"]
            update = "shrinks" if ratio < 0.8 else "grows" if ratio > 1.25 else "about the same"
            losses = [run["val_loss"] for run in group]
            top = group[-1]
            if max(losses) - min(losses) < flat:
                ends = f"all ranks within {flat}"
            elif top["val_loss"] == min(losses):
                ends = f"r={top['r']} lowest"
            elif top["val_loss"] == max(losses):
                ends = f"r={top['r']} highest"
            else:
                ends = f"r={top['r']} between"
            rows.append({"lr": lr, "scaling": label, "|s·BA| as r grows": update,
                         "held-out loss": ends})
    return rows


def run_twice_one_ulp_apart(model: str, r: int, lr: float, steps: int, alpha: int = 16,
                            rslora: bool = True, seed: int = 0) -> tuple[float, float]:  # fmt: skip
    """Held-out loss of one scaling run, then of the same run with every base weight moved by
    about one fp32 rounding step (relative 1.2e-7, seeded): how much the run amplifies rounding."""
    import copy

    from peft import LoraConfig, get_peft_model

    base = load_on_cpu(model, method="none", dtype="float32")
    nudged = copy.deepcopy(base)
    noise = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for p in nudged.parameters():
            p.mul_(1 + 1.2e-7 * torch.randn(p.shape, generator=noise))
    train, val = sample_rows(model)
    held_out = {k: v[:32] for k, v in val.items()}
    found, config = [], LoraConfig(r=r, lora_alpha=alpha, use_rslora=rslora, lora_dropout=0.0,
                                   target_modules="all-linear", task_type="CAUSAL_LM")
    for weights in (base, nudged):
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            peft_model = get_peft_model(weights, config)
        train_adapters(peft_model, train, steps, lr, track=False)
        with torch.no_grad(), one_thread():
            found.append(peft_model(**held_out).loss.item())
    return found[0], found[1]


def plot_scaling_runs(runs: list[dict]):
    """One panel per (learning rate, scaling): each rank's training loss, step by step."""
    import matplotlib.pyplot as plt

    lrs = sorted({run["lr"] for run in runs})
    fig, axes = plt.subplots(len(lrs), len(SCALINGS), figsize=(13, 3.2 * len(lrs)), sharey=True,
                             squeeze=False)  # fmt: skip
    for run in runs:
        ax = axes[lrs.index(run["lr"])][list(SCALINGS).index(run["scaling"])]
        ax.plot(range(1, len(run["losses"]) + 1), run["losses"],
                label=f"r={run['r']} (s={run['scale']:.2f})")  # fmt: skip
        ax.set_title(f"{run['scaling']}\nlr {run['lr']:g}", fontsize=9)
        ax.legend(fontsize=8)
    for ax in axes[-1]:
        ax.set_xlabel("step")
    for row in axes:
        row[0].set_ylabel("training loss")
    fig.tight_layout()
    return fig


def state_against_base(model, ranks=(1, 2, 4, 8, 16, 32, 64, 128, 256)) -> dict:
    """What training holds for the adapters (fp32 weights, gradients, AdamW's two moments: 16
    bytes a parameter) by targets and rank, and the bytes of the base weights in NF4 (4-bit linears
    with their double-quantized scales, the rest in bf16), counted from the model's shape."""
    from kit.budget.estimate import quantized_bytes_per_param
    from kit.budget.shapes import lora_params, shape_of

    shape = shape_of(model)
    linear = shape.layers * shape.layer_linear_params
    base = linear * quantized_bytes_per_param("nf4", True) + 2 * (shape.params - linear)
    return {"base_nf4": base,
            "ranks": list(ranks),
            "state": {label: [16 * lora_params(shape, r, targets) for r in ranks]
                      for label, targets in TARGET_SETS.items()}}  # fmt: skip


def plot_trainable_bytes(models: dict):
    """One panel per model (title -> `kit:` name or shape): state_against_base, drawn."""
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(models), figsize=(6 * len(models), 3.8), squeeze=False)
    for ax, (title, model) in zip(axes[0], models.items(), strict=True):
        found = state_against_base(model)
        for label, state in found["state"].items():
            ax.plot(found["ranks"], state, "o-", ms=3, label=label)
        base = found["base_nf4"]
        ax.axhline(base, color="k", ls="--", label=f"base in NF4: {base / 2**20:,.0f} MiB")
        ax.set(xscale="log", yscale="log", xlabel="rank r", title=title,
               ylabel="adapter training state, bytes")  # fmt: skip
        ax.set_xticks(found["ranks"], [str(r) for r in found["ranks"]])
        ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def dropout_keeps(p: float = 0.05, width: int = 256, tokens: int = 512,
                  r: int = 16) -> tuple[list[dict], float]:
    """What one adapted bf16 linear layer keeps for backward, by autograd's saved tensors, under
    PEFT's dropout and under lora.fused_down (kit.recipe.lora_down: the mask computed inside the
    down-projection, here its torch reference), besides the input itself (alive anyway: the
    layer's input); and the largest difference of their outputs at dropout 0."""
    from peft import LoraConfig, get_peft_model

    from kit.lab.memory import saved_bytes
    from kit.recipe import lora_down

    rows, outputs = [], {}
    for path in ("PEFT", "lora.fused_down"):
        torch.manual_seed(0)
        base = torch.nn.Sequential(torch.nn.Linear(width, width, bias=False)).bfloat16()
        model = get_peft_model(base, LoraConfig(r=r, target_modules=["0"], lora_dropout=p))
        model.bfloat16().train()
        for name, param in model.named_parameters():
            if "lora_B" in name:
                torch.nn.init.normal_(param, std=0.02)
        if path != "PEFT":
            lora_down.enable(model)
        x = torch.randn(tokens, width, dtype=torch.bfloat16, requires_grad=True)
        skip = {t.untyped_storage().data_ptr() for t in (x, *model.parameters())}
        _, kept = saved_bytes(lambda model=model, x=x: model(x), skip)
        rows.append({"path": path, "kept bytes": kept,
                     "per input element": round(kept / x.numel(), 2)})
        model.eval()  # no dropout: the two paths compute the same
        with torch.no_grad():
            outputs[path] = model(x).float()
    diff = (outputs["PEFT"] - outputs["lora.fused_down"]).abs().max().item()
    return rows, diff


def sum_kept_for_backward(width: int = 64, tokens: int = 32, r: int = 8) -> list[dict]:
    """What a compiled layer keeps of one adapted projection (lora.fused_down, dropout 0) that
    feeds a SiLU, under training.recompute.keeps=matmuls, by autograd's saved tensors: the base's
    result or the sum base + B(A(x)) s (kit.recipe.lora_down.add_up), with the policy before
    (`sums` off: the sum recomputed from the kept base) and as compiled layers run it now; and
    the largest difference of the adapter's gradients from the eager run's."""
    import logging

    # torch's one-time note that a policy (context_fn) runs under compile: this cell's point
    notes = [logging.getLogger(n) for n in ("torch._higher_order_ops", "torch._dynamo")]
    levels = [n.level for n in notes]
    for n in notes:
        n.setLevel(logging.ERROR)
    try:
        return [_kept_once(sums, width, tokens, r) for sums in (False, True)]
    finally:
        for n, level in zip(notes, levels, strict=True):
            n.setLevel(level)


def _kept_once(sums: bool, width: int, tokens: int, r: int) -> dict:
    import functools

    from peft import LoraConfig, get_peft_model
    from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts

    from kit.recipe import lora_down
    from kit.recipe.recompute import save_policy

    torch.manual_seed(0)
    base = torch.nn.Sequential(torch.nn.Linear(width, 4 * width, bias=False))
    model = get_peft_model(base, LoraConfig(r=r, target_modules=["0"], lora_dropout=0.0))
    for name, param in model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(param, std=0.02)
    lora_down.enable(model)
    layer = model.base_model.model[0]
    x = torch.randn(tokens, width)
    with torch.no_grad():
        adapted, plain = layer(x), layer.base_layer(x)
    params = [p for p in model.parameters() if p.requires_grad]
    eager = torch.autograd.grad(torch.nn.functional.silu(layer(x)).sum(), params)
    context = functools.partial(create_selective_checkpoint_contexts,
                                save_policy("matmuls", rank=r, mlp_width=4 * width, sums=sums))

    def gate(x):
        return torch.nn.functional.silu(layer(x))

    block = torch.compile(lambda x: checkpoint(gate, x, use_reentrant=False, context_fn=context))
    kept: list = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: kept.append(t) or t, lambda t: t):
        out = block(x)
    grads = torch.autograd.grad(out.sum(), params)
    torch._dynamo.reset()

    def held(want):
        return any(t.shape == want.shape and torch.allclose(t, want, atol=1e-5) for t in kept)

    return {"policy": "sum kept (compiled layers)" if sums else "base kept (before)",
            "keeps base + B(A(x)) s": held(adapted), "keeps the base's result": held(plain),
            "gradient difference from eager": max(
                (g - e).abs().max().item() for g, e in zip(grads, eager, strict=True))}
