"""Exercises of the two 00 notebooks: the primer (00.1, 00.2: what the ring's collectives write,
per rank) and setup and hardware (00.3: reading `nvidia-smi topo -m`; 00.4: what FSDP shards)."""

from __future__ import annotations

from itertools import combinations

from kit.budget import hardware, shapes
from kit.lab import collectives
from kit.lab.exercises import Exercise
from kit.lab.exercises.checks import number

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


def _speed(code: str) -> int:
    """0 for the fastest kind of link (hardware.LINKS is ordered fastest first)."""
    return next(i for i, prefix in enumerate(hardware.LINKS) if code.startswith(prefix))


def _best_pair_without_gpu0() -> tuple[int, int]:
    pairs = combinations((1, 2, 3), 2)
    return min(pairs, key=lambda p: _speed(hardware.link_between(FOUR_GPUS, *p)))


def _check_pair(answer) -> str | None:
    try:
        pair = tuple(sorted(int(g) for g in answer))
    except (TypeError, ValueError):
        return "expected two GPU numbers, such as (0, 3)"
    if len(pair) != 2 or pair[0] == pair[1]:
        return "expected two different GPU numbers, such as (0, 3)"
    if pair == _best_pair_without_gpu0():
        return None
    if 0 in pair:
        return "GPU0 is busy with another job: pick two of GPU1, GPU2 and GPU3"
    link = hardware.link_between(FOUR_GPUS, *pair)
    return (f"GPU{pair[0]} and GPU{pair[1]} talk over {link}: {hardware.describe_link(link)}; "
            "another pair has a faster link (the codes run from NV# down to SYS)")


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
        question=("On the 4-GPU machine whose `nvidia-smi topo -m` is printed above (the "
                  "matrix is kit.lab.exercises.nb00.FOUR_GPUS), GPU0 is busy with another job. "
                  "Which two GPUs should a 2-process FSDP run use, so that its all-gathers take "
                  "the fastest link? (answer: a pair, such as (0, 3))"),
        check=_check_pair,
        solution=_best_pair_without_gpu0,
        wrong=((0, 1), (2, 3), (1, 3)),
    ),
    Exercise(
        key="00.4",
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
