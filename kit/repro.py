"""Rank side of notebook 11: each known pitfall, as a user's script meets it, on the tiny model.

    torchrun --standalone --nproc_per_node=2 -m kit.repro --out DIR prepare-kbit uint8-storage
    torchrun --standalone --nproc_per_node=2 -m kit.repro --out DIR --fixed prepare-kbit

Each case is the article's pattern in a few lines; `--fixed` applies the one change the doctor
recommends. Cases run in turn in one process group: they fail identically on every rank before
any collective is left half done, rank-0-only work comes after a case's last collective, and the
timeout case times out on a group of its own, so the default group stays usable; a case that
kills a process (`crashes`) must come last. Each rank writes DIR/rank<N>.json after every case:
ok, the exception and its traceback, and what the doctor's in-run checks said.
kit.doctor.reproduce starts this and reads those files; the recipe (kit/train.py) never imports
this module.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import json
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path

CPU_ENV = {"gpus": [], "nproc_per_node": 2, "vars": {}}  # what the doctor assumes for a case


@dataclass(frozen=True)
class Case:
    name: str
    title: str
    run: Callable
    overrides: tuple[str, ...] = ()  # the kit config with the same pitfall (doctor preflight)
    expect: str = ""  # the code the doctor must give the raw failure
    crashes: bool = False  # kills a rank's process: runs last in its launch
    env: dict = field(default_factory=lambda: dict(CPU_ENV))


CASES: dict[str, Case] = {}


def case(
    name: str,
    title: str,
    expect: str,
    overrides: tuple[str, ...] = (),
    crashes: bool = False,
):
    def register(fn):
        CASES[name] = Case(name, title, fn, overrides, expect, crashes)
        return fn

    return register


def source(name: str) -> str:
    """The source text of a case's function (read from this file: no torch import needed)."""
    fn = CASES[name].run.__name__
    text = Path(__file__).read_text()
    node = next(n for n in ast.parse(text).body if getattr(n, "name", "") == fn)
    return ast.get_source_segment(text, node)


# --------------------------------------------------------------------------- shared pieces


def _bnb(storage=None):
    import torch
    from transformers import BitsAndBytesConfig

    return BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type="nf4",
        bnb_4bit_use_double_quant=True,
        bnb_4bit_compute_dtype=torch.bfloat16,
        bnb_4bit_quant_storage=storage or torch.bfloat16,
    )


def _load(quantization=None, attn="sdpa"):
    """The kit's tiny Llama through from_pretrained, NF4 with bf16 storage unless told."""
    import torch
    from transformers import AutoModelForCausalLM

    from kit import builtin

    return AutoModelForCausalLM.from_pretrained(
        builtin.resolve("kit:tiny-llama"),
        dtype=torch.bfloat16,
        quantization_config=quantization or _bnb(),
        attn_implementation=attn,
    )


def _lora(targets=("q_proj", "v_proj")):
    from peft import LoraConfig

    return LoraConfig(r=8, lora_alpha=16, target_modules=list(targets), task_type="CAUSAL_LM")


def _cast_adapters(model, dtype):
    for p in model.parameters():
        if p.requires_grad:
            p.data = p.data.to(dtype)
    return model


def _layers():
    """Wrap each decoder layer (what the kit and the articles do)."""
    from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    return functools.partial(
        transformer_auto_wrap_policy, transformer_layer_cls={LlamaDecoderLayer}
    )


def _steps(model, n: int = 2) -> float:
    """n optimizer steps on a fixed batch; returns the last loss."""
    import torch

    trainable = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trainable, lr=1e-2)
    ids = torch.randint(3, 1024, (2, 16), generator=torch.Generator().manual_seed(0))
    model.train()
    for _ in range(n):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
    return loss.item()


