"""The pipeline in order, and what each wrong order or setting does, reproduced for real.

    torchrun --nproc_per_node=2 -m kit.pitfalls OUT [name ...]     # writes OUT/<name>.json

Every reproduction builds the tiny model with the kit's own functions, makes one mistake from a
published recipe, catches what happens (an exception, or a silent wrong result that it measures)
and then runs the fix. They need a process group, so they run under torchrun; the notebook reads
the JSON files (`launch`, `read`). Rank 0 writes; every rank runs the same collectives.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path

import torch

# The order the recipe (kit/train.py) follows, and what goes wrong when a step moves or changes.
PIPELINE = [
    ("1. process group", "kit.dist.init", "one process per device: nccl on GPUs, gloo on CPU"),
    ("2. load, quantized", "kit.quantize.load_model",
     "each rank onto its own device (device_map={'': rank}), 4-bit storage in the model dtype"),
    ("3. LoRA", "kit.lora.apply_lora",
     "adapters in fp32, or in the model dtype under FSDP1; no prepare_model_for_kbit_training"),
    ("4. checkpointing + train()", "kit.recompute.enable_activation_checkpointing",
     "from_pretrained returns eval mode, where HF checkpointing does nothing"),
    ("5. shard", "kit.sharding.shard", "decoder layers first, then the root"),
    ("6. optimizer", "torch.optim.AdamW", "after sharding: it must hold the sharded parameters"),
    ("7. train", "kit.train.Recipe.train", "forward, backward, clip, step"),
    ("8. save the adapter", "kit.checkpoint.save_adapter",
     "gather with get_model_state_dict; PEFT key layout taken before wrapping; verified"),
]  # fmt: skip


def _error(e: BaseException) -> str:
    return f"{type(e).__name__}: {str(e).strip().splitlines()[0]}"


def _config(*overrides: str):
    from kit.config import load_config

    path = Path(__file__).parent / "configs" / "tiny-cpu.yaml"
    return load_config(path, list(overrides))


def _peft_model(cfg, env, prepare_kbit: bool = False, device_map=None):
    from kit import lora, quantize

    model, _ = quantize.load_model(cfg, env.device)
    if prepare_kbit:  # what the first article does before wrapping
        from peft import prepare_model_for_kbit_training

        model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
    return lora.apply_lora(model, cfg)


def _dtypes(model) -> dict[str, int]:
    out: dict[str, int] = {}
    for p in model.parameters():
        key = str(p.dtype).removeprefix("torch.")
        out[key] = out.get(key, 0) + 1
    return out


def _try_shard(model, cfg, env) -> str:
    """Wrap `model` with cfg's engine; what happened, in one line."""
    from kit import sharding

    try:
        sharding.shard(model, cfg, env.device)
        return f"{cfg.sharding.engine.upper()} wrapped the model, no error"
    except Exception as e:
        return _error(e)


# --------------------------------------------------------------------------- the reproductions


def kbit_prep_fsdp1(env) -> dict:
    cfg = _config("sharding.engine=fsdp1")
    wrong = _peft_model(cfg, env, prepare_kbit=True)
    dtypes = _dtypes(wrong)
    error = _try_shard(wrong, cfg, env)
    fixed = _try_shard(_peft_model(cfg, env), cfg, env)
    return {
        "title": "prepare_model_for_kbit_training before FSDP1",
        "wrong": "peft.prepare_model_for_kbit_training(model), then LoRA, then FSDP1",
        "observed": error, "dtypes_after_prepare": dtypes, "fixed": fixed,
        "why": "prepare_model_for_kbit_training casts every non-4-bit parameter (norms, "
               "embeddings, head) to float32; FSDP1 flattens each unit into one tensor of one dtype, "
               "and the packed 4-bit weights stay bf16.",
        "fix": "skip it under FSDP; do its useful parts yourself (checkpointing + train()) and "
               "keep one dtype per unit: adapters in the model dtype (what kit.lora does).",
    }  # fmt: skip


def uint8_storage_fsdp1(env) -> dict:
    cfg = _config("sharding.engine=fsdp1")
    cfg.quantization.storage = "uint8"  # set after validation: the kit's config refuses this
    error = _try_shard(_peft_model(cfg, env), cfg, env)
    cfg.quantization.storage = "auto"
    fixed = _try_shard(_peft_model(cfg, env), cfg, env)
    return {
        "title": "integer quant storage under FSDP1",
        "wrong": "BitsAndBytesConfig without bnb_4bit_quant_storage (uint8), then FSDP1",
        "observed": error, "fixed": fixed,
        "why": "FSDP1 flattens parameters into a FlatParameter, which must be floating point; "
               "bitsandbytes packs two 4-bit values per uint8 by default.",
        "fix": "bnb_4bit_quant_storage=torch.bfloat16 (= model dtype): the same bytes, viewed "
               "as half as many bf16 values (kit: quantization.storage=auto).",
    }  # fmt: skip


