"""Exercises of notebook 01 (memory budget): the base weights' term written by hand and checked
against kit.budget.estimate on several shapes, GPU counts and engines (01.1, hands-on: a known
mistake gets its hint), how many 24 GB cards a 70B shape needs (01.2), and the longest sequence
that fits one (01.3), each with kit.budget.estimate as the notebook uses it."""

from __future__ import annotations

from kit.budget import shapes
from kit.budget.estimate import GiB, Setup, estimate
from kit.lab.exercises import Exercise
from kit.lab.exercises.checks import number

CARD_GIB = 23.6  # what a 24 GB card reports (notebook 01's `gpus`)
# Llama-3-70B's config.json fields, as notebook 01 writes them.
LLAMA3_70B = dict(vocab_size=128256, hidden_size=8192, intermediate_size=28672,
                  num_hidden_layers=80, num_attention_heads=64, num_key_value_heads=8)


# The cases a learner's function is checked on: (model, GPUs, engine).
CASES = [("kit:llama-8b", 2, "fsdp2"), ("kit:llama-8b", 1, "fsdp2"), ("kit:llama-70b", 4, "fsdp2"),
         ("kit:qwen2-7b", 8, "fsdp1"), ("kit:llama-8b", 2, "ddp")]


NF4_DOUBLE_QUANT = 0.5 + 1 / 64 + 4 / (64 * 256)  # bytes per parameter: 4 bits + the scales


def _base_weights_gib(model, world_size: int, engine: str, per_param: float = NF4_DOUBLE_QUANT,
                      rest: float = 2.0, unit: float = GiB, shards_ddp: bool = False,
                      shards: bool = True) -> float:
    """The frozen base weights one GPU holds: the decoder layers' linear weights in NF4 with
    double quantization (4 bits + one byte per 64 + one fp32 per 64 x 256), the rest of the
    parameters (embeddings, head, norms) in bf16; FSDP divides them over the GPUs, DDP does not.
    The keyword arguments make the likely mistakes (tests and hints)."""
    s = shapes.shape_of(model)
    linear = s.layers * s.layer_linear_params
    total = linear * per_param + (s.params - linear) * rest
    divided = shards and (engine != "ddp" or shards_ddp)
    return total / (world_size if divided else 1) / unit


def base_weights_gib(model, world_size: int, engine: str) -> float:
    """One solution of exercise 01.1: the GiB of frozen base weights one GPU holds."""
    s = shapes.shape_of(model)
    linear = s.layers * s.layer_linear_params  # the decoder layers' linear weights: NF4
    nbytes = linear * NF4_DOUBLE_QUANT + (s.params - linear) * 2  # the rest: bf16
    return nbytes / (1 if engine == "ddp" else world_size) / 2**30


def _kit_base_weights_gib(model, world_size: int, engine: str) -> float:
    return estimate(model, Setup(world_size=world_size, engine=engine)).parts["base weights"] / GiB


MISTAKES = {
    "bytes": (dict(unit=1), "that is bytes: a GiB is 2**30 of them"),
    "GB": (dict(unit=1e9), "that is GB (10**9 bytes); the estimate speaks GiB (2**30)"),
    "no scales": (dict(per_param=0.5), "4 bits are 0.5 bytes, but each block of 64 weights also "
                  "has its scale: 0.516 bytes per parameter with double quantization"),
    "all 4-bit": (dict(rest=NF4_DOUBLE_QUANT), "only the decoder layers' linear "
                  "weights are 4-bit: the embeddings, the head and the norms stay bf16 (2 bytes)"),
    "ddp sharded": (dict(shards_ddp=True), "DDP keeps the whole model on every GPU: divide by "
                    "the GPUs only under FSDP"),
    "not sharded": (dict(shards=False), "FSDP splits the base weights over the GPUs: each holds "
                    "1/world_size of them"),
}


def _check_base_weights(answer) -> str | None:
    if not callable(answer):
        return "give the function itself: exercises.check(\"01.1\", base_weights_gib)"
    got = [answer(*case) for case in CASES]
    if not all(isinstance(g, (int, float)) and not isinstance(g, bool) for g in got):
        return f"the function should return a number of GiB; it returned {got[0]!r}"

    def same(fn) -> bool:
        return all(abs(g - fn(*c)) <= 0.01 * abs(fn(*c)) for g, c in zip(got, CASES, strict=True))

    if same(_kit_base_weights_gib):
        return None
    for kwargs, hint in MISTAKES.values():
        if same(lambda *c, kw=kwargs: _base_weights_gib(*c, **kw)):
            return hint
    case = next(c for g, c in zip(got, CASES, strict=True)
                if abs(g - _kit_base_weights_gib(*c)) > 0.01 * _kit_base_weights_gib(*c))
    return (f"for {case[0]} on {case[1]} GPU(s) under {case[2]} it returns "
            f"{answer(*case):.3f} GiB, the kit {_kit_base_weights_gib(*case):.3f}: print "
            f"estimate({case[0]!r}, Setup(world_size={case[1]}, engine={case[2]!r}))"
            ".notes['base weights'] for how the kit counts it")


def _wrong(name: str):
    kwargs = MISTAKES[name][0]
    return lambda model, world_size, engine: _base_weights_gib(model, world_size, engine, **kwargs)


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
        question=("Hands-on: write base_weights_gib(model, world_size, engine), the GiB of "
                  "frozen base weights one GPU holds (NF4 with double quantization for the "
                  "decoder layers' linear weights, bf16 for the rest; engine 'fsdp2', 'fsdp1' or "
                  "'ddp'). The check compares it with kit.budget.estimate's 'base weights' on "
                  "five setups."),
        check=_check_base_weights,
        solution=lambda: base_weights_gib,
        wrong=tuple(_wrong(name) for name in MISTAKES) + (42,),
        hands_on=True,
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
