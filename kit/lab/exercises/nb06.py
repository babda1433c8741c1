"""Notebook 06's exercises: what eager attention holds, how many layers run twice with
training.recompute.every, and what a selective policy recomputes (answers computed with torch on
the meta device and the kit's own recompute functions: no torchrun). Hands-on: the attention and
recompute settings that fit Llama-3-8B into a GPU's memory, checked with the kit's estimator
(kit.budget.estimate, notebook 01): any that fits (06.4), then the one that recomputes least
(06.5, stretch)."""

from __future__ import annotations

from kit.lab.exercises import Exercise, one_of

CANDIDATES = ("q_proj", "lora_A", "lora_B", "gate_proj", "silu")


def eager_scores_mib() -> float:
    """One layer's attention scores under eager: batch x query heads x seq x seq, in bf16."""
    import torch

    scores = torch.empty(1, 32, 8192, 8192, dtype=torch.bfloat16, device="meta")
    return scores.numel() * scores.element_size() / 2**20


def layer_forwards_every_2() -> int:
    """Decoder-layer forwards in one training step of a 32-layer Llama with
    training.recompute.every=2: each layer once in forward, the recomputed ones again in backward
    (kit.recipe.recompute.enable_activation_checkpointing, on a model built on the meta device)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from kit.recipe.recompute import enable_activation_checkpointing

    config = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=32,
                         num_attention_heads=4, num_key_value_heads=2)  # fmt: skip
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    recomputed = enable_activation_checkpointing(model, every=2)
    return config.num_hidden_layers + len(recomputed)


def recomputed_under_attention_matmuls() -> set[str]:
    """Ask the kit's own policy (kit.recipe.recompute.save_policy, keeps=attention_matmuls, LoRA r=16,
    Llama-3-8B's widths) about each candidate: a matmul of that shape, or the SiLU."""
    import torch
    from torch.utils.checkpoint import CheckpointPolicy

    from kit.recipe.recompute import save_policy

    hidden, mlp, r, tokens = 4096, 14336, 16, 8
    policy = save_policy("attention_matmuls", rank=r, mlp_width=mlp)

    def mm(inner, out):
        return torch.ops.aten.mm.default, (torch.empty(tokens, inner, device="meta"),
                                           torch.empty(inner, out, device="meta"))

    ops = {"q_proj": mm(hidden, hidden), "lora_A": mm(hidden, r), "lora_B": mm(r, hidden),
           "gate_proj": mm(hidden, mlp),
           "silu": (torch.ops.aten.silu.default, (torch.empty(tokens, mlp, device="meta"),))}
    redo = (CheckpointPolicy.PREFER_RECOMPUTE, CheckpointPolicy.MUST_RECOMPUTE)
    return {name for name, (op, args) in ops.items() if policy(None, op, *args) in redo}


def check_recomputed(answer) -> str | None:
    if not isinstance(answer, (set, list, tuple)) or not set(answer) <= set(CANDIDATES):
        return f"answer with a set of names from {CANDIDATES}"
    got, want = set(answer), recomputed_under_attention_matmuls()
    if got == want:
        return None
    if "lora_A" in got:
        return "the adapter's down-projection has r outputs per token: cheap to keep, and kept"
    if "q_proj" in got:
        return "attention_matmuls keeps attention's projections: they do not run twice"
    if "silu" not in got:
        return "element-wise results (norms, RoPE, SiLU) are never kept by a selective policy"
    return "one more: which matmuls does attention_matmuls give up, and what is cheap to redo?"


# ---- hands-on: settings that fit a budget ----

GIVEN = ["attention.implementation=eager", "training.recompute.enabled=false"]
ALLOWED = ("attention.implementation", "training.recompute.enabled", "training.recompute.keeps")
# (batch, tokens per row, GiB per GPU) of each part: Llama-3-8B, FSDP2 on 2 GPUs.
QUICK, STRETCH = (1, 2048, 40), (1, 4096, 20)
# What each choice runs twice in backward, least first: nothing; the element-wise rest (norms,
# RoPE, SiLU); and attention's projections; and the MLP's gate and up (larger: 14,336 columns
# each in Llama-3-8B against q, k, v, o's 10,240 together); every layer's whole forward.
RECOMPUTED = ("nothing", "matmuls", "mlp_matmuls", "attention_matmuls", "inputs")
SETTINGS = [[f"attention.implementation={a}", *r] for a in ("sdpa", "eager") for r in (
    ["training.recompute.enabled=false"],
    *([f"training.recompute.keeps={k}"] for k in RECOMPUTED[1:]))]


def _setting(settings: list[str], part: tuple) -> tuple[str | None, object]:
    """(a hint, None) for settings the exercise does not take; else (None, the estimate)."""
    from kit.budget.estimate import Setup, estimate
    from kit.config import ConfigError, load_config

    if not isinstance(settings, (list, tuple)) or not all(
            isinstance(s, str) and "=" in s for s in settings):
        return "settings is a list of 'key=value' strings, such as " + repr(GIVEN), None
    other = [s for s in settings if s.split("=", 1)[0].strip() not in ALLOWED]
    if other:
        return (f"{other[0]}: change only {', '.join(ALLOWED)}; the model, the batch and the "
                "sequence length are the job's"), None
    batch, seq, _ = part
    job = ["model.name=kit:llama-8b", f"data.max_seq_len={seq}", f"training.batch_size={batch}"]
    try:
        cfg = load_config(None, job + list(settings))
    except ConfigError as e:
        return f"the kit refused them: {str(e).splitlines()[0]}", None
    return None, estimate("kit:llama-8b", Setup.from_config(cfg, world_size=2))


