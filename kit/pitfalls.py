"""The pitfalls of QLoRA under FSDP, one record each: what goes wrong, how each reader spots it,
and how to fix it. Every reader of this knowledge reads it here, so it is written once:

- kit.config refuses at load what a record's `config` predicate (a pure function of the config)
  finds, with its one-line message;
- the doctor's pre-flight runs the `config` and `machine` predicates (kit/doctor/preflight.py),
  its script scan the `script` patterns (script.py), its error explanation the `error` patterns
  (explain.py); each answers with `Pitfall.finding`, so all of them cite one code, message, fix;
- kit/lab/reproduce_rank.py holds the `wrong` and `fixed` reproductions a record names, run under
  torchrun by kit.lab.reproduce.reproduce for notebooks 08 and 11.

    get("fsdp1_int_storage").fix
    [p.code for p in PITFALLS if p.wrong]        # the pitfalls reproduced on the tiny model

Imported by kit.config, so by both sides: it imports nothing of the kit but kit.findings, and no
torch. The predicates duck-type the config: a kit Config, or the doctor's attribute view of a raw
tree (which may hold values load_config would reject, and keys no Config has, e.g. device_map).

Longer than 400 lines because it is the table of every pitfall the kit knows, one record each.
"""

from __future__ import annotations

import ast
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kit.findings import Finding

REPRODUCE = Path(__file__).parent / "lab" / "reproduce_rank.py"


@dataclass(frozen=True)
class Violation:
    """A config value a pitfall refuses: the field, its value, and what is allowed instead."""

    field: str
    value: Any
    allowed: str

    def __str__(self) -> str:  # the one line load_config raises
        return f"{self.field}: {self.value!r} is not allowed; {self.allowed}"


@dataclass(frozen=True)
class Pitfall:
    code: str  # stable slug: findings, tests, the launcher and the notebooks key on it
    title: str  # what a person did, in a few words
    message: str  # one line: what goes wrong, quoting the library's own words
    fix: str  # one line: what to change
    level: str = "error"  # error: the run fails or silently does not train | warning | info
    fields: tuple[str, ...] = ()  # the config fields that can cause it
    config: Callable[[Any], Violation | None] | None = None  # of the config alone: load refuses
    machine: Callable[[Any, dict], Violation | None] | None = None  # with the machine: preflight
    script: tuple[str, ...] = ()  # regexes that must all match a script (the first: its line)
    script_absent: tuple[str, ...] = ()  # regexes that must match nowhere in it
    error: str = ""  # regex over raw error text (logs, tracebacks)
    raises: str = ""  # the record whose error its reproduction raises ("": this one)
    wrong: str = ""  # function of kit/lab/reproduce_rank.py: the mistake as a person writes it
    fixed: str = ""  # function there: the same step the kit's way (kit.recipe.model.build, ...)
    overrides: tuple[str, ...] = ()  # the kit config that makes the same mistake
    why: str = ""  # the longer explanation kit.lab.reproduce.describe prints ("": the message)
    crashes: bool = False  # its wrong side kills a process: it runs last in a launch

    @property
    def expect(self) -> str:
        """The code the doctor gives this pitfall's raw failure."""
        return self.raises or self.code

    def finding(self, where: str = "", saw: str = "", field: str = "",
                level: str = "") -> Finding:
        """This pitfall as a doctor's finding: `where` it was seen (a line, a config value)
        before the message, the raw text it `saw` after it."""
        message = f"{where}: {self.message}" if where else self.message
        message += f" (saw: {saw})" if saw else ""
        return Finding(level or self.level, self.code, message, self.fix, field)


def _is_fsdp1(cfg) -> bool:
    return cfg.sharding.engine == "fsdp1"


def _quantized(cfg) -> bool:
    return cfg.quantization.method != "none"


def _storage(cfg) -> str:
    storage = cfg.quantization.storage
    return cfg.model.dtype if storage == "auto" else storage


def _int_storage(cfg) -> Violation | None:
    if _is_fsdp1(cfg) and _quantized(cfg) and _storage(cfg) == "uint8":
        return Violation("quantization.storage", cfg.quantization.storage,
                         "FSDP1 cannot flatten integer tensors; use auto (= model.dtype) or "
                         "engine fsdp2/ddp")
    return None