def device_map_auto(env) -> dict:
    """device_map='auto' spreads ONE copy of the model over all visible GPUs, on every rank."""
    from accelerate import infer_auto_device_map, init_empty_weights
    from accelerate.utils import get_balanced_memory
    from transformers import AutoConfig, AutoModelForCausalLM

    from kit import builtin

    cfg = _config("sharding.engine=fsdp2")
    path = builtin.resolve(cfg.model.name)
    gpus = torch.cuda.device_count()
    result = {
        "title": 'device_map="auto" under FSDP',
        "wrong": 'from_pretrained(..., device_map="auto") on every rank, then FSDP',
        "why": "device_map='auto' is for one process using all GPUs (pipeline-style placement): "
               "every rank puts its own full copy across all GPUs, so rank 1 also fills GPU 0 "
               "and no module lives on one device, which FSDP requires.",
        "fix": "device_map={'': local_rank}: each rank loads onto its own GPU (kit.quantize).",
    }  # fmt: skip
    if gpus >= 2:  # the real thing
        from transformers import AutoModelForCausalLM as Auto

        from kit import lora, quantize, sharding

        try:
            model = Auto.from_pretrained(path, dtype=torch.bfloat16, device_map="auto",
                                         quantization_config=quantize.bnb_config(cfg))  # fmt: skip
            result["placement"] = sorted({str(p.device) for p in model.parameters()})
            sharding.shard(lora.apply_lora(model, cfg), cfg, env.device)
            result["observed"] = "no error"
        except Exception as e:
            result["observed"] = _error(e)
    else:  # CPU: compute the placement accelerate would choose for two GPUs
        config = AutoConfig.from_pretrained(path)
        with init_empty_weights():
            meta = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
        keep = meta._no_split_modules
        budget = get_balanced_memory(meta, max_memory={0: 80 * 2**30, 1: 80 * 2**30},
                                     no_split_module_classes=keep, dtype=torch.bfloat16)  # fmt: skip
        placement = infer_auto_device_map(meta, max_memory=budget, no_split_module_classes=keep,
                                          dtype=torch.bfloat16)  # fmt: skip
        result["placement"] = {k: f"cuda:{v}" for k, v in placement.items()}
        result["observed"] = (
            f"rank {env.rank} would place " + ", ".join(f"{k} on cuda:{v}" for k, v in placement.items())
            + " (computed for 2 GPUs: this machine has none, so from_pretrained keeps it on CPU)"
        )  # fmt: skip
    result["fixed"] = f"rank {env.rank} loads everything onto {env.device} (every kit run)"
    return result


def eval_mode_checkpointing(env) -> dict:
    """Count the MLP forwards of the decoder layers in one training step: a checkpointed layer
    runs its body twice (forward, then recompute in backward)."""
    from kit import sharding
    from kit.layers import decoder_layers
    from kit.recompute import enable_activation_checkpointing

    cfg = _config("sharding.engine=fsdp2")
    counts = {}
    for mode in ("eval", "train"):
        model = _peft_model(cfg, env)
        enable_activation_checkpointing(model)
        model.train(mode == "train")  # from_pretrained leaves the model in eval mode
        layers = decoder_layers(model)
        calls = [0]

        def count(module, args, calls=calls):
            calls[0] += 1

        for layer in layers:  # the layer's forward is checkpointed, its children are re-called
            layer.mlp.register_forward_pre_hook(count)
        wrapped = sharding.shard(model, cfg, env.device)
        ids = torch.arange(32, device=env.device).reshape(2, 16) + 3
        wrapped(input_ids=ids, labels=ids).loss.backward()
        counts[mode] = calls[0]
    return {
        "title": "eval mode with activation checkpointing",
        "wrong": "gradient_checkpointing_enable() on a model left in eval mode",
        "observed": f"MLP forwards in one step: eval {counts['eval']}, train "
                    f"{counts['train']} ({len(layers)} layers)",
        "layer_forwards": counts, "layers": len(layers),
        "fixed": f"train mode: {counts['train']} MLP forwards, each layer recomputed in backward",
        "why": "transformers only checkpoints when module.training is True; from_pretrained "
               "returns eval mode, so no layer is checkpointed: autograd keeps every layer's "
               "activations, and the peak is that of a run without checkpointing (measured on GPUs).",
        "fix": "model.train() after enabling checkpointing (kit.train does).",
    }  # fmt: skip


