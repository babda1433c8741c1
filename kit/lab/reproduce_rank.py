"""Each pitfall of kit.pitfalls reproduced on the tiny model: the wrong code as a person writes it
(the articles' load: NF4, bf16 compute and storage, LoRA r8 on q_proj/v_proj, and one mistake),
and the same step the kit's way (kit.recipe.model.build, loading whole as the articles do). Rank side:

    torchrun --nproc_per_node=2 -m kit.lab.reproduce_rank CONFIG OUT fsdp1_int_storage \
        offload_to_cpu_segfault:fixed offload_to_cpu_segfault:wrong

kit.lab.reproduce.reproduce writes and runs the run folder that does this, and reads the results. A
step is a pitfall code (wrong side, then fixed side) or CODE:wrong / CODE:fixed. Steps run in turn
in one process group: a wrong side fails alike on every rank before any collective is left half
done, rank-0-only work follows a step's last collective, the timeout waits on a group of its own; a
step that kills a process (crashes=True) comes last. The steps are a case table on the experiment
harness (kit.bench.experiment); after each step every rank writes OUT/<code>/<side>.rank<N>.json:
ok, the exception, what it observed, the in-run checks.

Longer than 400 lines because it holds every reproduction, both sides of each next to each other.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from datetime import timedelta

import safetensors
import torch
import torch.distributed as dist
from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training
from peft.utils.other import fsdp_auto_wrap_policy
from torch.distributed.fsdp import (
    FullStateDictConfig,
    MixedPrecision,
    ShardingStrategy,
    StateDictType,
)
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy
from transformers import AutoModelForCausalLM, BitsAndBytesConfig

from kit.bench import experiment
from kit.config import apply_overrides, config_from_dict
from kit.inputs import builtin
from kit.pitfalls import get, reproduced
from kit.recipe import checkpoint, engines
from kit.recipe import dist as kdist
from kit.recipe.checks import check_adapter, check_checkpointing_active
from kit.recipe.layers import decoder_layer_classes, decoder_layers
from kit.recipe.model import build
from kit.recipe.verify import verify_adapter

# --------------------------------------------------------------------------- the articles' pieces


def load_in_4bit(cfg, env, quantization=None, attn_implementation="sdpa"):
    """from_pretrained as the articles write it: NF4, bf16 compute and storage, this rank's device."""
    quantization = quantization or BitsAndBytesConfig(
        load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
        bnb_4bit_compute_dtype=torch.bfloat16, bnb_4bit_quant_storage=torch.bfloat16,
    )  # fmt: skip
    where = {"device_map": {"": env.device}} if env.device.type == "cuda" else {}
    return AutoModelForCausalLM.from_pretrained(
        builtin.resolve(cfg.model.name), dtype=torch.bfloat16, quantization_config=quantization,
        attn_implementation=attn_implementation, **where,
    )  # fmt: skip


def lora():
    return LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")


def peft_model_in_bf16(model):
    """get_peft_model, adapters cast to bf16: one dtype per FSDP1 unit (what FSDP1 articles do)."""
    model = get_peft_model(model, lora())
    for p in model.parameters():
        if p.requires_grad:
            p.data = p.data.to(torch.bfloat16)
    return model


def each_decoder_layer(model):
    """The auto-wrap policy the kit and the articles use: each decoder layer is a unit."""
    return functools.partial(
        transformer_auto_wrap_policy, transformer_layer_cls=decoder_layer_classes(model)
    )


def _with(cfg, *overrides: str):  # the launch's config with a few settings changed, validated
    return config_from_dict(apply_overrides(cfg.to_dict(), list(overrides)))


def _steps(model, env, n: int = 2) -> dict:
    """n optimizer steps on a fixed batch."""
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    ids = torch.randint(3, 1024, (2, 16), generator=torch.Generator().manual_seed(0)).to(env.device)
    model.train()
    losses = []
    for _ in range(n):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(round(loss.item(), 4))
    return {"observed": f"no error: {n} training steps", "losses": losses}


# --------------------------------------------------------------------------- loading and LoRA