def recomputed(settings: list[str]) -> str:
    """What a setting runs twice, one of RECOMPUTED."""
    from kit.config import load_config

    r = load_config(None, list(settings)).training.recompute
    return "nothing" if not r.enabled else (r.keeps if r.keeps != "auto" else "inputs")


def _fits(settings, part) -> bool:
    hint, est = _setting(settings, part)
    return hint is None and est.fits(part[2])


def least_recompute(part: tuple = STRETCH) -> list[str]:
    """The settings (of SETTINGS) that fit `part`'s GPU and recompute least."""
    return next(c for c in sorted(SETTINGS, key=lambda c: RECOMPUTED.index(recomputed(c)))
                if _fits(c, part))


def _over(est, budget: float) -> str:
    name, gib, note = est.table()[0]
    return (f"the estimate needs {est.needed_gib():.1f} GiB per GPU, the GPU has {budget}: the "
            f"largest part is {name}, {gib:.1f} GiB ({note})")


def _check_fits(settings, part=QUICK) -> str | None:
    hint, est = _setting(settings, part)
    if hint:
        return hint
    if not est.fits(part[2]):
        hint = _over(est, part[2])
        if "attention.implementation=eager" in settings and recomputed(settings) == "nothing":
            hint += ("; eager attention keeps every layer's seq x seq scores for backward "
                     "(section 3)")
        return hint
    return None


def _check_least(settings) -> str | None:
    hint = _check_fits(settings, STRETCH)
    if hint:
        return hint
    best = recomputed(least_recompute())
    mine = recomputed(settings)
    if RECOMPUTED.index(mine) > RECOMPUTED.index(best):
        what = "every layer's whole forward" if mine == "inputs" else f"what keeps={mine} gives up"
        return (f"it fits, and runs {what} twice: a setting that recomputes less also fits "
                "(section 5: the selective policies keep some matmuls)")
    return None


EXERCISES = [
    Exercise(
        key="06.1",
        question=("Under eager attention, how many MiB do one layer's attention scores take for "
                  "batch 1, 32 query heads (8 key/value heads), 8,192 tokens, in bf16? A number of "
                  "MiB; it is what autograd keeps per layer for backward, and why eager runs out."),
        check=one_of(4096.0, hints={
            8192.0: "that is fp32: bf16 takes 2 bytes a value",
            1024.0: "grouped-query attention shares keys, but every query head still scores every key",
            128.0: "that is one head: there is a seq x seq matrix per query head",
        }, default="batch x heads x seq x seq values, 2 bytes each, divided by 2**20"),
        solution=eager_scores_mib,
        wrong=(8192.0, 1024.0, 128.0),
    ),
    Exercise(
        key="06.2",
        question=("With training.recompute.every=2 on a 32-layer model, how many decoder-layer "
                  "forwards run in one training step (forward, plus the recomputes in backward)? "
                  "A whole number."),
        check=one_of(48, hints={
            64: "that is every layer recomputed (every=1): every=2 recomputes layers 0, 2, 4, ...",
            32: "that is forward alone: the recomputed layers run again in backward",
            16: "count forward too: every layer runs once there",
        }, default="each layer once in forward, then the recomputed ones once more"),
        solution=layer_forwards_every_2,
        wrong=(64, 32, 16),
    ),
    Exercise(
        key="06.3",
        question=("training.recompute.keeps=attention_matmuls: which of these does backward compute "
                  f"again? Answer a set of names from {CANDIDATES} (q_proj, gate_proj: the frozen "
                  "projections; lora_A, lora_B: an adapter's down- and up-projection)."),
        check=check_recomputed,
        solution=recomputed_under_attention_matmuls,
        wrong=({"lora_A", "lora_B", "gate_proj", "silu"}, {"gate_proj"},
               {"q_proj", "gate_proj", "lora_B", "silu"}),
    ),
    Exercise(
        key="06.4",
        question=(f"Hands-on, quick: Llama-3-8B, FSDP2 on 2 GPUs of {QUICK[2]} GiB, batch "
                  f"{QUICK[0]} x {QUICK[1]:,} tokens: the settings as given (eager attention, no "
                  "recomputation) do not fit. Change attention.implementation and "
                  "training.recompute.enabled / keeps until the kit's estimate fits; the fastest "
                  "fit recomputes nothing."),
        check=_check_fits,
        solution=lambda: least_recompute(QUICK),
        wrong=(["attention.implementation=eager", "training.recompute.enabled=false",
                "data.max_seq_len=1024"], list(GIVEN),
               ["attention.implementation=eager", "training.recompute.every=2"]),
        hands_on=True,
        given=list(GIVEN),
    ),
    Exercise(
        key="06.5",
        question=(f"Hands-on, stretch: twice the tokens, {STRETCH[0]} x {STRETCH[1]:,}, on GPUs "
                  f"of {STRETCH[2]} GiB: which settings fit with the least recomputation (the "
                  "fastest step that fits)?"),
        check=_check_least,
        solution=lambda: least_recompute(STRETCH),
        wrong=(["attention.implementation=sdpa", "training.recompute.enabled=true"],
               ["attention.implementation=sdpa", "training.recompute.keeps=mlp_matmuls"],
               list(GIVEN)),
        hands_on=True,
        given=list(GIVEN),
    ),
]
