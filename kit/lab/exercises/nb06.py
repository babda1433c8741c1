"""Notebook 06's exercises: what eager attention holds, how many layers run twice with
training.recompute.every, and what a selective policy recomputes (answers computed with torch on
the meta device and the kit's own recompute functions: no torchrun)."""

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
]
