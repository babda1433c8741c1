"""Process group for torchrun: one process per device, nccl on GPU, gloo on CPU.

Started without torchrun (a notebook, a test, `python -m kit.train`), it forms a group of one, so
the same recipe code runs everywhere.
"""

from __future__ import annotations

import contextlib
import os
import socket
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from kit.config import ConfigError


@dataclass
class DistEnv:
    rank: int
    local_rank: int
    world_size: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def say_if_alone(module: str) -> None:
    """One line when a recipe is started without torchrun: it then runs as a world of one, where
    a config's batch and steps mean other things than under torchrun --nproc_per_node=2."""
    if "RANK" not in os.environ:
        print(f"{module}: started without torchrun, so it runs one process (world size 1); "
              f"torchrun --standalone --nproc_per_node=N -m {module} ... runs N", flush=True)


def init(device: str = "auto", timeout_min: int = 30) -> DistEnv:
    """Join (or form) the process group; device 'auto' is cuda when there is one."""
    if "RANK" not in os.environ:  # not under torchrun: a group of one
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(_free_port()))
    rank, local_rank = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"])
    world = int(os.environ["WORLD_SIZE"])
    if device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("training.device: 'cuda' is not allowed; no GPU is visible here "
                          "(torch.cuda.is_available() is False); use auto or cpu")
    use_cuda = device == "cuda" or (device == "auto" and torch.cuda.is_available())
    if use_cuda:
        dev = torch.device("cuda", local_rank)
        torch.cuda.set_device(dev)
    else:
        dev = torch.device("cpu")
    if not dist.is_initialized():
        dist.init_process_group(
            backend="nccl" if use_cuda else "gloo",
            timeout=timedelta(minutes=timeout_min),
            device_id=dev if use_cuda else None,
        )
    return DistEnv(rank, local_rank, world, dev)


def joined(env: DistEnv) -> None:
    """Every rank's one line of its own (the run's other lines are rank 0's): which rank, which
    process and device, in a log where torchrun prefixes each line with the rank."""
    backend = dist.get_backend() if dist.is_initialized() else "none"
    print(f"rank {env.rank} of {env.world_size}: pid {os.getpid()}, {env.device}, {backend}",
          flush=True)


@contextlib.contextmanager
def main_process_first(env: DistEnv):
    """Rank 0 does the body first (builds a model, fills a cache), then the others reuse it."""
    if not env.is_main:
        dist.barrier()
    yield
    if env.is_main:
        dist.barrier()


def mean(value: float, env: DistEnv) -> float:
    """Average a float over ranks (a collective: every rank must call it)."""
    t = torch.tensor([float(value)], dtype=torch.float64, device=env.device)
    dist.all_reduce(t)
    return t.item() / env.world_size


def cleanup() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def entry(body) -> int:
    """A rank's entry point around `body()` (kit.train, kit.recipe.sft), whose int is the exit code (any
    other value: 0): a ConfigError is one line and exit 2, a CheckpointError one line and exit 1;
    any other exception has each traceback line prefixed with the rank, then re-raised
    (torchrun's @record writes it to the rank's error file)."""
    import sys
    import traceback

    from kit.config import ConfigError
    from kit.folder.manifest import CheckpointError

    rank = os.environ.get("RANK", "0")
    try:
        code = body()
    except ConfigError as e:  # bad input: one line, no traceback
        sys.stderr.write(f"[rank {rank}] ConfigError: {e}\n")
        return 2
    except CheckpointError as e:  # a checkpoint that cannot be written or read: one line too
        sys.stderr.write(f"[rank {rank}] CheckpointError: {e}\n")
        return 1
    except BaseException:
        lines = traceback.format_exc().rstrip().splitlines()
        sys.stderr.write("".join(f"[rank {rank}] {line}\n" for line in lines))
        sys.stderr.flush()
        raise
    return code if isinstance(code, int) else 0
