"""Notebook 04's exercises: what one rank holds under FSDP2 and how many gathers a step issues
(answers computed with bitsandbytes and the kit's shapes: no torchrun). Hands-on: the learner's
own wrap, `fully_shard` on the units they choose, run for one step on 2 gloo processes inside the
notebook's instruments (kit.lab.sharding.Timeline, Collectives), and read back as the notebook's
timeline tables read the report: a unit per decoder layer (04.3), and the layers kept gathered
between forward and backward (04.4, stretch)."""

from __future__ import annotations

from kit.lab.exercises import Exercise, one_of
from kit.lab.exercises.checks import source_of


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


# ---- hands-on: your own wrap, one step on 2 gloo processes, its timeline read ----

LAYERS = 4  # the decoder layers of the model the wrap is tried on (kit.lab.exercise_ranks.Toy)


def wrap_per_layer(model, mesh):
    """The kit's wrap (kit.recipe.engines.FSDP2): a unit per decoder layer, then the root, which
    takes whatever is left (the embeddings and the head)."""
    from torch.distributed.fsdp import fully_shard

    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def wrap_kept_gathered(model, mesh):
    """FSDP1's SHARD_GRAD_OP in FSDP2 terms: each layer stays gathered from its forward to its
    backward, so backward gathers nothing again."""
    from torch.distributed.fsdp import fully_shard

    for layer in model.layers:
        fully_shard(layer, mesh=mesh, reshard_after_forward=False)
    return fully_shard(model, mesh=mesh)


def _one_unit(model, mesh):
    from torch.distributed.fsdp import fully_shard

    return fully_shard(model, mesh=mesh)


def _no_root(model, mesh):
    from torch.distributed.fsdp import fully_shard

    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    return model


def _every_other_layer(model, mesh):
    from torch.distributed.fsdp import fully_shard

    for layer in model.layers[::2]:
        fully_shard(layer, mesh=mesh)
    return fully_shard(model, mesh=mesh)


_RAN: dict[str, dict] = {}  # source -> rank 0's row of one step under that wrap


def prepare(wraps: list) -> None:
    """One step under each wrap of `wraps` not run yet, on 2 gloo processes, all in one child
    process (kit.lab.exercise_ranks.wrap_steps: the notebook's kernel joins no process group)."""
    from kit.run import child

    todo = {source_of(w): w.__name__ for w in wraps if callable(w)}
    todo = {src: name for src, name in todo.items() if src not in _RAN}
    if not todo:
        return
    found = child.call("kit.lab.exercise_ranks:wrap_steps", cases=[[s, n] for s, n in todo.items()],
                       layers=LAYERS, timeout=180 * len(todo),
                       env={"CUDA_VISIBLE_DEVICES": ""})  # fmt: skip
    _RAN.update((src, _read(rows)) for src, rows in zip(todo, found, strict=True))


def _read(rows: list[dict]) -> dict:
    """What the notebook's timeline tables read, from the ranks' rows of one step."""
    failed = next((r for r in rows if r["error"]), None)
    if failed:
        return {"error": f"rank {failed['rank']} raised {failed['error']}"}
    row = min(rows, key=lambda r: r["rank"])
    tl = row["timeline"]
    units, backward, ops = tl["units"], tl["marks"]["backward"], tl["ops"]

    def held(i, t):
        return any(a <= t < b for a, b in tl["gathered"][i])

    layer_units = [i for i, u in enumerate(units) if u.startswith("layers.")]
    at_once = {name: max((sum(held(i, t) for i in layer_units) for t in range(lo, hi)), default=0)
               for name, lo, hi in (("forward", 0, backward), ("backward", backward, ops))}
    whole = sum(all(held(i, t) for i in range(len(units))) for t in range(ops)) / max(ops, 1)
    return {"error": "", "units": units, "layer units": [units[i] for i in layer_units],
            "all-gathers": row["collectives"].get("allgather_base", {}).get("calls", 0),
            "layers at once, forward": at_once["forward"],
            "layers at once, backward": at_once["backward"],
            "whole model gathered": f"{whole:.0%} of the step",
            "not sharded": [n for n, s in row["sharded"].items() if not s]}  # fmt: skip


def measured(wrap) -> dict:
    """What one step under `wrap(model, mesh)` measured on 2 gloo processes: its units, the
    all-gathers it issued, the most decoder layers held gathered at once in forward and in
    backward, how much of the step the whole model was gathered, the parameters left unsharded."""
    prepare([wrap])
    return _RAN[source_of(wrap)]


def _wrap_hint(wrap, kept: bool) -> str | None:
    if not callable(wrap):
        return "give the function itself (no parentheses)"
    m = measured(wrap)
    if m["error"]:
        return (f"{m['error']}. The function gets the model and the mesh: call "
                "fully_shard(module, mesh=mesh) on each unit, the decoder layers first")
    layers = [f"layers.{i}" for i in range(LAYERS)]
    if m["not sharded"]:
        return (f"{', '.join(m['not sharded'])} stayed whole on every rank: no unit holds them. "
                "End with fully_shard(model, mesh=mesh), the root, which takes what the layer "
                "units left")
    if not m["layer units"]:
        return (f"one unit for the whole model: all {LAYERS} layers were gathered at once in "
                f"forward ({m['whole model gathered']} with the whole model gathered), as "
                "section 10's one unit: give each decoder layer (model.layers[i]) a unit first")
    missing = [u for u in layers if u not in m["layer units"]]
    if missing:
        return (f"{', '.join(missing)} has no unit of its own: its weights are gathered with "
                "the root's, for the whole step")
    forward = m["layers at once, forward"]
    if not kept and forward > 1:
        return (f"{forward} layers were held gathered at once in forward: each stayed gathered "
                "after its forward (reshard_after_forward=False, the stretch's setting); the "
                "kit's wrap frees each layer as soon as its forward is done")
    if kept and forward < LAYERS:
        return (f"{forward} layer(s) held at once in forward, {m['all-gathers']} all-gathers: "
                "each layer was freed after its forward and gathered again in backward. "
                "fully_shard(..., reshard_after_forward=False) keeps a unit gathered until its "
                "backward")
    return None


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
        question=("Hands-on, quick: write wrap_per_layer(model, mesh), FSDP2 the kit's way: a unit for each "
                  "decoder layer (model.layers[i]), then the root, each with "
                  "fully_shard(module, mesh=mesh). The check runs one step of a 4-layer model "
                  "under your wrap on 2 gloo processes and reads its timeline: every parameter "
                  "sharded, a unit per layer, one layer gathered at a time in forward."),
        check=lambda fn: _wrap_hint(fn, kept=False),
        solution=lambda: wrap_per_layer,
        wrong=(_one_unit, _no_root, wrap_kept_gathered),
        hands_on=True,
        prepare=prepare,
    ),
    Exercise(
        key="04.4",
        question=("Hands-on, stretch: write wrap_kept_gathered(model, mesh), the same units with every "
                  "decoder layer kept gathered from its forward to its backward (FSDP1's "
                  "SHARD_GRAD_OP; section 8's table). Predict the all-gathers and the layers held "
                  "at once, then compare with measured(wrap_kept_gathered)."),
        check=lambda fn: _wrap_hint(fn, kept=True),
        solution=lambda: wrap_kept_gathered,
        wrong=(wrap_per_layer, _one_unit),
        hands_on=True,
        prepare=prepare,
    ),
]
