"""Ranks and collectives, rank side (notebook 00b-primer): what torchrun gave each process, each
collective on small tensors, and one FSDP step written out by hand beside fully_shard's.

    torchrun --nproc_per_node=2 -m kit.lab.collectives_rank CONFIG OUT [CASE ...]

Cases, in order (one row per case and rank: OUT/<case>/rank<R>.json, through the experiment
harness kit.bench.experiment, which also joins the process group as every rank of the kit does):

  environment     the variables torchrun set for this process, its pid and its parent's
  all_gather, reduce_scatter, all_reduce, broadcast
                  this rank's input and output, and the bytes this process wrote to its
                  sockets during the call (gloo over TCP; None under NCCL)
  fsdp_step       one linear layer sharded by rows: forward and backward by hand (all-gather,
                  all-gather, reduce-scatter), then the same step by fully_shard, with the
                  collectives it issued in forward and in backward

The kernel side (kit/lab/collectives.py) starts the launch, reads the rows and shows this file's
functions as they are: what the notebook shows is what the ranks ran.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

import torch
import torch.distributed as dist

from kit.bench import experiment
from kit.recipe import dist as kdist

TORCHRUN_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                      "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID")  # fmt: skip


def environment(case: experiment.Case) -> dict:
    """What torchrun handed this process, and what the process group made of it."""
    return {
        "variables": {k: os.environ.get(k) for k in TORCHRUN_VARIABLES},
        "pid": os.getpid(), "parent pid": os.getppid(),
        "rank": dist.get_rank(), "world size": dist.get_world_size(),
        "backend": dist.get_backend(), "device": str(case.env.device),
    }  # fmt: skip


@contextlib.contextmanager
def bytes_written():
    """Bytes this process passed to write() inside the block: /proc/self/io's wchar, where gloo's
    TCP pairs write their sockets (what they read arrives through recv(), which rchar does not
    count). Gap filled: gloo reports no traffic of its own. None where there is no /proc (macOS)
    and under NCCL (no sockets)."""
    io = Path("/proc/self/io")

    def wchar() -> int:
        line = next(x for x in io.read_text().splitlines() if x.startswith("wchar:"))
        return int(line.split()[1])

    moved = {"written": None}
    before = wchar() if io.is_file() and dist.get_backend() == "gloo" else None
    yield moved
    if before is not None:
        moved["written"] = wchar() - before


def _written(call) -> int | None:
    """Bytes written by one call, measured between barriers after a first call to warm up (a
    first call sets up buffers and may import)."""
    call()
    dist.barrier()
    with bytes_written() as moved:
        call()
    dist.barrier()
    return moved["written"]


def _measured(tensors) -> dict:
    """`tensors(n)` -> (input, output, call) for n elements: shown at n = 2 or 4, bytes measured
    at 65,536 times that, where gloo's fixed cost per call (a few hundred bytes) is lost."""
    shown_in, shown_out, call = tensors(SHOWN)
    written_small = _written(call)
    big_in, _, big_call = tensors(SHOWN * SCALE)
    return {"input": shown_in.tolist(), "output": shown_out.tolist(),
            "written small": written_small, "input bytes small": _nbytes(shown_in),
            "input bytes": _nbytes(big_in), "written": _written(big_call)}  # fmt: skip


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


SHOWN, SCALE = 2, 65_536  # elements per rank's slice, shown; x SCALE for the bytes


def all_gather(case: experiment.Case) -> dict:
    rank, world, device = dist.get_rank(), dist.get_world_size(), case.env.device

    def tensors(n):  # rank 0 holds [1, 2], rank 1 [11, 12]: a shard each
        shard = (torch.arange(1.0, n + 1) + 10 * rank).to(device)
        full = torch.empty(n * world, device=device)  # every rank's shard, in rank order
        return shard, full, lambda: dist.all_gather_into_tensor(full, shard)

    return _measured(tensors)


