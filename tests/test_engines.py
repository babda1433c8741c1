"""One object per engine (kit.recipe.engines): what differs between FSDP2, FSDP1 and DDP is asked of it.
Each engine wraps, trains and saves for real under torchrun in tests/test_train.py; here, the
answers the recipe, kit.recipe.lora and kit.recipe.checkpoint get without a process group."""

import re

import pytest
import torch

from kit.config import load_config
from kit.recipe import engines


@pytest.mark.parametrize("engine,lora_dtype,expected", [
    ("fsdp2", "auto", torch.float32), ("ddp", "auto", torch.float32),
    ("fsdp1", "auto", torch.bfloat16),  # FSDP1 flattens one dtype per unit: the model's
    ("fsdp2", "bfloat16", torch.bfloat16), ("fsdp1", "bfloat16", torch.bfloat16),
])  # fmt: skip
def test_adapter_dtype_per_engine(engine, lora_dtype, expected):
    cfg = load_config(None, [f"sharding.engine={engine}", f"lora.dtype={lora_dtype}"])
    assert engines.get(engine).adapter_dtype(cfg) == expected


def test_lora_takes_the_engines_adapter_dtype():
    from kit.recipe import model

    cfg = load_config(None, ["sharding.engine=fsdp1", "quantization.method=none"])
    built = model.build(cfg, torch.device("cpu"), train=False)
    dtypes = {p.dtype for p in built.model.parameters() if p.requires_grad}
    assert dtypes == {torch.bfloat16}


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_full_saves_offload_to_cpu_except_under_fsdp1(device):
    """FSDP1 with cpu_offload gathers to rank 0 only, and get_model_state_dict then fails on the
    other ranks (KeyError, 2x H200): its full saves gather on every device instead."""
    dev = torch.device(device)
    assert engines.get("fsdp2").state_dict_options(full=True, device=dev).cpu_offload == (
        device == "cuda")
    assert engines.get("ddp").state_dict_options(full=True, device=dev).cpu_offload == (
        device == "cuda")
    assert engines.get("fsdp1").state_dict_options(full=True, device=dev).cpu_offload is False
    for name in engines.ENGINES:
        options = engines.get(name).state_dict_options(full=False, device=dev)
        assert options.full_state_dict is False and options.ignore_frozen_params is True


def test_every_config_engine_has_an_object():
    from typing import get_args, get_type_hints

    from kit.config import ShardingConfig

    assert set(get_args(get_type_hints(ShardingConfig)["engine"])) == set(engines.ENGINES)


def test_fsdp1_on_one_process_is_refused_before_loading(tmp_path):
    """FSDP1 runs NO_SHARD on one process: its adapter gather fails at save, after every step
    trained (CPU), and its 4-bit forward fails on a GPU (1x H100). Refused with one line first:
    by the launcher and the check step, which know the process count, and by the rank itself
    (started by hand with torchrun) right after joining the process group."""
    from kit.config import ConfigError, load_config
    from kit.run.launch import run_to_end

    line = "sharding.engine: 'fsdp1' is not allowed; on 1 process: FSDP1's NO_SHARD"
    with pytest.raises(ConfigError, match=re.escape(line)):
        run_to_end("tiny-cpu", [f"run.output_dir={tmp_path / 'run'}", "sharding.engine=fsdp1"],
                   nproc=1)
    assert not (tmp_path / "run").exists()
    cfg = load_config(None, ["sharding.engine=fsdp1"])
    with pytest.raises(ConfigError, match=re.escape(line)):
        engines.get("fsdp1").check(cfg, world_size=1)
    engines.get("fsdp1").check(cfg, world_size=2)


@pytest.mark.parametrize("model", ["kit:tiny-llama", "kit:tiny-qwen3-moe"])
def test_fsdp2_on_a_group_of_one_leaves_the_frozen_weights_alone(group_of_one, model):
    """On one rank FSDP2 has nothing to shard, yet each gather copies every parameter of a unit;
    the frozen ones (4-bit weights, norms, the embeddings, a MoE's expert stacks and router)
    stay plain tensors as loaded (ignored_params), the adapters are FSDP2's (DTensors, their
    compute copy cast to bf16), and a step gives every adapter a gradient."""
    from torch.distributed.tensor import DTensor

    from kit.recipe import model as kmodel

    cfg = load_config(None, [f"model.name={model}", "data.max_seq_len=16"])
    built = kmodel.build(cfg, torch.device("cpu"))
    wrapped = engines.get("fsdp2").wrap(built.model, cfg, torch.device("cpu"))
    params = dict(wrapped.named_parameters())
    frozen = {n for n, p in params.items() if not p.requires_grad}
    assert frozen and not any(isinstance(params[n], DTensor) for n in frozen)
    trainable = [p for p in params.values() if p.requires_grad]
    assert trainable and all(isinstance(p, DTensor) for p in trainable)
    ids = torch.randint(3, 100, (2, 16))
    wrapped(input_ids=ids, labels=ids, use_cache=False).loss.backward()
    assert all(p.grad is not None for p in trainable)


def test_on_one_rank_the_kits_fsdp2_copies_only_the_adapters(group_of_one):
    """What the frozen weights' leaving FSDP2 saves (notebook 04): one step on one rank copies
    each managed parameter at each gather; as torch wraps it every parameter, with the kit's
    engine only the adapters (their bf16 cast): fewer calls and bytes."""
    from kit.lab import sharding
    from kit.recipe import model as kmodel

    cfg = load_config(None, ["model.name=kit:tiny-llama", "data.max_seq_len=16"])
    ids = torch.randint(3, 100, (2, 16))
    got = {}
    for name, wrap in (("kit", sharding.shard), ("torch", sharding.shard_every)):
        wrapped = wrap(kmodel.build(cfg, torch.device("cpu")).model, cfg, torch.device("cpu"))
        with sharding.Copies() as copies:
            wrapped(input_ids=ids, labels=ids, use_cache=False).loss.backward()
        got[name] = copies
    adapters = sum(p.requires_grad for p in wrapped.parameters())
    assert got["kit"].calls < got["torch"].calls and got["kit"].bytes < got["torch"].bytes / 2
    assert got["kit"].calls >= 2 * adapters  # each adapter factor, forward and backward
