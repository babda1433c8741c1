"""Two of the articles' process-level claims checked in a fresh process (rank side: they import torch
or tokenizers; the notebooks call them through kit.run.child, so a kernel stays torch-free).

    child.call("kit.lab.article_checks:sampler_shares", samples=16, nodes=2, per_node=2)
    child.call("kit.lab.article_checks:tokenize_then_fork", tokenizer=PATH, parallelism=None)
"""

from __future__ import annotations

import os


def sampler_shares(samples: int, nodes: int, per_node: int) -> dict[str, dict[int, list[int]]]:
    """The samples torch's DistributedSampler hands each global rank of `nodes` x `per_node`
    processes, with rank= the process's LOCAL_RANK (the first article's script) or its RANK."""
    from torch.utils.data.distributed import DistributedSampler

    world = nodes * per_node
    return {rank_from: {rank: list(DistributedSampler(
                range(samples), num_replicas=world, shuffle=False,
                rank=rank % per_node if rank_from == "LOCAL_RANK" else rank))
            for rank in range(world)}
            for rank_from in ("LOCAL_RANK", "RANK")}  # fmt: skip


def _threads() -> int:
    return len(os.listdir("/proc/self/task"))


def tokenize_then_fork(tokenizer: str, parallelism: str | None, rows: int = 4096) -> dict:
    """A fast tokenizer encodes a batch in this process, then the process forks (what a DataLoader
    worker is on Linux) and the child encodes again: the threads each side used and the child's exit
    status. `parallelism`: TOKENIZERS_PARALLELISM's value, None to leave it unset."""
    os.environ.pop("TOKENIZERS_PARALLELISM", None)
    if parallelism is not None:
        os.environ["TOKENIZERS_PARALLELISM"] = parallelism
    import tokenizers

    tok = tokenizers.Tokenizer.from_file(tokenizer)
    text = ["a few words for the tokenizer to split"] * rows
    tok.encode_batch(text)
    parent = _threads()
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: encode again, report its thread count, leave without cleanup
        os.close(read)
        tok.encode_batch(text)
        os.write(write, str(_threads()).encode())
        os._exit(0)
    os.close(write)
    child = int(os.read(read, 16) or -1)
    _, status = os.waitpid(pid, 0)
    return {"TOKENIZERS_PARALLELISM": parallelism or "unset", "parent threads": parent,
            "child threads": child, "child exit status": status}