def _mixed_dtype(cfg) -> Violation | None:
    if not _is_fsdp1(cfg):
        return None
    dtype = cfg.model.dtype
    allowed = f"FSDP1 flattens one dtype per unit; use auto or {dtype!r} (= model.dtype)"
    if _quantized(cfg) and _storage(cfg) not in (dtype, "uint8"):
        return Violation("quantization.storage", cfg.quantization.storage, allowed)
    if cfg.lora.dtype not in ("auto", dtype):
        return Violation("lora.dtype", cfg.lora.dtype, allowed)
    return None


def _orig_params(cfg) -> Violation | None:
    if _is_fsdp1(cfg) and not cfg.sharding.use_orig_params:
        return Violation("sharding.use_orig_params", cfg.sharding.use_orig_params,
                         "LoRA under FSDP1 needs true (frozen and trainable params share a unit)")
    return None


def _shard_grad_op(cfg) -> Violation | None:
    if _is_fsdp1(cfg) and _quantized(cfg) and cfg.sharding.strategy == "SHARD_GRAD_OP":
        return Violation("sharding.strategy", cfg.sharding.strategy,
                         "SHARD_GRAD_OP fails with 4-bit weights under FSDP1; use FULL_SHARD or "
                         "engine fsdp2")
    return None


def _no_shard(cfg) -> Violation | None:
    if _is_fsdp1(cfg) and cfg.sharding.strategy in ("NO_SHARD", "HYBRID_SHARD"):
        return Violation("sharding.strategy", cfg.sharding.strategy, NO_SHARD_ALLOWED)
    return None


def _fsdp1_one_process(cfg, machine: dict) -> Violation | None:
    if _is_fsdp1(cfg) and machine["ranks"] == 1:
        return Violation("sharding.engine", "fsdp1", f"on 1 process: {NO_SHARD_ALLOWED}")
    return None


NO_SHARD_ALLOWED = ("FSDP1's NO_SHARD (also what it runs on one process) and HYBRID_SHARD cannot "
                    "save the adapter (NO_SHARD also fails with 4-bit weights); use FULL_SHARD "
                    "on 2+ processes, or engine fsdp2 or ddp")


def _flex_cpu(cfg, machine: dict) -> Violation | None:
    if cfg.attention.implementation == "flex_attention" and machine["device"] == "cpu":
        return Violation("attention.implementation", "flex_attention",
                         "FlexAttention has no backward on CPU; use sdpa (or eager) here")
    return None


def _offload_cpu(cfg, machine: dict) -> Violation | None:
    if cfg.sharding.cpu_offload and machine["device"] == "cpu":
        return Violation("sharding.cpu_offload", True,
                         "offloading moves parameters off a GPU and there is none; use false")
    return None


def _flash_fp32(cfg) -> Violation | None:
    if cfg.attention.implementation == "flash_attention_2" and cfg.model.dtype == "float32":
        return Violation("attention.implementation", "flash_attention_2",
                         "flash attention needs model.dtype bfloat16 or float16; use sdpa for "
                         "float32")
    return None


def _flash_missing(cfg, machine: dict) -> Violation | None:
    if cfg.attention.implementation != "flash_attention_2":
        return None
    if machine["device"] == "cpu":
        return Violation("attention.implementation", "flash_attention_2", "no GPU here")
    if not machine["packages"].get("flash_attn"):
        return Violation("attention.implementation", "flash_attention_2",
                         "the flash-attn package is not installed")
    return None


def _device_map(cfg, machine: dict) -> Violation | None:
    # Not a kit setting (the kit places each rank itself): a raw tree or an article's YAML.
    value = getattr(cfg.model, "device_map", None) or getattr(cfg, "device_map", None)
    if value in (None, "", {}) or machine["ranks"] < 2:
        return None
    return Violation("model.device_map", value,
                     f"{machine['ranks']} ranks each need the whole model on their own device")


