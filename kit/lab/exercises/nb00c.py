"""Exercises of setup and hardware (notebook 00c), hands-on: the fastest GPUs of an
`nvidia-smi topo -m` matrix, a pair (00.5) and a group (00.6, stretch); then what FSDP shards of
a model's layers (00.7). The primer's exercises (00.1-00.4) are in nb00b.py."""

from __future__ import annotations

from itertools import combinations

from kit.budget import shapes
from kit.lab import hardware
from kit.lab.exercises import Exercise
from kit.lab.exercises.checks import number

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

    from kit.lab import hardware

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

    from kit.lab import hardware

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


EXERCISES = [
    Exercise(
        key="00.5",
        question=("Hands-on, quick: write best_pair(topo, busy=()), the two GPUs not in busy whose "
                  "link in the `nvidia-smi topo -m` matrix topo is the fastest (a tuple of two "
                  "GPU numbers; hardware.link_between(topo, a, b) reads one entry). The check "
                  "calls it on nb00c.FOUR_GPUS and nb00c.EIGHT_GPUS with several busy GPUs."),
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