def uint8_storage(cfg, env, out):
    """BitsAndBytesConfig with bitsandbytes' default storage (uint8), then FSDP1."""
    quantization = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                                      bnb_4bit_compute_dtype=torch.bfloat16)  # fmt: skip
    model = peft_model_in_bf16(load_in_4bit(cfg, env, quantization))
    model = FSDP(model, auto_wrap_policy=each_decoder_layer(model), device_id=env.device,
                 use_orig_params=True)  # fmt: skip
    return _steps(model, env)


def device_map_auto(cfg, env, out):
    """from_pretrained(..., device_map="auto") on every rank, then FSDP."""
    if torch.cuda.device_count() >= 2:  # the real thing
        model = AutoModelForCausalLM.from_pretrained(
            builtin.resolve(cfg.model.name), dtype=torch.bfloat16, device_map="auto")
        placed = sorted({str(p.device) for p in model.parameters()})
        FSDP(model, device_id=env.device, use_orig_params=True)
        return {"observed": f"rank {env.rank} placed the model on {', '.join(placed)}; FSDP "
                            "wrapped it"}  # fmt: skip
    where = ", ".join(f"{k} on {v}" for k, v in _auto_placement(cfg).items())
    said = f"rank {env.rank} would place {where} (computed for 2 GPUs: this machine has none)"
    return {"observed": said, "findings": [get("device_map_with_fsdp").finding(said)]}


def _auto_placement(cfg) -> dict[str, str]:
    """Where device_map='auto' puts each block on 2 GPUs of 80 GiB (accelerate's own planner)."""
    from accelerate import infer_auto_device_map, init_empty_weights
    from accelerate.utils import get_balanced_memory
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(builtin.resolve(cfg.model.name))
    with init_empty_weights():
        meta = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    keep, gpus = meta._no_split_modules, {0: 80 * 2**30, 1: 80 * 2**30}
    budget = get_balanced_memory(meta, max_memory=gpus, no_split_module_classes=keep,
                                 dtype=torch.bfloat16)  # fmt: skip
    device_map = infer_auto_device_map(meta, max_memory=budget, no_split_module_classes=keep,
                                 dtype=torch.bfloat16)  # fmt: skip
    return {k: f"cuda:{v}" for k, v in device_map.items()}


def flash_attention_without_the_package(cfg, env, out):
    """from_pretrained(..., attn_implementation="flash_attention_2") without flash-attn."""
    load_in_4bit(cfg, env, attn_implementation="flash_attention_2")


def prepare_kbit_then_fsdp1(cfg, env, out):
    """peft.prepare_model_for_kbit_training(model), then LoRA, then FSDP1."""
    model = prepare_model_for_kbit_training(load_in_4bit(cfg, env))  # norms, embeddings: fp32
    model = peft_model_in_bf16(model)
    model = FSDP(model, auto_wrap_policy=each_decoder_layer(model), device_id=env.device,
                 use_orig_params=True)  # fmt: skip
    return _steps(model, env)


def float32_adapters_fsdp1(cfg, env, out):
    """get_peft_model(model, lora) (adapters in float32, PEFT's default), then FSDP1."""
    model = get_peft_model(load_in_4bit(cfg, env), lora())
    model = FSDP(model, auto_wrap_policy=each_decoder_layer(model), device_id=env.device,
                 use_orig_params=True)  # fmt: skip
    return _steps(model, env)


def falcon_target_names(cfg, env, out):
    """LoraConfig(target_modules=["query_key_value"]): Falcon's layer names, on a Llama."""
    targets = ["query_key_value"]
    get_peft_model(load_in_4bit(cfg, env), LoraConfig(r=8, target_modules=targets))


def loaded_the_kit_way(cfg, env, out):
    """kit.recipe.model.build: each rank loads onto its own device; LoRA per lora.target_modules."""
    model = build(cfg, env.device).model
    places = ", ".join(sorted({str(p.device) for p in model.parameters()}))
    adapted = sum(1 for name, _ in model.named_modules() if name.endswith("lora_A"))
    return {"observed": f"rank {env.rank} loaded everything onto {places}; LoRA on {adapted} "
                        "linear layers"}  # fmt: skip