def fsdp1_full_state_dict_save(env) -> dict:
    """The first article's save: FULL_STATE_DICT, then PEFT's save_pretrained(state_dict=...)."""
    from safetensors import safe_open
    from torch.distributed.fsdp import FullStateDictConfig, StateDictType
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    from kit import checkpoint, sharding

    cfg = _config("sharding.engine=fsdp1")
    peft_model = _peft_model(cfg, env)
    layout = checkpoint.AdapterLayout(peft_model)  # the kit's way needs this before wrapping
    wrapped = sharding.shard(peft_model, cfg, env.device)
    # offload_to_cpu=True (as in the article) segfaults rank 0 on CPU; it changes nothing here.
    options = FullStateDictConfig(offload_to_cpu=False, rank0_only=True)
    with FSDP.state_dict_type(wrapped, StateDictType.FULL_STATE_DICT, options):
        state = wrapped.state_dict()
    kit_state = checkpoint.gather_trainable(wrapped)
    counts = {}
    if env.is_main:
        with tempfile.TemporaryDirectory() as tmp:
            peft_model.save_pretrained(f"{tmp}/article", state_dict=state)
            with safe_open(f"{tmp}/article/adapter_model.safetensors", "pt") as f:
                counts["article"] = len(list(f.keys()))
            folder = checkpoint.save_adapter(layout, kit_state, Path(tmp) / "kit")
            counts["kit"] = checkpoint.verify_adapter(folder, layout.shapes)["tensors"]
    return {
        "title": "FSDP1 FULL_STATE_DICT + PEFT save_pretrained(state_dict=...)",
        "wrong": "with FSDP.state_dict_type(FULL_STATE_DICT): state = model.state_dict(); "
                 "peft_model.save_pretrained(dir, state_dict=state)",
        "observed": f"adapter_model.safetensors holds {counts.get('article')} tensors, no error",
        "tensors": counts, "expected": len(layout.shapes),
        "fixed": f"kit.checkpoint.save_adapter wrote {counts.get('kit')} tensors (verified)",
        "why": "PEFT picks the adapter's keys by walking the module tree it has now; FSDP1 "
               "renamed that tree (_fsdp_wrapped_module. inside every wrapped layer), so no key "
               "matches and an empty file is written without a warning.",
        "fix": "gather with get_model_state_dict, map names with a layout taken before wrapping, "
               "read the file back and compare (kit.checkpoint).",
    }  # fmt: skip


REPRODUCTIONS = {
    f.__name__: f
    for f in (kbit_prep_fsdp1, uint8_storage_fsdp1, device_map_auto, eval_mode_checkpointing,
              fsdp1_full_state_dict_save)
}  # fmt: skip


def main(argv: list[str]) -> int:
    import torch.distributed as dist

    from kit import builtin
    from kit import dist as kdist

    out, names = Path(argv[0]), argv[1:] or list(REPRODUCTIONS)
    env = kdist.init("auto")
    try:
        with kdist.main_process_first(env):
            builtin.resolve("kit:tiny-llama")
        for name in names:
            torch.manual_seed(0)
            try:
                row = REPRODUCTIONS[name](env)
            except Exception as e:  # a reproduction that broke differently: report, go on
                row = {"title": name, "observed": f"reproduction failed: {_error(e)}"}
            dist.barrier()
            if env.is_main:
                out.mkdir(parents=True, exist_ok=True)
                (out / f"{name}.json").write_text(json.dumps({"name": name, **row}, indent=1))
    finally:
        kdist.cleanup()
    return 0


# --------------------------------------------------------------------------- kernel side (05)


def launch(out, names=(), nproc: int = 2) -> dict[str, dict]:
    """Run the reproductions under torchrun and read their results."""
    from kit.torchrun import torchrun

    out = Path(out).resolve()
    unknown = [n for n in names if n not in REPRODUCTIONS]
    if unknown:
        raise ValueError(f"reproductions: {unknown} unknown; allowed: {', '.join(REPRODUCTIONS)}")
    torchrun("kit.pitfalls", str(out), *names, nproc=nproc)
    return read(out, names)


def read(out, names=()) -> dict[str, dict]:
    """Every reproduction's result, in order; those not in `names` (if given) or without a file
    are marked as not run."""
    found = {p.stem: json.loads(p.read_text()) for p in Path(out).glob("*.json")}
    return {
        name: found[name] if name in found and (not names or name in names)
        else {"name": name, "title": name, "observed": "not run"}
        for name in REPRODUCTIONS
    }  # fmt: skip


def describe(row: dict) -> str:
    """A reproduction's result as readable text."""
    lines = [row["title"]]
    for key, label in (("wrong", "wrong"), ("observed", "observed"), ("why", "why"),
                       ("fix", "fix"), ("fixed", "with the fix")):  # fmt: skip
        if row.get(key) is not None:
            lines.append(f"  {label + ':':<13} {row[key]}")
    return "\n".join(lines)


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main(sys.argv[1:]))
