"""Notebook 04's exercises: what one rank holds under FSDP2, how many gathers a step issues, and
what loading costs before the first shard (answers computed with bitsandbytes and the kit's
shapes and estimator: no torchrun)."""

from __future__ import annotations

from kit.lab.exercises import Exercise, close_to, one_of


def _lazy(make):
    """A check built when an answer comes: the solution imports torch only then."""
    return lambda answer: make()(answer)

TINY, RANKS = "kit:tiny-llama", 2


def packed_q_proj_bytes_per_rank() -> int:
    """The bytes of layers.0.self_attn.q_proj's packed NF4 weight one rank holds under FSDP2 on
    2 ranks: bitsandbytes packs the (out, in) weight as the recipe stores it (bf16 storage),
    and fully_shard splits its rows evenly."""
    import bitsandbytes.functional as bnbf
    import torch

    from kit.budget.shapes import shape_of

    inputs, outputs = shape_of(TINY).linears()["q_proj"]
    weight = torch.zeros(outputs, inputs, dtype=torch.bfloat16)
    packed, _ = bnbf.quantize_4bit(weight, quant_type="nf4", quant_storage=torch.bfloat16)
    return packed.numel() * packed.element_size() // RANKS


def fsdp2_all_gathers_8b() -> int:
    """FSDP2 on Llama-3-8B's shape: forward gathers every unit once (each decoder layer, the
    embeddings, the root); backward gathers each decoder layer again (the root stays gathered,
    the frozen embeddings are never reached)."""
    from kit.budget.shapes import shape_of

    layers = shape_of("kit:llama-8b").layers
    return (layers + 2) + layers


def stream_load_gib_70b_on_4() -> float:
    from kit.budget.estimate import Setup, estimate

    return round(estimate("kit:llama-70b", Setup(world_size=4, loading="stream")).load_gib, 1)


def check_stream_load(answer) -> str | None:
    """04.3: right within 2%; the full-loading figure and the other rank counts get their hint."""
    from kit.budget.estimate import Setup, estimate

    hint = close_to(stream_load_gib_70b_on_4(), rel=0.02)(answer)
    if hint is None or not isinstance(answer, (int, float)):
        return hint
    full = estimate("kit:llama-70b", Setup(world_size=4, loading="full")).load_gib
    if abs(answer - full) <= 0.02 * full:
        return "that is loading=full: every rank holds the whole 4-bit model before it shards"
    return ("not this number: run the estimator of section 11 with world_size=4 and "
            "loading='stream', and read its load_gib (the table shows 2 and 8 ranks)")


EXERCISES = [
    Exercise(
        key="04.1",
        question=("Under FSDP2 on 2 ranks, how many bytes of layers.0.self_attn.q_proj's packed "
                  "4-bit weight (base_layer.weight) does rank 1 hold? Section 3's table gives its "
                  "shape and dtype; the answer is a number of bytes."),
        check=_lazy(lambda: one_of(packed_q_proj_bytes_per_rank(), hints={
            8192: "that is the whole packed weight: under FSDP2 each rank holds 1/N of its rows",
            16384: "a 128 x 128 weight in bf16, halved: but the weight is packed 4-bit, two values a byte",
            32768: "that is the unquantized bf16 weight, whole: it is packed 4-bit, and sharded",
        }, default="multiply the rank's shape by the bytes of its dtype (bfloat16: 2)")),
        solution=packed_q_proj_bytes_per_rank,
        wrong=(8192, 16384, 32768),
    ),
    Exercise(
        key="04.2",
        question=("On the tiny model (2 decoder layers) FSDP2 issued 6 all-gathers in one step "
                  "(section 9). How many does it issue per step on Llama-3-8B's shape (32 decoder "
                  "layers, embeddings not tied to the head)? A whole number."),
        check=one_of(fsdp2_all_gathers_8b(), hints={
            34: "that counts forward only: backward gathers each decoder layer again",
            64: "the embeddings and the root are units too, each gathered once",
            68: "the root and the embeddings are gathered once a step, not twice (section 9's text)",
        }, default="count the units gathered in forward, then those gathered again in backward"),
        solution=fsdp2_all_gathers_8b,
        wrong=(34, 64, 68),
    ),
    Exercise(
        key="04.3",
        question=("With model.loading=stream, how many GiB per GPU does the estimator put on each "
                  "of 4 ranks while loading the 70B shape? Section 11's cell computes it for 2 and "
                  "8 ranks; one decimal."),
        check=check_stream_load,
        solution=stream_load_gib_70b_on_4,
        wrong=(34.6, 17.6, 4.8),
    ),
]