def flash_attention_the_kit_way(cfg, env, out):
    """kit.recipe.model.build with attention.implementation=flash_attention_2."""
    built = build(_with(cfg, "attention.implementation=flash_attention_2"), env.device)
    return {"observed": built.attention_warning or f"attention: {built.attention}"}


# --------------------------------------------------------------------------- recompute


def checkpointing_in_eval_mode(cfg, env, out):
    """gradient_checkpointing_enable() on a model left in eval mode, as from_pretrained returns."""
    model = get_peft_model(load_in_4bit(cfg, env), lora())
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return _recompute_measured(model, env)


def checkpointing_the_kit_way(cfg, env, out):
    """kit.recipe.model.build: recompute switched on, then the model put in train mode."""
    cfg = _with(cfg, "lora.target_modules=[q_proj,v_proj]", "lora.dropout=0.0")  # as lora()
    return _recompute_measured(build(cfg, env.device).model, env)


def _recompute_measured(model, env) -> dict:
    """Forward calls of each layer's first child in one training step (the recompute calls it
    again), the bytes autograd kept for backward, and the in-run check's verdict."""
    calls = []  # transformers recomputes a layer's forward, not its hooks: count a child's
    layers = decoder_layers(model)
    for layer in layers:
        next(layer.children()).register_forward_hook(lambda *a: calls.append(1))
    saved: dict[int, int] = {}

    def pack(t):
        saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    ids = torch.randint(3, 1024, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(input_ids=ids.to(env.device), labels=ids.to(env.device)).loss
    loss.backward()
    return {
        "observed": f"attention forwards in one step: {len(calls)} ({len(layers)} layers: "
                    f"{2 * len(layers)} when recomputed); bytes kept for backward: "
                    f"{sum(saved.values()):,}",
        "forwards": len(calls), "saved_bytes": sum(saved.values()),
        "findings": check_checkpointing_active(model),
    }  # fmt: skip


# --------------------------------------------------------------------------- sharding


def without_orig_params(cfg, env, out):
    """FSDP1 with use_orig_params=False around a LoRA model."""
    model = peft_model_in_bf16(load_in_4bit(cfg, env))
    model = FSDP(model, auto_wrap_policy=each_decoder_layer(model), device_id=env.device,
                 use_orig_params=False)  # fmt: skip
    return _steps(model, env)


def without_device_id(cfg, env, out):
    """FSDP1 with no device_id (on CPU)."""
    model = peft_model_in_bf16(load_in_4bit(cfg, env))
    model = FSDP(model, auto_wrap_policy=each_decoder_layer(model), use_orig_params=True)
    return _steps(model, env)


def peft_auto_wrap_policy(cfg, env, out):
    """PEFT's fsdp_auto_wrap_policy and bf16 MixedPrecision, adapters left in float32."""
    model = get_peft_model(load_in_4bit(cfg, env), lora())
    bf16 = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16,
                          buffer_dtype=torch.bfloat16)  # fmt: skip
    model = FSDP(model, auto_wrap_policy=fsdp_auto_wrap_policy(model), mixed_precision=bf16,
                 device_id=env.device, use_orig_params=True)  # fmt: skip
    return _steps(model, env)


def shard_grad_op(cfg, env, out):
    """FSDP1 sharding_strategy=SHARD_GRAD_OP around 4-bit weights."""
    model = peft_model_in_bf16(load_in_4bit(cfg, env))
    model = FSDP(model, auto_wrap_policy=each_decoder_layer(model), device_id=env.device,
                 use_orig_params=True, sharding_strategy=ShardingStrategy.SHARD_GRAD_OP)
    return _steps(model, env)


def fsdp1_the_kit_way(cfg, env, out):
    """kit.recipe.model.build, then kit.recipe.engines (FSDP1) wraps it, as the recipe does."""
    cfg = _with(cfg, "sharding.engine=fsdp1")
    return _steps(engines.get("fsdp1").wrap(build(cfg, env.device).model, cfg, env.device), env)


# --------------------------------------------------------------------------- saving