def _fsdp1_lora():
    """A correct FSDP1 QLoRA model (bf16 everywhere, use_orig_params), trained 2 steps; also
    the adapter's layout, which must be read before wrapping (FSDP1 renames the module tree)."""
    import torch
    from peft import get_peft_model
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    from kit.checkpoint import AdapterLayout

    peft_model = _cast_adapters(get_peft_model(_load(), _lora()), torch.bfloat16)
    layout = AdapterLayout(peft_model)
    model = FSDP(
        peft_model, auto_wrap_policy=_layers(), device_id=torch.device("cpu"), use_orig_params=True
    )
    _steps(model)
    return layout, model


# --------------------------------------------------------------------------- the cases
# Each takes (fixed, out) and returns findings of the doctor's in-run checks (or nothing).


@case(
    "fsdp1-fp32-lora",
    "PEFT's float32 adapters next to bf16 weights in one FSDP1 unit",
    "fsdp1_mixed_dtype",
    ("sharding.engine=fsdp1", "lora.dtype=float32"),
)
def fsdp1_fp32_lora(fixed, out):
    import torch
    from peft import get_peft_model
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    model = get_peft_model(_load(), _lora())  # adapters in float32: PEFT's default
    if fixed:
        _cast_adapters(model, torch.bfloat16)  # one dtype per FSDP1 unit
    model = FSDP(
        model, auto_wrap_policy=_layers(), device_id=torch.device("cpu"), use_orig_params=True
    )
    _steps(model)


@case(
    "prepare-kbit",
    "prepare_model_for_kbit_training before FSDP1 (the first article)",
    "fsdp1_mixed_dtype",
)
def prepare_kbit(fixed, out):
    import torch
    from peft import get_peft_model, prepare_model_for_kbit_training
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    model = _load()
    if not fixed:
        model = prepare_model_for_kbit_training(model)  # casts norms, embeddings to float32
    model = _cast_adapters(get_peft_model(model, _lora()), torch.bfloat16)
    model = FSDP(
        model, auto_wrap_policy=_layers(), device_id=torch.device("cpu"), use_orig_params=True
    )
    _steps(model)


@case(
    "uint8-storage",
    "4-bit weights packed in uint8 (bitsandbytes' default) under FSDP1",
    "fsdp1_int_storage",
    ("sharding.engine=fsdp1", "quantization.storage=uint8"),
)
def uint8_storage(fixed, out):
    import torch
    from peft import get_peft_model
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from transformers import BitsAndBytesConfig

    storage = torch.bfloat16 if fixed else torch.uint8
    quant = BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type="nf4",
        bnb_4bit_compute_dtype=torch.bfloat16,
        bnb_4bit_quant_storage=storage,
    )
    model = _cast_adapters(get_peft_model(_load(quant), _lora()), torch.bfloat16)
    model = FSDP(
        model, auto_wrap_policy=_layers(), device_id=torch.device("cpu"), use_orig_params=True
    )
    _steps(model)


@case(
    "peft-auto-wrap",
    "PEFT's fsdp_auto_wrap_policy with float32 adapters (FSDP1)",
    "fsdp1_mixed_dtype_forward",
)
def peft_auto_wrap(fixed, out):
    import torch
    from peft import get_peft_model
    from peft.utils.other import fsdp_auto_wrap_policy
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import MixedPrecision

    model = get_peft_model(_load(), _lora())  # adapters in float32, in units of their own
    if fixed:
        _cast_adapters(model, torch.bfloat16)
    bf16 = MixedPrecision(
        param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16, buffer_dtype=torch.bfloat16
    )  # the article's policy
    model = FSDP(
        model,
        auto_wrap_policy=fsdp_auto_wrap_policy(model),
        mixed_precision=bf16,
        device_id=torch.device("cpu"),
        use_orig_params=True,
    )
    _steps(model)


@case(
    "no-orig-params",
    "LoRA under FSDP1 with use_orig_params=False",
    "fsdp1_use_orig_params",
    ("sharding.engine=fsdp1", "sharding.use_orig_params=false"),
)
def no_orig_params(fixed, out):
    import torch
    from peft import get_peft_model
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    model = _cast_adapters(get_peft_model(_load(), _lora()), torch.bfloat16)
    model = FSDP(
        model, auto_wrap_policy=_layers(), device_id=torch.device("cpu"), use_orig_params=fixed
    )  # False: frozen + trainable in one FlatParameter
    _steps(model)