def reduce_scatter(case: experiment.Case) -> dict:
    rank, world, device = dist.get_rank(), dist.get_world_size(), case.env.device

    def tensors(n):  # a full-size "gradient" on every rank, rank 1's twice rank 0's
        grads = (torch.arange(1.0, n * world + 1) * (rank + 1)).to(device)
        mine = torch.empty(n, device=device)  # slice `rank` of the sum over ranks
        return grads, mine, lambda: dist.reduce_scatter_tensor(mine, grads)

    return _measured(tensors)


def all_reduce(case: experiment.Case) -> dict:
    rank, world, device = dist.get_rank(), dist.get_world_size(), case.env.device

    def tensors(n):  # the same full size on every rank; summed in place on every rank
        start = (torch.arange(1.0, n * world + 1) * (rank + 1)).to(device)
        values = start.clone()
        return start, values, lambda: dist.all_reduce(values.copy_(start))

    return _measured(tensors)


def broadcast(case: experiment.Case) -> dict:
    rank, world, device = dist.get_rank(), dist.get_world_size(), case.env.device

    def tensors(n):  # every rank's own values, overwritten by rank 0's
        start = (torch.arange(1.0, n * world + 1) + 10 * rank).to(device)
        values = start.clone()
        return start, values, lambda: dist.broadcast(values.copy_(start), src=0)

    return _measured(tensors)


def fsdp_step(case: experiment.Case) -> dict:
    """One layer y = x @ W.T (W: 4 x 2) under FSDP on every rank: by hand, then by fully_shard."""
    rank, world, device = dist.get_rank(), dist.get_world_size(), case.env.device
    weight = torch.randn(4, 2, generator=torch.Generator().manual_seed(0)).to(device)
    shard = weight.chunk(world)[rank].clone()  # all this rank keeps of W between steps
    x = torch.randn(3, 2, generator=torch.Generator().manual_seed(1 + rank)).to(device)
    # forward: gather W, compute, free W (autograd keeps x and y, not the gathered weight)
    gathered = torch.empty_like(weight)
    dist.all_gather_into_tensor(gathered, shard)
    y = x @ gathered.T
    del gathered
    dy = 2 * y / y.numel()  # the loss is the mean of y squared
    # backward: gather W again for the input's gradient; W's own gradient needs only x
    gathered = torch.empty_like(weight)
    dist.all_gather_into_tensor(gathered, shard)
    dx, grad = dy @ gathered, dy.T @ x
    grad_shard = torch.empty_like(shard)
    dist.reduce_scatter_tensor(grad_shard, grad)  # summed over the ranks' batches, rows split
    grad_shard /= world  # averaged, as FSDP does
    return {"by hand": grad_shard.tolist(), **_fully_shard_step(weight, x, dx, grad_shard)}


def _fully_shard_step(weight, x, dx, grad_shard) -> dict:
    """The same layer and batch through FSDP2's fully_shard: its weight's gradient shard, whether
    it matches the hand-written one, and the collectives it issued
    (kit.lab.sharding.Collectives)."""
    from torch.distributed.fsdp import fully_shard

    from kit.lab.sharding import Collectives

    layer = torch.nn.Linear(2, 4, bias=False, device=weight.device)
    layer.weight.data.copy_(weight)
    net = torch.nn.Sequential(layer)  # the layer a unit of its own, as a decoder layer is
    fully_shard(layer)
    fully_shard(net)
    x = x.clone().requires_grad_()
    with Collectives() as forward:
        loss = net(x).square().mean()
    with Collectives() as backward:
        loss.backward()
    got = layer.weight.grad.to_local()
    return {"fully_shard": got.tolist(), "same gradient": torch.allclose(got, grad_shard),
            "same input gradient": torch.allclose(x.grad, dx),
            "forward calls": forward, "backward calls": backward}  # fmt: skip


CASES = {f.__name__: f for f in (environment, all_gather, reduce_scatter, all_reduce, broadcast,
                                 fsdp_step)}  # fmt: skip

EXPERIMENT = experiment.Experiment(
    prog="kit.lab.collectives_rank", doc=__doc__, cases=CASES,
    row_path=lambda out, name, rank: out / name / f"rank{rank}.json",
)

if __name__ == "__main__":
    kdist.leave(experiment.main(EXPERIMENT))
