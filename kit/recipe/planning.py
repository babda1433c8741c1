"""The plan on the rank side: this machine's GPUs and the data's rows, handed to the planner
(kit.budget.plan), which chooses every config value left at "auto".

    planned = resolve(cfg, device, world_size)   # rank 0 of a start nobody planned, or kit plan
    planned.cfg                                  # nothing "auto" left
    start = Planning(cfg, hw, world_size, facts)  # a start planned in a command's own process:
    start.planned, start.data_line()             # kit.run.check.check, the data tokenized once

A checked start plans once, before any rank (kit.run.check.check: its start.json); rank 0 plans
only for a start nobody planned, and every rank trains with its plan (kit.recipe.dist.on_main):
one GPU kind per job.
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import replace

import torch

from kit.budget import machine as machine_probe
from kit.budget import plan as kplan
from kit.config import AUTO, Config, DataConfig
from kit.folder import runfolder, start
from kit.inputs import builtin, checks, sources
from kit.inputs.datafile import PACKED_ROW
from kit.recipe import data


def hardware(device: torch.device, world_size: int) -> kplan.Hardware:
    """This process's device as the planner sees it (kit.budget.machine.for_plan, its one FP8
    rule): on a GPU its memory under any cap set with torch.cuda.set_per_process_memory_fraction
    (kit.bench's caps: the allocator's own, nothing reserved beside it for the CUDA context),
    its name and compute capability; the node's host memory over its processes
    (LOCAL_WORLD_SIZE, torchrun's)."""
    if device.type != "cuda":
        return kplan.Hardware("cpu", world_size)
    props = torch.cuda.get_device_properties(device)
    fraction = torch.cuda.get_per_process_memory_fraction(device)
    gpu = {"name": props.name, "memory_gib": round(props.total_memory * fraction / 2**30, 2),
           "capability": f"{props.major}.{props.minor}"}
    machine = {"gpus": [gpu], "host_ram_gib": machine_probe.available_gib(),
               "nproc_per_node": int(os.environ.get("LOCAL_WORLD_SIZE", "1")),
               "packages": {name: importlib.util.find_spec(name) is not None
                            for name in ("flash_attn", "triton")}}
    planned = machine_probe.for_plan(machine, world_size, "cuda")
    # Under a cap the allocator has memory_gib to itself: the context sits beside it.
    return replace(planned, outside_gib=0.0) if fraction < 1 else planned


def tokenizer_of(cfg: Config):
    """model.name's tokenizer, as the ranks pad with it."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(builtin.resolve(cfg.model.name),
                                              trust_remote_code=cfg.model.trust_remote_code)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def seq_len(cfg: Config, tokenizer=None, split: data.Split | None = None) -> int:
    """data.max_seq_len, or for "auto" the data's longest row (`auto_seq_len`) as
    the model's tokenizer reads it, at most the model's max_position_embeddings."""
    if cfg.data.max_seq_len != AUTO:
        return cfg.data.max_seq_len
    most = (sources.model_config(cfg.model.name) or {}).get("max_position_embeddings")
    return auto_seq_len(cfg.data, tokenizer or tokenizer_of(cfg),
                        most if isinstance(most, int) else None, split)


def auto_seq_len(cfg: DataConfig, tokenizer, most: int | None = None,
                 split: data.Split | None = None) -> int:
    """data.max_seq_len "auto": the longest row of data.path as the run tokenizes it (its
    end-of-sequence token included; `split`: the rows tokenized already, else here), rounded up
    to a multiple of 8, at most `most` (the model's max_position_embeddings); with packing,
    PACKED_ROW tokens (at most `most`). No row is cut and no row is padded past the longest."""
    if most is None and 0 < getattr(tokenizer, "model_max_length", 0) < 10**7:
        most = tokenizer.model_max_length
    if cfg.packing:
        return min(PACKED_ROW, most or PACKED_ROW)
    split = split or data.Split(cfg, tokenizer, seed=0)  # the longest row: any split of them
    longest = -(-max(split.longest(), 2) // 8) * 8
    return min(longest, most) if most else longest


def resolve(cfg: Config, device: torch.device, world_size: int,
            hw: kplan.Hardware | None = None, facts: dict | None = None,
            split: data.Split | None = None) -> kplan.Planned:
    """The plan for `cfg` on `world_size` processes of `device` (or the hardware `hw` says);
    facts: kit.inputs.sources.model_facts (read here when not given); split: the data's rows
    tokenized already (data.max_seq_len=auto)."""
    if facts is None:
        facts = sources.model_facts(cfg.model.name, cfg.model.trust_remote_code)
    return kplan.plan(cfg, hw or hardware(device, world_size), seq_len(cfg, split=split),
                      sources.model_config(cfg.model.name), facts)


class Planning:
    """The plan of a start made in one process (kit.run.check.check, `kit train`'s own or
    run.sh's check step) and its data line: the data read and tokenized once for both
    (data.max_seq_len=auto's longest row, and the rows as the ranks will cut them). `planned`:
    the start's plan already made (a set data.max_seq_len needs no rows)."""

    def __init__(self, cfg: Config, hw: kplan.Hardware, world_size: int, facts: dict | None,
                 planned: kplan.Planned | None = None):
        self.cfg, self.world_size = cfg, world_size
        self._split: data.Split | None = None
        self.planned = planned or resolve(cfg, None, world_size, hw, facts,
                                          self.split if cfg.data.max_seq_len == AUTO else None)

    @property
    def split(self) -> data.Split:
        if self._split is None:
            self._split = data.Split(self.cfg.data, tokenizer_of(self.cfg), self.cfg.training.seed)
        return self._split

    def data_line(self) -> str:
        """What the ranks will print of their data (kit.recipe.data.summary); a training split
        too small for every rank refused here (kit.recipe.data.fits), before any model loads."""
        cfg, world = self.planned.cfg, self.world_size
        train, val = self.split.rows(cfg.data.max_seq_len)
        data.fits(train, cfg.training.batch_size, world)
        return data.summary(train, val, cfg.data, cfg.training, world)


def rank_zero(cfg: Config, env, engine) -> tuple[data.Split | None, runfolder.Decision,
                                                 kplan.Planned | None]:
    """What rank 0 of `env` starts from: the start's run-folder plan and plan (kit.folder.start:
    checked and planned before any rank); for a start nobody checked (bare torchrun), the check
    step itself, as run.sh runs it (kit.inputs.checks.step), and both plans here; a restart plans
    its folder again (newer checkpoints: hashed once, before any rank writes; nothing trained is
    replaced in place). Also the data's rows where they were tokenized to measure
    data.max_seq_len=auto (the split then reuses them); None: the finished run's plan."""
    begun = start.for_ranks(cfg, env.world_size)  # KIT_START: kit train, launch, run.sh
    if begun is None:
        engine.check(cfg, env.world_size)
        per_node = int(os.environ.get("LOCAL_WORLD_SIZE") or env.world_size)
        checks.step(cfg, per_node, max(1, env.world_size // per_node))
    folder = (begun and begun.folder) or runfolder.decide(cfg, env.world_size, ranks=True)
    if folder.start is None:
        return None, folder, None
    if begun and begun.plan:
        planned = kplan.Planned.from_json(begun.plan)
        planned.cfg.run.output_dir = cfg.run.output_dir  # as this start names its folder
        return None, folder, planned
    builtin.resolve(cfg.model.name)  # a kit model is built once, here, for its tokenizer
    split = None
    if cfg.data.max_seq_len == AUTO:  # its rows tokenized once: the length, then the split
        split = data.Split(cfg.data, tokenizer_of(cfg), cfg.training.seed)
    return split, folder, resolve(cfg, env.device, env.world_size, split=split)