@case("cpu-no-device-id", "FSDP1 on CPU without device_id", "fsdp1_no_device_id")
def cpu_no_device_id(fixed, out):
    import torch
    from peft import get_peft_model
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    model = _cast_adapters(get_peft_model(_load(), _lora()), torch.bfloat16)
    kwargs = dict(auto_wrap_policy=_layers(), use_orig_params=True)
    if fixed:
        kwargs["device_id"] = torch.device("cpu")  # FSDP1 must be told it runs on CPU
    model = FSDP(model, **kwargs)
    _steps(model)


@case(
    "shard-grad-op",
    "FSDP1 SHARD_GRAD_OP with 4-bit weights (the first article's tip)",
    "shard_grad_op_4bit",
    ("sharding.engine=fsdp1", "sharding.strategy=SHARD_GRAD_OP"),
)
def shard_grad_op(fixed, out):
    import torch
    from peft import get_peft_model
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import ShardingStrategy

    strategy = ShardingStrategy.FULL_SHARD if fixed else ShardingStrategy.SHARD_GRAD_OP
    model = _cast_adapters(get_peft_model(_load(), _lora()), torch.bfloat16)
    model = FSDP(
        model,
        auto_wrap_policy=_layers(),
        device_id=torch.device("cpu"),
        use_orig_params=True,
        sharding_strategy=strategy,
    )
    _steps(model)


@case(
    "full-state-dict-save",
    "FULL_STATE_DICT + save_pretrained(state_dict=...) (first article)",
    "adapter_empty",
)
def full_state_dict_save(fixed, out):
    import torch.distributed as dist
    from torch.distributed.fsdp import FullStateDictConfig, StateDictType
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    from kit import checkpoint
    from kit.doctor import check_adapter

    folder = Path(out) / "adapter"
    layout, model = _fsdp1_lora()
    if fixed:  # the kit's way: PEFT's keys taken before wrapping, gathered by name, verified
        state = checkpoint.gather_trainable(model)
        if dist.get_rank() == 0:
            checkpoint.save_adapter(layout, state, folder)
    else:
        config = FullStateDictConfig(offload_to_cpu=False, rank0_only=True)
        with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, config):
            state = model.state_dict()
        if dist.get_rank() == 0:
            model.module.save_pretrained(folder, state_dict=state)  # no error, no tensors
    return check_adapter(folder) if dist.get_rank() == 0 else []


@case(
    "offload-to-cpu",
    "FullStateDictConfig(offload_to_cpu=True) on CPU (first article)",
    "segfault",
    crashes=True,
)
def offload_to_cpu(fixed, out):
    from torch.distributed.fsdp import FullStateDictConfig, StateDictType
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    _, model = _fsdp1_lora()
    config = FullStateDictConfig(offload_to_cpu=True, rank0_only=True)
    if fixed:
        config = FullStateDictConfig(offload_to_cpu=False, rank0_only=True)  # CPU/gloo
    with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, config):
        model.state_dict()


@case(
    "target-modules",
    "LoRA target names from another architecture (Falcon's)",
    "target_modules_unmatched",
    ("lora.target_modules=[query_key_value]",),
)
def target_modules(fixed, out):
    from peft import LoraConfig, get_peft_model

    targets = ["q_proj", "v_proj"] if fixed else ["query_key_value"]
    get_peft_model(_load(), LoraConfig(r=8, target_modules=targets, task_type="CAUSAL_LM"))


@case(
    "flash-attn",
    "attn_implementation='flash_attention_2' without flash-attn (and on CPU)",
    "flash_attn_missing",
    ("attention.implementation=flash_attention_2",),
)
def flash_attn(fixed, out):
    _load(attn="sdpa" if fixed else "flash_attention_2")