def _trained_fsdp1(cfg, env):
    """A correct FSDP1 QLoRA model trained 2 steps, and its adapter layout, which must be read
    before wrapping (FSDP1 renames the module tree)."""
    cfg = _with(cfg, "sharding.engine=fsdp1")
    model = build(cfg, env.device).model
    layout = checkpoint.AdapterLayout(model)
    wrapped = engines.get(cfg.sharding.engine).wrap(model, cfg, env.device)
    _steps(wrapped, env)
    return layout, wrapped


def full_state_dict_save(cfg, env, out):
    """FSDP.state_dict_type(FULL_STATE_DICT), then peft_model.save_pretrained(state_dict=...)."""
    _, model = _trained_fsdp1(cfg, env)
    options = FullStateDictConfig(offload_to_cpu=False, rank0_only=True)  # True: a segfault
    with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, options):
        state = model.state_dict()
    if env.is_main:
        model.module.save_pretrained(out / "adapter", state_dict=state)  # no error, no tensors
        n = len(safetensors.safe_open(str(out / "adapter/adapter_model.safetensors"), "pt").keys())
        return {"observed": f"adapter_model.safetensors holds {n} tensors, no error",
                "findings": check_adapter(out / "adapter")}  # fmt: skip


def saved_the_kit_way(cfg, env, out):
    """kit.recipe.checkpoint: get_model_state_dict, PEFT's keys taken before wrapping, file read back."""
    layout, model = _trained_fsdp1(cfg, env)
    state = checkpoint.gather_trainable(model)  # a collective: every rank
    if env.is_main:
        folder = checkpoint.save_adapter(layout, state, out / "adapter")
        n = verify_adapter(folder, layout.shapes)["tensors"]
        return {"observed": f"kit.recipe.checkpoint.save_adapter wrote {n} tensors (verified)",
                "findings": check_adapter(folder)}  # fmt: skip


def offload_to_cpu(cfg, env, out):
    """FullStateDictConfig(offload_to_cpu=True, rank0_only=True), then model.state_dict()."""
    _, model = _trained_fsdp1(cfg, env)
    options = FullStateDictConfig(offload_to_cpu=True, rank0_only=True)
    with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, options):
        model.state_dict()


def _adapter_saved(cfg, env, out) -> dict[str, torch.Tensor]:
    """A trained adapter saved the kit's way into out/adapter (as PEFT lays it out:
    adapter_model.safetensors), every rank waiting for the file; its tensors, by model name."""
    layout, model = _trained_fsdp1(cfg, env)
    state = checkpoint.gather_trainable(model)  # a collective: every rank
    if env.is_main:
        checkpoint.save_adapter(layout, state, out / "adapter")
    dist.barrier()
    return {name: state[name] for name in layout.file_key}


def _fresh_fsdp1(cfg, env):
    """A fresh model as training builds it, its adapter layout read before FSDP1 wraps it."""
    cfg = _with(cfg, "sharding.engine=fsdp1")
    model = build(cfg, env.device).model
    return checkpoint.AdapterLayout(model), engines.get("fsdp1").wrap(model, cfg, env.device)


def full_state_dict_load(cfg, env, out):
    """Wrap, then in FULL_STATE_DICT rank 0 torch.loads adapter_model.bin, the others pass None."""
    _adapter_saved(cfg, env, out)
    _, model = _fresh_fsdp1(cfg, env)
    options = FullStateDictConfig(offload_to_cpu=False, rank0_only=True)
    with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, options):
        state_dict = torch.load(out / "adapter" / "adapter_model.bin") if env.is_main else None
        model.load_state_dict(state_dict)


def adapter_loaded_the_kit_way(cfg, env, out):
    """Rank 0 reads adapter_model.safetensors, its keys mapped to the model's names (the layout
    taken before wrapping); set_model_state_dict(broadcast_from_rank0) gives every rank its part."""
    from safetensors.torch import load_file
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    trained = _adapter_saved(cfg, env, out)
    layout, model = _fresh_fsdp1(cfg, env)
    name_of = {key: name for name, key in layout.file_key.items()}
    read = load_file(out / "adapter" / "adapter_model.safetensors") if env.is_main else {}
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True, strict=False)
    set_model_state_dict(model, {name_of[k]: v for k, v in read.items()}, options=options)
    loaded = checkpoint.gather_trainable(model)
    if not all(torch.equal(loaded[n], trained[n]) for n in trained):
        raise RuntimeError("the loaded adapter differs from the one trained")
    return {"observed": f"every rank holds the {len(trained)} trained adapter tensors, equal"}


