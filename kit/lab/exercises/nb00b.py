"""Exercises of the primer (notebook 00b): what the ring's collectives write, per rank (00.1,
00.2), and, hands-on, all-reduce written as a reduce-scatter and an all-gather and run on 2 gloo
processes (00.3; 00.4, stretch: any length, padded). The setup notebook's exercises (00.5-00.7)
are in nb00c.py."""

from __future__ import annotations

from kit.lab import collectives
from kit.lab.exercises import Exercise
from kit.lab.exercises.checks import calls_of, number, source_of

GiB, MiB = 2**30, 2**20


def _all_reduce_gib() -> float:
    return collectives.ring_writes("all_reduce", GiB, rank=0, world=8) / GiB


def _fsdp_step_mib() -> float:
    full, world = 64 * MiB, 4
    gather = collectives.ring_writes("all_gather", full // world, rank=0, world=world)
    scatter = collectives.ring_writes("reduce_scatter", full, rank=0, world=world)
    return (2 * gather + scatter) / MiB  # gathered before forward and again before backward


# ---- hands-on (primer): all-reduce from its two halves, run on 2 gloo processes ----

WORLD = 2


def all_reduce_by_parts(t):
    """The sum over the ranks, whole, on every rank: each rank's slice of the sum first
    (reduce-scatter), then every slice to every rank (all-gather)."""
    import torch
    import torch.distributed as dist

    mine = torch.empty(t.numel() // dist.get_world_size(), dtype=t.dtype)
    dist.reduce_scatter_tensor(mine, t)
    whole = torch.empty_like(t)
    dist.all_gather_into_tensor(whole, mine)
    return whole


def all_reduce_any_length(t):
    """The same for any length: pad with zeros to a multiple of the world size (zeros add
    nothing to a sum), all-reduce by parts, then cut the padding off."""
    import torch
    import torch.distributed as dist

    world = dist.get_world_size()
    padded = torch.cat([t, t.new_zeros(-t.numel() % world)])
    mine = torch.empty(padded.numel() // world, dtype=t.dtype)
    dist.reduce_scatter_tensor(mine, padded)
    whole = torch.empty_like(padded)
    dist.all_gather_into_tensor(whole, mine)
    return whole[: t.numel()]


def _slice_only(t):
    import torch
    import torch.distributed as dist

    mine = torch.empty(t.numel() // dist.get_world_size(), dtype=t.dtype)
    dist.reduce_scatter_tensor(mine, t)
    return mine


def _gathers_inputs(t):
    import torch
    import torch.distributed as dist

    every = torch.empty(t.numel() * dist.get_world_size(), dtype=t.dtype)
    dist.all_gather_into_tensor(every, t)
    return every


def _uses_all_reduce(t):
    import torch.distributed as dist

    dist.all_reduce(t)
    return t


def _keeps_the_padding(t):
    import torch
    import torch.distributed as dist

    world = dist.get_world_size()
    padded = torch.cat([t, t.new_zeros(-t.numel() % world)])
    mine = torch.empty(padded.numel() // world, dtype=t.dtype)
    dist.reduce_scatter_tensor(mine, padded)
    whole = torch.empty_like(padded)
    dist.all_gather_into_tensor(whole, mine)
    return whole


_RAN: dict[tuple, list[dict]] = {}  # (source, name, lengths) -> what each rank got


def prepare(fns: list, lengths: tuple[int, ...]) -> None:
    """Run every function of `fns` not run yet on 2 gloo processes (kit.lab.exercise_ranks, in
    one child process for all of them: this kernel imports no torch), on tensors of `lengths`."""
    from kit.run import child

    todo = list(dict.fromkeys((source_of(fn), fn.__name__, tuple(lengths)) for fn in fns
                              if callable(fn) and "all_reduce" not in calls_of(fn)))  # fmt: skip
    todo = [case for case in todo if case not in _RAN]
    if todo:
        found = child.call("kit.lab.exercise_ranks:collectives",
                           cases=[[src, name, list(n)] for src, name, n in todo], world=WORLD,
                           timeout=120 * len(todo), env={"CUDA_VISIBLE_DEVICES": ""})  # fmt: skip
        _RAN.update(zip(todo, found, strict=True))


def _on_ranks(fn, lengths: tuple[int, ...]) -> list[dict]:
    prepare([fn], lengths)
    return _RAN[(source_of(fn), fn.__name__, tuple(lengths))]


def _expected(length: int) -> list[float]:
    return [float(i * sum(10**r for r in range(WORLD))) for i in range(1, length + 1)]


def _diagnose(rows: list[dict], stretch: bool) -> str | None:
    """The first thing that went wrong on a rank, in words; None when every rank got the sum."""
    for row in rows:
        if row["error"]:
            error, where = row["error"], f"rank {row['rank']}"
            if "no answer" in error or "imeout" in error or "timed out" in error:
                return (f"{where} waited in a collective the other rank never joined ({error}): "
                        "every rank must call the same collectives, in the same order")
            if row["length"] and row["length"] % WORLD and ("divisible" in error
                                                              or "size" in error.lower()):
                return (f"{where} raised {error} on {row['length']} elements: they do not split "
                        f"into {WORLD} equal slices. Pad with zeros up to a multiple of the world "
                        "size first, and cut the result back to the input's length")
            if "defines no function" in error or "NameError" in error:
                return (f"{where}: {error}. The ranks run this cell's function alone, with torch "
                        "and dist: define any helper inside it")
            return f"{where} raised {error} (on {row['length']} elements)"
    for row in rows:
        n, got, want = row["length"], row["output"], _expected(row["length"])
        mine = f"rank {row['rank']} got {_show(got)} from {_show(row['input'])}; the sum is {_show(want)}"
        if got is None:
            return f"rank {row['rank']} returned None: return the tensor that holds the sum"
        if got == want:
            continue
        k = -(-n // WORLD)
        if got == want[row["rank"] * k:(row["rank"] + 1) * k]:
            return (f"{mine}. That is the reduce-scatter alone, each rank its slice: all-gather "
                    "the slices into a tensor of the input's length")
        every = [x for r in range(WORLD) for x in (i * 10**r for i in range(1, n + 1))]
        if got == [float(x) for x in every]:
            return (f"{mine}. That is every rank's input, gathered: nothing was summed. "
                    "Reduce-scatter first (it sums), then all-gather the summed slices")
        if got == row["input"]:
            return f"{mine}: nothing reached this rank from the other; it kept its own input"
        if all(abs(g - w / WORLD) < 1e-4 for g, w in zip(got, want, strict=False)) and len(got) == n:
            return f"{mine}: that is the mean. An all-reduce sums (FSDP divides afterwards)"
        if stretch and got[:n] == want and len(got) > n:
            return f"{mine}: the padding came back too. Return the first {n} elements only"
        return f"{mine}"
    return None


def _show(values) -> str:
    if values is None:
        return "None"
    shown = ", ".join(f"{v:g}" for v in values[:6])
    return f"[{shown}{', ...' if len(values) > 6 else ''}]"


def _check_parts(fn, name: str, lengths: tuple[int, ...], stretch: bool = False) -> str | None:
    if not callable(fn):
        return f"give the function itself: exercises.check(..., {name}) (no parentheses)"
    if "all_reduce" in calls_of(fn):
        return ("it calls dist.all_reduce: the exercise is to build it from its two halves, "
                "dist.reduce_scatter_tensor and dist.all_gather_into_tensor")
    return _diagnose(_on_ranks(fn, lengths), stretch)


EXERCISES = [
    Exercise(
        key="00.1",
        question=("DDP all-reduces every gradient each step. With 8 ranks, each holding 1 GiB of "
                  "gradients, how many GiB does each rank write in the ring algorithm NCCL "
                  "uses? (answer: a number of GiB)"),
        check=number(1.75, {
            2.0: "close, but less than 2: in each of its two phases a rank sends every slice "
                 "but one",
            0.875: "that is a reduce-scatter alone; an all-reduce is a reduce-scatter followed "
                   "by an all-gather",
            7.0: "a rank does not send its whole input to each of the 7 others: the ring cuts it "
                 "into 8 slices and passes slices along",
            1.0: "that is what each of 2 ranks wrote in the primer's byte count; count for 8",
        }, "count the reduce-scatter's writes and the all-gather's writes of a ring of 8"),
        solution=_all_reduce_gib,
        wrong=(2.0, 0.875, 7.0),
    ),
    Exercise(
        key="00.2",
        question=("One FSDP step of a layer whose weight is 64 MiB in all, sharded over 4 ranks, "
                  "its gradient as large: counting every collective FSDP runs on it in the "
                  "step (as in the hand-written step), how many MiB does each rank write in the "
                  "ring? (answer: a number of MiB)"),
        check=number(144, {
            96: "FSDP gathers the weight twice: before forward, and again before backward (the "
                "copy gathered for forward was freed)",
            192: "in a ring all-gather a rank writes shards (its own, then those it passes on), "
                 "not the whole weight",
            48: "that is one collective; the step runs three on this layer",
        }, "add up what each of the step's three collectives writes per rank on a ring of 4"),
        solution=_fsdp_step_mib,
        wrong=(96, 192, 48),
    ),
    Exercise(
        key="00.3",
        question=("Hands-on, quick: write all_reduce_by_parts(t), the sum over the ranks of each "
                  "rank's 1-D tensor t, whole, on every rank, built from "
                  "dist.reduce_scatter_tensor and dist.all_gather_into_tensor (not "
                  "dist.all_reduce). The check runs it on 2 gloo processes, on 4 and 8 "
                  "elements."),
        check=lambda fn: _check_parts(fn, "all_reduce_by_parts", (4, 8)),
        solution=lambda: all_reduce_by_parts,
        wrong=(_uses_all_reduce, _slice_only, _gathers_inputs),
        hands_on=True,
        prepare=lambda fns: prepare(fns, (4, 8)),
    ),
    Exercise(
        key="00.4",
        question=("Hands-on, stretch: write all_reduce_any_length(t), the same for a tensor whose "
                  "length does not divide by the number of ranks (FSDP meets this with every "
                  "parameter whose rows do not split evenly). The check runs it on 2 gloo "
                  "processes, on 5 and 4 elements."),
        check=lambda fn: _check_parts(fn, "all_reduce_any_length", (5, 4), stretch=True),
        solution=lambda: all_reduce_any_length,
        wrong=(all_reduce_by_parts, _keeps_the_padding),
        hands_on=True,
        prepare=lambda fns: prepare(fns, (5, 4)),
    ),
]