@case(
    "timeout",
    "rank 0 busy past the collective timeout while rank 1 waits",
    "dist_timeout",
    ("model.name=kit:llama-8b", "run.dist_timeout_min=1"),
)
def timeout(fixed, out):
    import torch.distributed as dist

    # A group of its own: its timeout leaves the default group (and the next cases) working.
    group = dist.new_group(timeout=timedelta(seconds=60 if fixed else 2))
    dist.barrier(group=group)  # connected: what follows is a wait, not a set-up
    if dist.get_rank() == 0:
        time.sleep(5)  # rank 0 writes a checkpoint; the others already wait in the barrier
    dist.barrier(group=group)


@case(
    "eval-mode-checkpointing",
    "gradient checkpointing on a model left in eval mode",
    "eval_mode_checkpointing",
)
def eval_mode_checkpointing(fixed, out):
    from peft import get_peft_model

    from kit.doctor import Finding, check_checkpointing_active

    model = get_peft_model(_load(), _lora())  # from_pretrained returns eval mode
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train(fixed)  # False: left in eval mode, as a script that never calls model.train()
    calls, saved = _forwards_and_saved_bytes(model)
    note = (
        f"attention forwards in one step: {calls} (2 layers: 4 when recomputed); "
        f"bytes saved for backward: {saved:,}"
    )
    return check_checkpointing_active(model) + [Finding("info", "measured", note, "-")]


def _forwards_and_saved_bytes(model) -> tuple[int, int]:
    """Forward calls of each layer's first child in one training step (the recompute calls it
    again), and the bytes autograd kept for backward."""
    import torch

    from kit.layers import decoder_layers

    calls = []  # transformers checkpoints a layer's forward, not its hooks: count a child's
    for layer in decoder_layers(model):
        next(layer.children()).register_forward_hook(lambda *a: calls.append(1))
    saved: dict[int, int] = {}

    def pack(t):
        saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    ids = torch.randint(3, 1024, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return len(calls), sum(saved.values())


# --------------------------------------------------------------------------- running cases


def _report(fn, fixed: bool, out: Path) -> dict:
    try:
        findings = fn(fixed, out) or []
        return {
            "ok": True,
            "error": "",
            "traceback": "",
            "findings": [dataclasses.asdict(f) for f in findings],
        }
    except Exception as e:  # noqa: BLE001 - recording what the user would see is the point
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        return {
            "ok": False,
            "error": f"{type(e).__name__}: {first}"[:400],
            "traceback": traceback.format_exc(),
            "findings": [],
        }


def main(argv: list[str] | None = None) -> int:
    import argparse
    import os

    import torch.distributed as dist

    from kit import builtin
    from kit import dist as kdist

    parser = argparse.ArgumentParser(prog="torchrun ... -m kit.repro")
    parser.add_argument("cases", nargs="+", choices=sorted(CASES))
    parser.add_argument("--fixed", action="store_true", help="apply the doctor's fix")
    parser.add_argument("--out", default="launch/11-repro")
    args = parser.parse_args(argv)
    env = kdist.init("cpu", timeout_min=2)
    with kdist.main_process_first(env):
        builtin.resolve("kit:tiny-llama")
    report, failed = {}, False
    target = Path(args.out) / f"rank{env.rank}.json"
    for name in args.cases:
        out = Path(args.out) / name
        out.mkdir(parents=True, exist_ok=True)
        report[name] = _report(CASES[name].run, args.fixed, out)
        failed |= not report[name]["ok"]
        tmp = target.with_suffix(".tmp")
        tmp.write_text(json.dumps(report, indent=1))
        os.replace(tmp, target)
        line = "ok" if report[name]["ok"] else report[name]["error"]
        print(f"[rank {env.rank}] {name}: {line}", file=sys.stderr, flush=True)
        if not report[name]["ok"] and CASES[name].crashes:
            break
        dist.barrier()  # every rank finished this case before the next one starts
    kdist.cleanup()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
