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


class PeerFailed(Exception):
    """Another rank met the mistake and said it; this rank ends quietly with the same exit code."""

    def __init__(self, code: int):
        self.code = code
        super().__init__(f"another rank failed (exit code {code})")


def _exit_code_of(error: BaseException) -> int:
    from kit.config import ConfigError

    return 2 if isinstance(error, ConfigError) else 1


def on_main(env: DistEnv, fn):
    """fn() on rank 0, its result on every rank: for what every rank would find alike (the
    config, the model's folder, the run folder). A mistake is said once, by rank 0; the others
    end quietly with its exit code (PeerFailed)."""
    box = [None, 0]
    if env.is_main:
        try:
            box[0] = fn()
        except BaseException as e:
            if env.world_size > 1:
                dist.broadcast_object_list([None, _exit_code_of(e)], src=0)
            raise
    if env.world_size > 1:
        dist.broadcast_object_list(box, src=0)
    if box[1]:
        raise PeerFailed(box[1])
    return box[0]


@contextlib.contextmanager
def main_process_first(env: DistEnv):
    """Rank 0 does the body first (builds a model, fills a cache), then the others reuse it. If
    rank 0's body raises, the others are told so instead of waiting in a barrier that rank 0
    never reaches: they end quietly (PeerFailed) while rank 0 reports the mistake, once."""
    if not env.is_main:
        box = [0]
        dist.broadcast_object_list(box, src=0)
        if box[0]:
            raise PeerFailed(box[0])
        yield
        return
    try:
        yield
    except BaseException as e:
        if env.world_size > 1:
            dist.broadcast_object_list([_exit_code_of(e)], src=0)
        raise
    if env.world_size > 1:
        dist.broadcast_object_list([0], src=0)


def mean(value: float, env: DistEnv) -> float:
    """Average a float over ranks (a collective: every rank must call it)."""
    t = torch.tensor([float(value)], dtype=torch.float64, device=env.device)
    dist.all_reduce(t)
    return t.item() / env.world_size


def cleanup() -> None:
    """Leave the process group. Collected first: sharded modules live in reference cycles (their
    hooks), so without a collection their tensors and the group's pending work outlive the group
    into interpreter shutdown, where a gloo worker thread releasing them aborted a rank after
    every case had passed ("terminate called without an active exception", SIGABRT; seen once
    on a 2-core CPU under load)."""
    if dist.is_initialized():
        import gc

        gc.collect()
        dist.destroy_process_group()


def leave(code) -> None:
    """End a rank's process with `code` (sys.exit's meaning: None is 0, an int itself), skipping
    the interpreter's teardown: freeing torch's, transformers' and bitsandbytes' modules and their
    C++ state took 1.4 s on an idle 2-core CPU and ~3 s with two ranks on it, after the run's
    last line (kit.train, 2 steps on the tiny model: 23 s in all). Python's exit has no switch
    for this, hence os._exit, after what its teardown would have done that matters here: the
    streams and logging handlers flushed. Files the kit writes are closed where written; an
    exception still leaves through the normal path (torchrun's @record needs it), and so does a
    process being profiled or traced (cProfile, coverage write their results at exit)."""
    import logging
    import sys

    if sys.getprofile() is not None or sys.gettrace() is not None:
        sys.exit(code)
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(0 if code is None else code if isinstance(code, int) else 1)


def entry(body) -> int:
    """A rank's entry point around `body()` (kit.train, kit.sft.trainer), whose int is the exit code (any
    other value: 0): a ConfigError is one line and exit 2, a CheckpointError one line and exit 1;
    any other exception has each traceback line prefixed with the rank, then re-raised
    (torchrun's @record writes it to the rank's error file)."""
    import sys
    import time
    import traceback

    from kit.config import ConfigError
    from kit.folder.manifest import CheckpointError

    rank = os.environ.get("RANK", "0")
    try:
        code = body()
    except PeerFailed as e:  # another rank said what went wrong; leave the group, then end
        cleanup()
        return e.code
    except ConfigError as e:  # bad input: one line, no traceback
        # Found before the process group exists, it came from what every rank reads alike (the
        # config, the command line): rank 0 says it, the others end quietly with the same code.
        if rank == "0" or dist.is_initialized():  # several problems (check's Refused): a line each
            sys.stderr.writelines(f"[rank {rank}] ConfigError: {line}\n"
                                  for line in str(e).splitlines())
        else:  # torchrun stops every rank once one has ended: a quiet rank that ended first
            time.sleep(3)  # would stop rank 0 before its line (no group to wait on yet)
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