FSDP1 = r"FullyShardedDataParallel|\bFSDP\(|distributed_type:\s*FSDP|fsdp_config"
ANY_FSDP = FSDP1 + r"|fully_shard\("
DISTRIBUTED = ANY_FSDP + r"|DistributedDataParallel|init_process_group|LOCAL_RANK|torchrun"
FOUR_BIT = r"load_in_4bit|Linear4bit|bnb_4bit"
KIT_FSDP1 = "fsdp1_the_kit_way"  # the fixed side of every FSDP1 wrapping pitfall

# In the order a run meets them: load, LoRA, recompute, shard, train, save, processes.
PITFALLS: list[Pitfall] = [
    # ------------------------------------------------------------------ loading
    Pitfall(
        "fsdp1_int_storage", "4-bit weights packed in uint8 (bitsandbytes' default) under FSDP1",
        "4-bit weights without bnb_4bit_quant_storage are packed in uint8, which FSDP1 cannot "
        "flatten: 'Cannot flatten integer dtype tensors'",
        "bnb_4bit_quant_storage=torch.bfloat16, the model dtype (kit: quantization.storage=auto), "
        "or FSDP2",
        fields=("quantization.storage",), config=_int_storage,
        script=(r"load_in_4bit\s*=\s*True", FSDP1), script_absent=(r"bnb_4bit_quant_storage",),
        error=r"Cannot flatten integer dtype tensors",
        wrong="uint8_storage", fixed=KIT_FSDP1,
        overrides=("sharding.engine=fsdp1", "quantization.storage=uint8"),
    ),
    Pitfall(
        "device_map_with_fsdp", 'device_map="auto" under FSDP',
        "device_map='auto' spreads each rank's copy over every visible GPU; FSDP/DDP need one "
        "whole model per rank on its own device",
        "device_map={'': local_rank}, or none and FSDP's device_id (the kit loads each rank onto "
        "its own GPU)",
        fields=("model.device_map",), machine=_device_map,
        script=(r"device_map\s*=\s*[\"'](auto|balanced|balanced_low_0|sequential)[\"']",
                DISTRIBUTED),
        error=r"on a different device than the one you're training on|Expected all tensors to "
              r"be on the same device",
        wrong="device_map_auto", fixed="loaded_the_kit_way", overrides=("model.device_map=auto",),
    ),
    Pitfall(
        "flash_attn_missing",
        "attn_implementation='flash_attention_2' without flash-attn (or on CPU)",
        "flash_attention_2 needs the flash-attn package (GPU only, a long build); without it: "
        "'FlashAttention2 has been toggled on, but it cannot be used'",
        "attn_implementation='sdpa' (PyTorch's own flash and cuDNN kernels; the kit falls back "
        "to it)",
        level="warning", fields=("attention.implementation",), machine=_flash_missing,
        script=(r"attn_implementation\s*=\s*[\"']flash_attention_2[\"']",),
        error=r"FlashAttention2? has been toggled on, but it cannot be used",
        wrong="flash_attention_without_the_package", fixed="flash_attention_the_kit_way",
        overrides=("attention.implementation=flash_attention_2",),
    ),
    Pitfall(
        "flash_attn_fp32", "flash attention on a float32 model",
        "FlashAttention runs only in float16/bfloat16: 'Flash Attention 2 only supports "
        "torch.float16 and torch.bfloat16'",
        "model.dtype=bfloat16, or attention.implementation=sdpa for float32",
        fields=("attention.implementation", "model.dtype"), config=_flash_fp32,
        overrides=("model.dtype=float32", "attention.implementation=flash_attention_2"),
        error=r"Flash Attention \d only supports torch.float16 and torch.bfloat16",
    ),
    Pitfall(
        "flex_attention_cpu", "flex_attention on a machine without a GPU",
        "FlexAttention trains only on GPUs: the first backward on CPU fails ('FlexAttention "
        "does not support backward on CPU')",
        "attention.implementation=sdpa on CPU",
        fields=("attention.implementation",), machine=_flex_cpu,
        error=r"FlexAttention does not support backward on CPU",
    ),
    Pitfall(
        "cpu_offload_no_gpu", "FSDP CPU offload on a machine without a GPU",
        "CPU offload moves parameters between host and GPU; with no GPU, wrapping fails "
        "('Cannot access accelerator device when none is available')",
        "sharding.cpu_offload=false on CPU",
        fields=("sharding.cpu_offload",), machine=_offload_cpu,
        error=r"Cannot access accelerator device when none is available",
    ),
    Pitfall(
        "torch_dtype_deprecated", "from_pretrained(torch_dtype=...)",
        "from_pretrained(torch_dtype=...) is deprecated in transformers 5",
        "from_pretrained(dtype=...)", level="info", script=(r"torch_dtype\s*=",),
    ),
    # ------------------------------------------------------------------ LoRA
    Pitfall(
        "prepare_kbit_fsdp1", "prepare_model_for_kbit_training before FSDP1 (the first article)",
        "prepare_model_for_kbit_training casts norms, embeddings and lm_head to float32 next to "
        "the bf16 4-bit storage; FSDP1 then fails: 'Must flatten tensors with uniform dtype'",
        "drop it under FSDP (non-reentrant checkpointing and model.train() do its useful part: "
        "kit.recipe.model.build), or use FSDP2",
        script=(r"prepare_model_for_kbit_training\(", FSDP1),
        raises="fsdp1_mixed_dtype", wrong="prepare_kbit_then_fsdp1", fixed=KIT_FSDP1,
    ),
    Pitfall(
        "fsdp1_mixed_dtype", "PEFT's float32 adapters next to bf16 weights in one FSDP1 unit",
        "an FSDP1 unit mixes dtypes (PEFT's float32 LoRA, or float32 norms, next to bfloat16 "
        "weights) and FSDP1 flattens one: 'Must flatten tensors with uniform dtype'",
        "adapters and 4-bit storage in the model dtype (kit: lora.dtype=auto, "
        "quantization.storage=auto), no prepare_model_for_kbit_training; or FSDP2",
        fields=("quantization.storage", "lora.dtype"), config=_mixed_dtype,
        error=r"Must flatten tensors with uniform dtype",
        wrong="float32_adapters_fsdp1", fixed=KIT_FSDP1,
        overrides=("sharding.engine=fsdp1", "lora.dtype=float32"),
    ),
    Pitfall(
        "target_modules_unmatched", "LoRA target names from another architecture (Falcon's)",
        "LoRA target_modules name no module of this model: 'Target modules ... not found in the "
        "base model'",
        "lora.target_modules=all-linear, or names of this model's linear layers (python -m "
        "kit.doctor CONFIG lists them)",
        fields=("lora.target_modules",),
        error=r"Target modules? .* not found in the base model|match(es)? no module of",
        wrong="falcon_target_names", fixed="loaded_the_kit_way",
        overrides=("lora.target_modules=[query_key_value]",),
    ),
    Pitfall(
        "target_modules_unsupported", "a LoRA target that is a block, not a linear layer",
        "a LoRA target names a block (e.g. mlp), which LoRA cannot wrap: 'is not supported'",
        "name linear layers (q_proj ... down_proj), or all-linear",
        fields=("lora.target_modules",), error=r"Target module \w+\([\s\S]*?\) is not supported",
    ),
    Pitfall(
        "target_modules_partial", "LoRA target names of which some match nothing",
        "some LoRA target_modules match no module; PEFT would skip them silently and train "
        "fewer layers than asked (the kit refuses them)",
        "fix or drop the names that match nothing, or use lora.target_modules=all-linear",
        fields=("lora.target_modules",),
    ),
    # ------------------------------------------------------------------ recompute
    Pitfall(
        "eval_mode_checkpointing", "gradient checkpointing on a model left in eval mode",
        "gradient checkpointing on a model left in eval mode (from_pretrained's default) does "
        "nothing: no recompute, peak memory as without it",
        "call model.train() before training (kit.recipe.model.build does)",
        level="warning",
        script=(r"(gradient|activation)_checkpointing_enable\(",),
        script_absent=(r"\.train\(\s*(True)?\s*\)", r"Trainer\("),
        error=r"gradient checkpointing is on in \d+ modules in eval mode",
        wrong="checkpointing_in_eval_mode", fixed="checkpointing_the_kit_way",
    ),
    Pitfall(
        "no_grad_inputs", "reentrant checkpointing on a frozen model",
        "reentrant gradient checkpointing on a frozen (quantized) model: its inputs carry no grad",
        "use_reentrant=False (the kit's default), or model.enable_input_require_grads()",
        error=r"does not require grad and does not have a grad_fn",
    ),
    # ------------------------------------------------------------------ sharding
    Pitfall(
        "fsdp1_use_orig_params", "LoRA under FSDP1 with use_orig_params=False",
        "LoRA under FSDP1 with use_orig_params=False: frozen weights and trainable adapters "
        "cannot share one FlatParameter ('Must flatten tensors with uniform `requires_grad`'); "
        "the adapters do not train",
        "use_orig_params=True (kit: sharding.use_orig_params=true; accelerate: "
        "fsdp_use_orig_params: true), or FSDP2",
        fields=("sharding.use_orig_params",), config=_orig_params,
        script=(r"use_orig_params\s*(=|:)\s*(False|false)", r"peft|LoraConfig|get_peft_model"),
        error=r"Must flatten tensors with uniform `?requires_grad`?",
        wrong="without_orig_params", fixed=KIT_FSDP1,
        overrides=("sharding.engine=fsdp1", "sharding.use_orig_params=false"),
    ),
    Pitfall(
        "fsdp1_no_device_id", "FSDP1 without device_id (on CPU)",
        "FSDP1 without device_id: on CPU it fails ('FSDP needs a non-CPU accelerator device'); "
        "on GPUs it silently uses whatever device is current",
        "FSDP(..., device_id=torch.device('cuda', local_rank)) (torch.device('cpu') on CPU; "
        "kit.lab.sharding does)",
        level="warning", script=(r"FullyShardedDataParallel\(|\bFSDP\(",),
        script_absent=(r"device_id\s*=",), error=r"FSDP needs a non-CPU accelerator device",
        wrong="without_device_id", fixed=KIT_FSDP1,
    ),
    Pitfall(
        "peft_auto_wrap_fp32", "PEFT's fsdp_auto_wrap_policy with float32 adapters (FSDP1)",
        "PEFT's fsdp_auto_wrap_policy puts the float32 LoRA in units of their own, uncast; the "
        "forward then fails: 'expected m1 and m2 to have the same dtype'",
        "cast the adapters to the compute dtype (kit: lora.dtype=auto), or wrap decoder layers "
        "only",
        level="warning", script=(r"fsdp_auto_wrap_policy\s*\(", FSDP1),
        raises="fsdp1_mixed_dtype_forward", wrong="peft_auto_wrap_policy", fixed=KIT_FSDP1,
    ),
    Pitfall(
        "fsdp1_mixed_dtype_forward", "a matmul of float32 LoRA weights and bf16 activations",
        "a matmul met two dtypes: float32 LoRA weights on bfloat16 activations (PEFT's "
        "fsdp_auto_wrap_policy keeps the adapters in units of their own, uncast)",
        "cast the adapters to the compute dtype (kit: lora.dtype=auto), or wrap decoder layers "
        "only",
        error=r"expected m1 and m2 to have the same dtype|mat1 and mat2 must have the same dtype",
    ),
    Pitfall(
        "shard_grad_op_4bit", "FSDP1 SHARD_GRAD_OP with 4-bit weights (the first article's tip)",
        "SHARD_GRAD_OP with 4-bit weights (FSDP1) fails in backward: 'FSDP does not support "
        "changing the parameters between forward and backward'",
        "FULL_SHARD (kit: sharding.strategy=FULL_SHARD), or FSDP2 with "
        "reshard_after_forward=False (the same memory/traffic trade-off)",
        fields=("sharding.strategy",), config=_shard_grad_op,
        script=(r"SHARD_GRAD_OP", FOUR_BIT),
        error=r"FSDP does not support changing the parameters between forward and backward",
        wrong="shard_grad_op", fixed=KIT_FSDP1,
        overrides=("sharding.engine=fsdp1", "sharding.strategy=SHARD_GRAD_OP"),
    ),
    Pitfall(
        "fsdp1_no_shard", "FSDP1 on one process, with NO_SHARD, or with HYBRID_SHARD",
        "FSDP1 runs NO_SHARD on one process (or when asked), and HYBRID_SHARD keeps whole copies "
        "per node: the adapter's state-dict gather then fails at save, after every step has "
        "trained ('FSDP assumes ... is in the state_dict'), and with 4-bit weights on a GPU "
        "NO_SHARD's first forward fails ('as_params=True')",
        "FULL_SHARD on 2+ processes, or FSDP2 (kit: sharding.engine=fsdp2) or DDP on one",
        fields=("sharding.strategy", "sharding.engine"), config=_no_shard,
        machine=_fsdp1_one_process,
        error=r"FSDP assumes \S+ is in the state_dict|as_params=True type\(prim_param\)",
        overrides=("sharding.engine=fsdp1", "sharding.strategy=NO_SHARD"),
    ),
    # ------------------------------------------------------------------ training
    Pitfall(
        "lora_not_training", "adapters that never change",
        "the adapters did not move: no gradient reaches them, or the optimizer does not hold "
        "them",
        "use_orig_params=true under FSDP1, LoRA applied before sharding, optimizer built after",
        error=r"none of \d+ trainable tensors changed|lora_B tensors in .* are \(near\) zero",
    ),
    Pitfall(
        "loss_nonfinite", "a loss that turns NaN or inf",
        "the loss became NaN/inf: learning rate too high, fp16 overflow, or bad data",
        "lower training.lr, keep max_grad_norm > 0, use bfloat16 rather than float16",
        error=r"loss is nan|loss is inf|Loss is NaN|non-finite loss",
    ),
    Pitfall(
        "cuda_oom", "a GPU out of memory",
        "a GPU ran out of memory (model shard + activations + logits exceed it, or "
        "fragmentation)",
        "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True; lower batch_size or max_seq_len; "
        "training.recompute.enabled=true; more GPUs",
        error=r"CUDA out of memory|OutOfMemoryError",
    ),
    Pitfall(
        "text_field_missing", "a text field the data does not have",
        "the dataset has no column with the configured text/messages field",
        "data.text_field / data.messages_field = an existing column",
        fields=("data.text_field", "data.messages_field"),
        error=r"is not a column of|KeyError: '(text|messages)'",
    ),
    Pitfall(
        "tokenizers_parallelism", "DataLoader workers forked after a fast tokenizer ran",
        "DataLoader workers fork after a fast tokenizer ran: deadlocks, or 'The current process "
        "just got forked, after parallelism has already been used'",
        "TOKENIZERS_PARALLELISM=false in the environment (os.environ at the top of the script)",
        level="warning", script=(r"num_workers\s*=\s*[1-9]",),
        script_absent=(r"TOKENIZERS_PARALLELISM",),
        error=r"The current process just got forked, after parallelism has already been used",
    ),
    # ------------------------------------------------------------------ saving
    Pitfall(
        "full_state_dict_empty_adapter",
        "FSDP1 FULL_STATE_DICT + PEFT save_pretrained(state_dict=...) (the first article)",
        "FULL_STATE_DICT keys keep FSDP1's nested '_fsdp_wrapped_module.' prefixes, so "
        "save_pretrained(state_dict=...) writes an adapter file with ZERO tensors, no error",
        "gather with get_model_state_dict, map names with PEFT's keys taken before wrapping, "
        "read the file back and compare (kit.recipe.checkpoint)",
        script=(r"save_pretrained\([^)]*state_dict\s*=", r"FULL_STATE_DICT"),
        raises="adapter_empty", wrong="full_state_dict_save", fixed="saved_the_kit_way",
        why="PEFT picks the adapter's keys by walking the module tree it has now; FSDP1 renamed "
            "that tree (_fsdp_wrapped_module. inside every wrapped layer), so no key matches "
            "and an empty file is written without a warning.",
    ),
    Pitfall(
        "full_state_dict_load",
        "FSDP1 FULL_STATE_DICT load of an adapter from rank 0 (the first article)",
        "the first article's load fails on every rank: PEFT writes adapter_model.safetensors, not "
        "adapter_model.bin, and load_state_dict(None) on the other ranks raises 'Expected "
        "state_dict to be dict-like'",
        "rank 0 reads adapter_model.safetensors, keys mapped with PEFT's names taken before "
        "wrapping; set_model_state_dict(options=StateDictOptions(full_state_dict=True, "
        "broadcast_from_rank0=True, strict=False)) on every rank",
        script=(r"\.load_state_dict\(", r"FULL_STATE_DICT", r"adapter_model\.bin"),
        error=r"Expected state_dict to be dict-like, got <class 'NoneType'>|"
              r"No such file or directory: '[^']*adapter_model\.bin'",
        wrong="full_state_dict_load", fixed="adapter_loaded_the_kit_way",
        why="FSDP1's FULL_STATE_DICT load takes the whole state dict on every rank (rank0_only "
            "applies to state_dict() only), and PEFT's file keys lack the adapter name and the "
            "frozen base the model's own names have: a strict load of the file refuses it even on "
            "rank 0 (notebook 08 runs it).",
    ),
    Pitfall(
        "adapter_empty", "an adapter file with no tensors",
        "the adapter file holds no tensors (FSDP-prefixed keys were not mapped)",
        "save through kit.recipe.checkpoint (PEFT keys taken before wrapping)",
        error=r"LoRA tensors missing \(holds 0\)|adapter_model\.safetensors.*(no|zero) tensors",
    ),
    Pitfall(
        "offload_to_cpu_segfault", "FullStateDictConfig(offload_to_cpu=True) on CPU",
        "FullStateDictConfig(offload_to_cpu=True) segfaults rank 0 on CPU/gloo runs (exit code "
        "-11, no Python traceback)",
        "offload_to_cpu=False with rank0_only=True on CPU (keep True on GPUs), or "
        "get_model_state_dict (kit.recipe.checkpoint)",
        level="warning", script=(r"offload_to_cpu\s*=\s*True",),
        raises="segfault", wrong="offload_to_cpu", fixed="saved_the_kit_way", crashes=True,
    ),
    Pitfall(
        "segfault", "a rank killed by a segmentation fault",
        "a rank died of a segmentation fault; on CPU, FullStateDictConfig(offload_to_cpu=True) "
        "does this on rank 0",
        "offload_to_cpu=False with rank0_only=True on CPU; else see dmesg",
        error=r"exitcode\s*:\s*-11|Signal 11|SIGSEGV|Segmentation fault",
    ),
    Pitfall(
        "strict_load", "a strict load of a QLoRA state dict",
        "a strict load of a QLoRA state dict: frozen or bitsandbytes keys (absmax, quant_map) "
        "differ",
        "set_state_dict(..., options=StateDictOptions(strict=False)) for LoRA-only state",
        error=r"Missing key\(s\) in state_dict|Unexpected key\(s\).*(absmax|quant_map)|"
              r"unexpected keys.*(absmax|quant_map)",
    ),
    # ------------------------------------------------------------------ processes
    Pitfall(
        "dist_timeout", "rank 0 busy past the collective timeout while the others wait",
        "a collective waited past the process-group timeout: one rank was busy (saving, "
        "loading, building a model) or had died while the others waited",
        "raise run.dist_timeout_min (init_process_group(timeout=...)); check the first rank's "
        "error",
        fields=("run.dist_timeout_min",),
        error=r"Watchdog caught collective operation timeout|Timed out waiting \d+ms|"
              r"DistBackendError.*[Tt]imeout|wait timeout after \d+ms",
        wrong="short_collective_timeout", fixed="collective_timeout_the_kit_way",
        overrides=("model.name=kit:llama-8b", "run.dist_timeout_min=1"),
    ),
    Pitfall(
        "peer_died", "a rank that lost its peer",
        "this rank lost a peer: another rank failed or was killed first; its error is the cause",
        "look for the earliest failing rank's error (torchrun's summary names it)",
        level="info", error=r"Connection closed by peer|Connection reset by peer|Broken pipe|"
                            r"recvBytes",
    ),
    Pitfall(
        "killed_oom", "a rank killed by the host's out-of-memory killer",
        "a rank was killed (SIGKILL): usually the host's out-of-memory killer, e.g. every rank "
        "loading the whole model into RAM",
        "fewer ranks per node, rank-0-only loading, more RAM",
        error=r"exitcode\s*:\s*-9\b|Signal 9 |SIGKILL",
    ),
    Pitfall(
        "no_gpu", "CUDA requested without a GPU", "CUDA requested where there is no GPU",
        "training.device=auto or cpu",
        error=r"Torch not compiled with CUDA enabled|No CUDA GPUs are available|Found no NVIDIA "
              r"driver",
    ),
    Pitfall(
        "more_ranks_than_gpus", "more ranks than GPUs", "more ranks than GPUs on this node",
        "--nproc_per_node = number of GPUs", error=r"invalid device ordinal",
    ),
    Pitfall(
        "port_in_use", "a rendezvous port already taken",
        "the rendezvous port is taken (another run, or a stale one)",
        "torchrun --standalone (picks a free port), or another MASTER_PORT",
        error=r"EADDRINUSE|[Aa]ddress already in use",
    ),
    Pitfall(
        "nccl_error", "NCCL failing to set up or run a collective",
        "NCCL failed to set up or run a collective (network interface, shared memory, driver)",
        "rerun with NCCL_DEBUG=INFO; check NCCL_SOCKET_IFNAME and /dev/shm size",
        error=r"NCCL error|ncclSystemError|ncclInternalError",
    ),
    Pitfall(
        "accelerate_fsdp_cpu", "accelerate's FSDP on a machine without GPUs",
        "accelerate cannot run FSDP without GPUs: 'no available devices' (with use_cpu: true it "
        "silently runs plain DDP, FSDP off)",
        "run on GPUs, or torchrun -m kit.train (FSDP over gloo works on CPU)",
        error=r"no available devices",
    ),
    Pitfall(
        "data_rows_invalid", "a data file with rows the recipe cannot train on",
        "a row without text (or null, or not a string), a line that is not valid JSON, or no rows "
        "at all: refused, with the file and the row, before anything trains on 'None'",
        "fix or drop the rows named (or point data.text_field / data.messages_field at the right "
        "column)",
        fields=("data.path", "data.val_path"),
        error=r"data\.(?:val_)?path: '[^']*' (?:row \d+|line \d+|holds no rows)",
    ),
    Pitfall(
        "config_invalid", "a config value the kit refuses", "the config was rejected at load",
        "fix that field", error=r"ConfigError: (.*)",
    ),
]

