"""Exercises of the two 00 notebooks: the primer (00.1, 00.2: what the ring's collectives write,
per rank; 00.3 and 00.4, hands-on: all-reduce written as a reduce-scatter and an all-gather, run
on 2 gloo processes) and setup and hardware (00.5 and 00.6, hands-on: the fastest GPUs of an
`nvidia-smi topo -m` matrix; 00.7: what FSDP shards)."""

from __future__ import annotations

from functools import cache
from itertools import combinations

from kit.budget import hardware, shapes
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


# `nvidia-smi topo -m` of a 4-GPU machine: GPU0 and GPU1 joined by NVLink, GPU1 and GPU2 under one
# PCIe switch, GPU3 on the other CPU socket.
FOUR_GPUS = """\
        GPU0    GPU1    GPU2    GPU3    CPU Affinity    NUMA Affinity
GPU0     X      NV4     PHB     SYS     0-15            0
GPU1    NV4      X      PIX     SYS     0-15            0
GPU2    PHB     PIX      X      SYS     0-15            0
GPU3    SYS     SYS     SYS      X      16-31           1
"""


# Two NVLink islands of 4 (NV12 inside the first, NV6 inside the second), one NV18 bridge between
# GPU3 and GPU4, and the other pairs across the sockets.
EIGHT_GPUS = """\
        GPU0    GPU1    GPU2    GPU3    GPU4    GPU5    GPU6    GPU7    CPU Affinity    NUMA Affinity
GPU0     X      NV12    NV12    NV12    SYS     SYS     SYS     SYS     0-31            0
GPU1    NV12     X      NV12    NV12    SYS     SYS     SYS     SYS     0-31            0
GPU2    NV12    NV12     X      NV12    SYS     SYS     SYS     SYS     0-31            0
GPU3    NV12    NV12    NV12     X      NV18    SYS     SYS     SYS     0-31            0
GPU4    SYS     SYS     SYS     NV18     X      NV6     NV6     NV6     32-63           1
GPU5    SYS     SYS     SYS     SYS     NV6      X      NV6     NV6     32-63           1
GPU6    SYS     SYS     SYS     SYS     NV6     NV6      X      NV6     32-63           1
GPU7    SYS     SYS     SYS     SYS     NV6     NV6     NV6      X      32-63           1
"""
MATRICES = {"FOUR_GPUS": FOUR_GPUS, "EIGHT_GPUS": EIGHT_GPUS}


def _speed(code: str) -> tuple[int, int]:
    """Smaller is faster: the kind of link (hardware.LINKS is ordered fastest first), then, for
    NVLink, more links before fewer (NV18 before NV4)."""
    kind = next(i for i, prefix in enumerate(hardware.LINKS) if code.startswith(prefix))
    links = int(code[2:]) if code.startswith("NV") and code[2:].isdigit() else 0
    return kind, -links


def _gpus(topo: str) -> list[int]:
    return [int(line.split()[0][3:]) for line in topo.splitlines() if line.startswith("GPU")]


def best_pair(topo, busy=()):
    """The two free GPUs of an `nvidia-smi topo -m` matrix with the fastest link between them."""
    from itertools import combinations

    from kit.budget import hardware

    def speed(code):  # smaller is faster: the kind of link, then more NVLink links first
        kind = next(i for i, prefix in enumerate(hardware.LINKS) if code.startswith(prefix))
        return kind, -int(code[2:]) if code.startswith("NV") else 0

    free = [int(line.split()[0][3:]) for line in topo.splitlines()
            if line.startswith("GPU") and int(line.split()[0][3:]) not in busy]
    return min(combinations(free, 2), key=lambda p: speed(hardware.link_between(topo, *p)))


def best_group(topo, k, busy=()):
    """The k free GPUs whose slowest link among them is the fastest: a group's collectives move
    at the pace of its slowest pair."""
    from itertools import combinations

    from kit.budget import hardware

    def speed(code):
        kind = next(i for i, prefix in enumerate(hardware.LINKS) if code.startswith(prefix))
        return kind, -int(code[2:]) if code.startswith("NV") else 0

    def slowest(group):
        return max(speed(hardware.link_between(topo, a, b)) for a, b in combinations(group, 2))

    free = [int(line.split()[0][3:]) for line in topo.splitlines()
            if line.startswith("GPU") and int(line.split()[0][3:]) not in busy]
    return min(combinations(free, k), key=slowest)


def _first_free_pair(topo, busy=()):
    free = [g for g in _gpus(topo) if g not in busy]
    return free[0], free[1]


def _kind_only(topo, busy=()):
    free = [g for g in _gpus(topo) if g not in busy]
    return min(combinations(free, 2), key=lambda p: _speed(hardware.link_between(topo, *p))[0])


def _ignores_busy(topo, busy=()):
    return min(combinations(_gpus(topo), 2), key=lambda p: _speed(hardware.link_between(topo, *p)))


def _greedy_group(topo, k, busy=()):
    """Start from the fastest pair, then add whichever GPU has the fastest link to the group."""
    group = list(best_pair(topo, busy))
    while len(group) < k:
        rest = [g for g in _gpus(topo) if g not in busy and g not in group]
        group.append(min(rest, key=lambda g: min(
            _speed(hardware.link_between(topo, g, m)) for m in group)))
    return tuple(sorted(group))


def _slowest(topo: str, group) -> tuple[tuple[int, int], int, int]:
    return max((_speed(hardware.link_between(topo, a, b)), a, b) for a, b in combinations(group, 2))


# (matrix name, busy GPUs) a learner's best_pair is called on, and (matrix, k, busy) for best_group
PAIR_CASES = [("FOUR_GPUS", (0,)), ("FOUR_GPUS", ()), ("EIGHT_GPUS", ()), ("EIGHT_GPUS", (3,)),
              ("EIGHT_GPUS", (0, 1, 2, 3))]
