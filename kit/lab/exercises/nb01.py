"""Exercises of notebook 01 (memory budget): what sharding over more GPUs takes off (01.1), how
many 24 GB cards a 70B shape needs (01.2), and the longest sequence that fits one (01.3), each
with kit.budget.estimate as the notebook uses it."""

from __future__ import annotations

from kit.budget.estimate import Setup, estimate
from kit.lab.exercises import Exercise
from kit.lab.exercises.checks import number

CARD_GIB = 23.6  # what a 24 GB card reports (notebook 01's `gpus`)
# Llama-3-70B's config.json fields, as notebook 01 writes them.
LLAMA3_70B = dict(vocab_size=128256, hidden_size=8192, intermediate_size=28672,
                  num_hidden_layers=80, num_attention_heads=64, num_key_value_heads=8)


def _total_gib(world: int) -> float:
    return estimate("kit:llama-8b", Setup(world_size=world, batch_size=1, seq_len=2048)).total_gib


def _saved_by_four() -> float:
    return _total_gib(2) - _total_gib(4)


def _cards_for_70b(fits: bool = True) -> int:
    """The fewest GPUs on which the 70B step fits a 24 GB card (fits=False: on which its
    allocated peak alone stays under the card, the headroom left out)."""
    for n in range(1, 65):
        est = estimate(LLAMA3_70B, Setup(world_size=n))
        if est.fits(CARD_GIB) if fits else est.total_gib <= CARD_GIB:
            return n
    raise ValueError("does not fit 64 cards")


def _longest_fused(fits: bool = True, loss: str = "fused") -> int:
    """The longest power-of-two seq_len at which Llama-3-8B (FSDP2 x2, batch 1) fits a 24 GB
    card with `loss` (fits=False: its allocated peak alone under the card)."""
    best, seq = 0, 256
    while seq <= 2**20:
        est = estimate("kit:llama-8b", Setup(seq_len=seq, loss=loss))
        if est.fits(CARD_GIB) if fits else est.total_gib <= CARD_GIB:
            best = seq
        seq *= 2
    return best


EXERCISES = [
    Exercise(
        key="01.1",
        question=("Section 2's step (Llama-3-8B, FSDP2, batch 1 x 2,048 tokens, the rest "
                  "Setup()'s defaults) on 4 GPUs instead of 2: by how many GiB per GPU does the "
                  "estimated total drop? (answer: a number of GiB)"),
        check=number(_saved_by_four(), {
            _total_gib(2) / 2: "not everything halves: only what FSDP shards does; the "
                               "activations, the logits and the layers it gathers are per GPU "
                               "whatever the number of GPUs",
            0.0: "something does shrink: FSDP splits the base weights and LoRA's state over "
                 "the ranks",
        }, "compare the two estimates part by part (print both)", rel=0.03),
        solution=_saved_by_four,
        wrong=(_total_gib(2) / 2, 0.0),
    ),
    Exercise(
        key="01.2",
        question=("Llama-3-70B (the `llama3_70b` shape) under plain FSDP2, no CPU offload, "
                  "batch 1 x 2,048 tokens (Setup()'s defaults but world_size): on how many "
                  "24 GB cards (23.6 GiB each) does a step fit, headroom counted? (answer: the "
                  "fewest cards)"),
        check=number(_cards_for_70b(), {
            _cards_for_70b(fits=False): "the allocated peak fits there, but a card also needs "
                                        "the headroom: use est.fits(23.6), not total_gib",
            2: "two cards do not hold it without CPU offload (the table above says so)",
        }, "try world_size = 2, 3, 4, ... and ask estimate(...).fits(23.6) each time",
            whole=True),
        solution=_cards_for_70b,
        wrong=(_cards_for_70b(fits=False), 2, 8),
    ),
    Exercise(
        key="01.3",
        question=("Llama-3-8B, FSDP2 on 2 GPUs, batch 1, checkpointing on, with the fused loss "
                  "(Setup(loss='fused')): the longest sequence, a power of two, at which a step "
                  "fits a 24 GB card (23.6 GiB), headroom counted? (answer: a number of tokens)"),
        check=number(_longest_fused(), {
            _longest_fused(fits=False): "the allocated peak fits there, but not with the "
                                        "headroom: use est.fits(23.6)",
            _longest_fused(loss="hf"): "that is the limit with transformers' loss (the plot "
                                       "above); the fused loss never holds the batch's logits",
        }, "sweep seq_len over powers of two with loss='fused' and ask fits(23.6)", whole=True),
        solution=_longest_fused,
        wrong=(_longest_fused(fits=False), _longest_fused(loss="hf"), 2048),
    ),
]