BY_CODE = {p.code: p for p in PITFALLS}
assert len(BY_CODE) == len(PITFALLS), "two pitfalls share a code"


def get(code: str) -> Pitfall:
    if code not in BY_CODE:
        raise KeyError(f"pitfall {code!r} unknown; known: {', '.join(BY_CODE)}")
    return BY_CODE[code]


def reproduced(codes=()) -> list[Pitfall]:
    """The pitfalls with a reproduction, in registry order (`codes`: only those; unknown or
    unreproduced codes raise)."""
    for code in codes:
        if not get(code).wrong:
            raise ValueError(f"pitfall {code!r} has no reproduction; those with one: "
                             + ", ".join(p.code for p in PITFALLS if p.wrong))
    return [p for p in PITFALLS if p.wrong and (not codes or p.code in codes)]


def config_violations(cfg) -> list[tuple[Pitfall, Violation]]:
    """Every pitfall a config walks into that its values alone decide (what load_config refuses)."""
    found = ((p, p.config(cfg)) for p in PITFALLS if p.config)
    return [(p, v) for p, v in found if v is not None]


def machine_violations(cfg, machine: dict) -> list[tuple[Pitfall, Violation]]:
    """The error-level pitfalls the config walks into on `machine` (device, ranks, packages):
    what the pre-flight and the ranks refuse before loading anything."""
    found = ((p, p.machine(cfg, machine)) for p in PITFALLS if p.machine and p.level == "error")
    # (a record may have both predicates: its config one is load_config's, this is the machine's)
    return [(p, v) for p, v in found if v is not None]


def source(function: str) -> str:
    """The source text of a function of kit/lab/reproduce_rank.py, read from the file (no torch)."""
    text = REPRODUCE.read_text()
    node = next((n for n in ast.parse(text).body
                 if isinstance(n, ast.FunctionDef) and n.name == function), None)  # fmt: skip
    if node is None:
        raise KeyError(f"kit/lab/reproduce_rank.py has no function {function!r}")
    return ast.get_source_segment(text, node)


def summary(function: str) -> str:
    """The first line of a reproduction's docstring: what that code does, in words."""
    node = ast.parse(source(function)).body[0]
    return (ast.get_docstring(node) or "").split("\n")[0]
