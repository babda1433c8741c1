"""The plan on the rank side: this machine's GPUs and the data's rows, handed to the planner
(kit.budget.plan), which chooses every config value left at "auto".

    planned = resolve(cfg, env)     # rank 0 (kit.train), or a command's own process (kit plan)
    planned.cfg                     # nothing "auto" left

Rank 0 plans and every rank trains with its plan (kit.recipe.dist.on_main): one GPU kind per job.
"""

from __future__ import annotations

import importlib.util
import os

import torch

from kit.budget import hardware as machine_probe
from kit.budget import plan as kplan
from kit.config import AUTO, Config, DataConfig
from kit.inputs import builtin, sources


def hardware(device: torch.device, world_size: int) -> kplan.Hardware:
    """This process's device as the planner sees it (kit.budget.hardware.for_plan, its one FP8
    rule): on a GPU its memory under any cap set with torch.cuda.set_per_process_memory_fraction
    (kit.bench's caps), its name and compute capability; the node's host memory over its
    processes (LOCAL_WORLD_SIZE, torchrun's)."""
    if device.type != "cuda":
        return kplan.Hardware("cpu", world_size)
    props = torch.cuda.get_device_properties(device)
    fraction = torch.cuda.get_per_process_memory_fraction(device)
    gpu = {"name": props.name, "memory_gib": round(props.total_memory * fraction / 2**30, 2),
           "capability": f"{props.major}.{props.minor}"}
    machine = {"gpus": [gpu], "host_ram_gib": machine_probe.available_gib(),
               "nproc_per_node": int(os.environ.get("LOCAL_WORLD_SIZE", "1")),
               "packages": {"flash_attn": importlib.util.find_spec("flash_attn") is not None}}
    return machine_probe.for_plan(machine, world_size, "cuda")


def seq_len(cfg: Config) -> int:
    """data.max_seq_len, or for "auto" the data's longest row (`auto_seq_len`) as
    the model's tokenizer reads it, at most the model's max_position_embeddings."""
    if cfg.data.max_seq_len != AUTO:
        return cfg.data.max_seq_len
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(builtin.resolve(cfg.model.name),
                                              trust_remote_code=cfg.model.trust_remote_code)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    most = (sources.model_config(cfg.model.name) or {}).get("max_position_embeddings")
    return auto_seq_len(cfg.data, tokenizer, most if isinstance(most, int) else None)


def auto_seq_len(cfg: DataConfig, tokenizer, most: int | None = None) -> int:
    """data.max_seq_len "auto": the longest row of data.path as the run tokenizes it (its
    end-of-sequence token included), rounded up to a multiple of 8, at most `most` (the model's
    max_position_embeddings); with packing, PACKED_ROW tokens (at most `most`). No row is cut
    and no row is padded past the longest."""
    if most is None and 0 < getattr(tokenizer, "model_max_length", 0) < 10**7:
        most = tokenizer.model_max_length
    from kit.recipe.data import PACKED_ROW, _chats, read_checked  # rows as the run renders them

    if cfg.packing:
        return min(PACKED_ROW, most or PACKED_ROW)

    texts, _ = _chats(read_checked(cfg.path, cfg), cfg, tokenizer, cfg.path)
    eos = tokenizer.eos_token or ""
    longest = max((len(ids) for ids in tokenizer([t + eos for t in texts])["input_ids"]), default=2)
    longest = -(-max(longest, 2) // 8) * 8
    return min(longest, most) if most else longest


def resolve(cfg: Config, device: torch.device, world_size: int,
            hw: kplan.Hardware | None = None) -> kplan.Planned:
    """The plan for `cfg` on `world_size` processes of `device` (or the hardware `hw` says)."""
    return kplan.plan(cfg, hw or hardware(device, world_size), seq_len(cfg),
                      sources.model_config(cfg.model.name),
                      sources.model_facts(cfg.model.name, cfg.model.trust_remote_code))