# --------------------------------------------------------------------------- processes


def short_collective_timeout(cfg, env, out):
    """A collective timeout of 2 s, while rank 0 spends 5 s on something (say, a checkpoint)."""
    return _rank0_busy(dist.new_group(timeout=timedelta(seconds=2)), env)


def collective_timeout_the_kit_way(cfg, env, out):
    """The same wait under run.dist_timeout_min, the timeout kit.recipe.dist.init gives the group."""
    return _rank0_busy(dist.new_group(timeout=timedelta(minutes=cfg.run.dist_timeout_min)), env)


def _rank0_busy(group, env) -> dict:
    # A group of its own: its timeout leaves the default group (and the next steps) working.
    dist.barrier(group=group)  # connected: what follows is a wait, not a set-up
    if env.is_main:
        time.sleep(5)  # rank 0 writes a checkpoint; the others already wait in the barrier
    dist.barrier(group=group)
    return {"observed": "rank 0 was busy 5 s while the others waited: no error"}


# --------------------------------------------------------------------------- running steps


def _step(fn):
    """A step of the case table: the reproduction `fn` on this rank, in OUT/<code>/<side>/."""

    def run(case: experiment.Case) -> dict:
        code, side = case.name.split(":")
        folder = case.out / code / side
        folder.mkdir(parents=True, exist_ok=True)
        return dict(fn(case.cfg, case.env, folder) or {})

    return run


def _report(case: experiment.Case, got: dict | None, error: str, trace: str) -> dict:
    """A rank's report of a step: ok, the exception, what it observed, the in-run checks' findings
    and the rest of what it returned (measurements)."""
    code, side = case.name.split(":")
    if error:  # recording what the user would see is the point
        error = error[:400]
        return {"code": code, "side": side, "ok": False, "error": error, "traceback": trace,
                "observed": error, "findings": [], "measured": {}}  # fmt: skip
    got = dict(got or {})  # the rest of it after these pops: measurements
    return {"code": code, "side": side, "ok": True, "error": "", "traceback": "",
            "observed": got.pop("observed", "no error"),
            "findings": [dataclasses.asdict(f) for f in got.pop("findings", [])],
            "measured": got}  # fmt: skip


def steps(items: list[str]) -> list[tuple[str, str]]:
    """(code, side) per CODE, CODE:wrong or CODE:fixed argument, in order."""
    out = []
    for code, _, side in (item.partition(":") for item in items):
        if not get(code).wrong or side not in ("", "wrong", "fixed"):
            raise SystemExit(f"{code}:{side}: expected a reproduced pitfall, CODE[:wrong|fixed]")
        out += [(code, s) for s in ([side] if side else ["wrong", "fixed"])]
    return out


# Every step: its wrong side and its fixed side, in turn in one process group. A failing step
# that kills a process (crashes=True) ends the launch: no barrier after it.
EXPERIMENT = experiment.Experiment(
    prog="kit.lab.reproduce_rank", doc=__doc__,
    cases={f"{p.code}:{side}": _step(globals()[getattr(p, side)])
           for p in reproduced() for side in ("wrong", "fixed") if getattr(p, side)},
    row_path=lambda out, name, rank: out.joinpath(*name.split(":")).with_suffix(f".rank{rank}.json"),
    row=_report, failures="record",
    default=lambda cfg: [], expand=lambda names: [f"{c}:{s}" for c, s in steps(names)],
    overrides=lambda name: ["model.loading=full"],
    stop=lambda case, row: not row["ok"] and get(case.name.split(":")[0]).crashes,
)

if __name__ == "__main__":
    kdist.leave(experiment.main(EXPERIMENT))