GROUP_CASES = [("EIGHT_GPUS", 4, ()), ("EIGHT_GPUS", 4, (0,)), ("EIGHT_GPUS", 2, (3,)),
               ("FOUR_GPUS", 3, ())]


def _gpu_set(answer, size: int) -> tuple[int, ...] | str:
    try:
        got = tuple(sorted(int(g) for g in answer))
    except (TypeError, ValueError):
        return f"it returned {answer!r}: return {size} GPU numbers, such as {tuple(range(size))}"
    if len(set(got)) != size:
        return f"it returned {answer!r}: return {size} different GPU numbers"
    return got


def _call(fn, *args):
    try:
        return fn(*args), None
    except Exception as e:  # the learner's code raised: say where, as a hint
        return None, f"{type(e).__name__}: {e}"


def _check_pair_fn(fn) -> str | None:
    if not callable(fn):
        return "give the function itself: exercises.check(\"00.5\", best_pair) (no parentheses)"
    for name, busy in PAIR_CASES:
        topo = MATRICES[name]
        call = f"best_pair({name}, busy={busy})"
        got, error = _call(fn, topo, busy)
        if error:
            return f"{call} raised {error}"
        pair = _gpu_set(got, 2)
        if isinstance(pair, str):
            return f"{call}: {pair}"
        if set(pair) & set(busy):
            return f"{call} returned {pair}, but GPU{sorted(set(pair) & set(busy))[0]} is busy"
        if not set(pair) <= set(_gpus(topo)):
            return f"{call} returned {pair}: that matrix has GPUs {_gpus(topo)}"
        link = hardware.link_between(topo, *pair)
        best = hardware.link_between(topo, *best_pair(topo, busy))
        if _speed(link) == _speed(best):
            continue
        why = ("more NVLink links are faster: NV18 carries more than NV12 or NV4"
               if link.startswith("NV") and best.startswith("NV")
               else "NV# beats every PCIe code, and the PCIe codes run PIX, PXB, PHB, NODE, SYS")
        return (f"{call} returned {pair}, which talk over {link}; a free pair there talks over "
                f"{best}: {why}")
    return None


def _check_group_fn(fn) -> str | None:
    if not callable(fn):
        return "give the function itself: exercises.check(\"00.6\", best_group) (no parentheses)"
    for name, k, busy in GROUP_CASES:
        topo = MATRICES[name]
        call = f"best_group({name}, {k}, busy={busy})"
        got, error = _call(fn, topo, k, busy)
        if error:
            return f"{call} raised {error}"
        group = _gpu_set(got, k)
        if isinstance(group, str):
            return f"{call}: {group}"
        if set(group) & set(busy) or not set(group) <= set(_gpus(topo)):
            return f"{call} returned {group}: pick {k} of the free GPUs"
        mine, best = _slowest(topo, group), _slowest(topo, best_group(topo, k, busy))
        if mine[0] == best[0]:
            continue
        link = hardware.link_between(topo, mine[1], mine[2])
        return (f"{call} returned {group}, where GPU{mine[1]} and GPU{mine[2]} talk over {link}. "
                "A group's collectives move at the pace of its slowest pair: compare groups by "
                "their slowest link, not by their fastest one")
    return None


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


@cache
def _on_ranks(source: str, name: str, lengths: tuple[int, ...]) -> list[dict]:
    """What each of 2 gloo processes got from the learner's function (kit.lab.exercise_ranks, in a
    child process: this kernel imports no torch). Cached by source: checking the same code again
    costs nothing."""
    from kit.run import child

    return child.call("kit.lab.exercise_ranks:collective", source=source, name=name,
                      lengths=list(lengths), world=WORLD, timeout=120)  # fmt: skip


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
    return _diagnose(_on_ranks(source_of(fn), fn.__name__, lengths), stretch)


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
    ),
    Exercise(
        key="00.5",
        question=("Hands-on, quick: write best_pair(topo, busy=()), the two GPUs not in busy whose "
                  "link in the `nvidia-smi topo -m` matrix topo is the fastest (a tuple of two "
                  "GPU numbers; hardware.link_between(topo, a, b) reads one entry). The check "
                  "calls it on nb00.FOUR_GPUS and nb00.EIGHT_GPUS with several busy GPUs."),
        check=_check_pair_fn,
        solution=lambda: best_pair,
        wrong=(_first_free_pair, _kind_only, _ignores_busy),
        hands_on=True,
    ),
    Exercise(
        key="00.6",
        question=("Hands-on, stretch: write best_group(topo, k, busy=()), the k free GPUs for a "
                  "k-process run, those whose slowest link among them is the fastest. The check "
                  "calls it on both matrices with k = 2, 3 and 4."),
        check=_check_group_fn,
        solution=lambda: best_group,
        wrong=(_greedy_group,),
        hands_on=True,
    ),
    Exercise(
        key="00.7",
        question=("Plan: kit:llama-8b under FSDP on 4 GPUs. Of how many of its decoder layers "
                  "does each rank hold a part of the weights? (shapes.shape_of tells how many "
                  "layers it has; answer: a number)"),
        check=number(shapes.shape_of("kit:llama-8b").layers, {
            8: "FSDP does not hand out whole layers to ranks (that is pipeline parallelism): "
               "look again at how the primer's FSDP step splits one layer's weight",
            1: "each rank does hold a shard of the layer it is computing, but not only of that "
               "one: the shards stay on their rank between steps",
        }, "count the decoder layers (shapes.shape_of) and think about what FSDP splits",
            whole=True),
        solution=lambda: shapes.shape_of("kit:llama-8b").layers,
        wrong=(8, 1),
    ),
]
