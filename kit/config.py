"""One config tree for every run: YAML file + ``key=value`` overrides, validated once at load.

Imported by both sides (notebook kernel and torchrun ranks), so it imports no torch and of the kit
only the pitfall registry (kit.pitfalls: the rules a config can break, one record each, which
imports nothing but kit.findings): dtypes and engines are plain strings here and become objects
on the rank side.

    cfg = load_config("kit/configs/tiny-cpu.yaml", ["sharding.engine=fsdp1", "training.lr=2e-4"])

Every bad value raises ``ConfigError`` with one line: the field, the value, what is allowed.

Longer than 400 lines because it is the schema of every field, each with the comment a person
reads to choose its value, and the one loader that checks them.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import re
import types
import typing
import unicodedata
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Union, get_args, get_origin

import yaml

from kit import pitfalls

DType = Literal["bfloat16", "float16", "float32"]
Tracker = Literal["jsonl", "tensorboard", "trackio"]  # run.report_to (kit.recipe.trackers)
AUTO = "auto"  # a value the planner chooses (kit.budget.plan)


class ConfigError(ValueError):
    """A config value that cannot run; the message names field, value and what is allowed."""


class Unprintable(ConfigError):
    """A string value holding a control character (see _printable)."""


@dataclass
class ModelConfig:
    # A hub id, a local checkpoint folder, or a model the kit builds itself ("kit:tiny-llama",
    # "kit:tiny-qwen2", "kit:llama-1b", "kit:llama-8b": random weights, see kit/inputs/builtin.py).
    name: str = "kit:tiny-llama"
    # Dtype of everything that is not 4-bit: norms, embeddings, compute. bf16 on GPUs; this CPU has
    # no bf16 instructions, so above ~40M params prefer float32 when running on CPU.
    dtype: DType = "bfloat16"
    trust_remote_code: bool = False
    # How each rank gets the weights (kit/recipe/loading.py). full: every rank reads the checkpoint and
    # quantizes it, then holds the whole model until sharding; rank0: rank 0 does, the others
    # build the model on the meta device and receive it by broadcast; stream (FSDP2, FSDP1): each
    # rank reads one tensor at a time, quantizes it on its device and keeps only its shard: no
    # rank ever holds the whole model (what a 70B model on 24 GB GPUs needs). auto: stream in the ranks
    # of an FSDP2 or FSDP1 run (rank0 for a checkpoint whose names transformers renames, and
    # under accelerate, which shards itself), full under DDP and outside a run (a notebook).
    loading: Literal["auto", "full", "rank0", "stream"] = "auto"
    # A mixture of experts' experts (kit/recipe/experts.py). grouped: each layer's routed rows
    # sorted by expert once, every expert's projection and adapters as grouped GEMMs. loop:
    # transformers' eager loop, one hit expert at a time with bitsandbytes' 4-bit matmul, the
    # reference the grouped forward is checked against (its losses:
    # benchmarks/matrices/moe-loop-vs-grouped-cpu.yaml); far slower on a GPU, not compiled by the
    # plan (it reads each layer's routing back to the host: a graph break), its speed not
    # predicted. Dense models have none: no effect there.
    experts: Literal["grouped", "loop"] = "grouped"


@dataclass
class QuantizationConfig:
    # nf4: 4-bit NormalFloat (QLoRA); fp4: plain 4-bit float; none: keep base weights in model.dtype.
    method: Literal["nf4", "fp4", "none"] = "nf4"
    double_quant: bool = True  # quantize the scales too: ~0.4 bit/param saved, tiny extra compute
    # Dtype the packed 4-bit bytes are stored in. "auto" = model.dtype, which is what FSDP needs to
    # flatten/shard them next to the bf16 norms; uint8 only works for DDP / FSDP2.
    storage: Literal["auto", "uint8", "bfloat16", "float16", "float32"] = "auto"
    # Run the frozen 4-bit layers' matmuls in FP8 with a scale per row (kit.recipe.levers.fp8; Hopper GPUs run
    # FP8 at about twice the bf16 rate). Changes numerics, so off unless asked; adapters stay bf16.
    fp8_matmul: bool = False


@dataclass
class LoraConfig:
    r: int = 8  # rank: higher learns more, costs more memory and optimizer state
    alpha: int = 16  # scale = alpha / r; keep the ratio when changing r
    dropout: float = 0.05
    # "all-linear" (every linear layer but the output head) or a list of module names.
    target_modules: str | list[str] = "all-linear"
    # Dtype of the adapter weights. "auto": float32 (exact optimizer updates) except under FSDP1,
    # which must flatten one dtype per unit, so there they take model.dtype.
    dtype: Literal["auto", "bfloat16", "float16", "float32"] = "auto"
    # Recompute each adapter's dropout and down-projection in backward instead of storing the
    # dropout mask and the dropped copy of the input (kit.recipe.lora.recompute_adapters): same result,
    # less activation memory; the speed levers (kit.bench) use it. Where lora.fused_down is on, the
    # fused kernel (which keeps neither) runs those layers instead.
    recompute: bool = False
    # Adapters that read one input (q/k/v; gate/up) drop it once and run their down-projections
    # as one matmul (kit.recipe.levers.lora_groups): fewer, larger kernels. The members share one dropout mask
    # instead of three, which changes what is learned a little (measured in benchmarks/records/).
    # auto: the planner's choice (kit.budget.plan: grouped on GPUs, where it pays).
    group_inputs: bool | Literal["auto"] = "auto"
    # Each adapter's dropout computed inside its down-projection's kernel (kit.recipe.lora_down):
    # the input read once, no dropout mask and no dropped copy in memory; the same masks on every
    # path (a hash of the row and column). Off: PEFT's dropout. auto: the planner's choice (on
    # where the Triton kernels run and lora.dropout > 0). Off the GPU it runs the same arithmetic
    # in torch ops.
    fused_down: bool | Literal["auto"] = "auto"


@dataclass
class ShardingConfig:
    # fsdp2: per-parameter sharding (fully_shard); fsdp1: FlatParameter FSDP as most articles use
    # it; ddp: every rank holds the whole model (only for models that fit one device).
    engine: Literal["fsdp2", "fsdp1", "ddp"] = "fsdp2"
    # Cast params to model.dtype for compute, reduce grads in float32 (FSDP1 reduces in model.dtype).
    mixed_precision: bool = True
    cpu_offload: bool = False  # parameters live on CPU between uses: slow, saves device memory
    # FSDP2: free the gathered layer after forward (saves memory; backward gathers again).
    reshard_after_forward: bool = True
    # FSDP1 only.
    strategy: Literal["FULL_SHARD", "SHARD_GRAD_OP", "HYBRID_SHARD", "NO_SHARD"] = "FULL_SHARD"
    backward_prefetch: Literal["BACKWARD_PRE", "BACKWARD_POST", "none"] = "BACKWARD_PRE"
    forward_prefetch: bool = False
    use_orig_params: bool = True  # required for LoRA: lets frozen and trainable params share a unit
    sync_module_states: bool = False  # broadcast rank 0's weights at wrap time
    limit_all_gathers: bool = True


@dataclass
class AttentionConfig:
    # flash_attention_2 needs the flash-attn package (GPU only); sdpa includes a flash kernel too.
    # sdpa_<backend> pins PyTorch SDPA to one kernel (kit.recipe.attention): flash, efficient, cudnn, math.
    # auto: the fastest the model class supports on this device (kit.inputs.families.pick_attention;
    # the plan says which): sdpa, else eager on a CPU / FlashAttention 2 or flex on a GPU.
    implementation: Literal[
        "auto", "eager", "sdpa", "sdpa_flash", "sdpa_efficient", "sdpa_cudnn", "sdpa_math",
        "flex_attention", "flash_attention_2",
    ] = "auto"


@dataclass
class RecomputeConfig:
    """training.recompute: activation recomputation ("activation checkpointing" in torch and
    transformers; the kit keeps the word checkpoint for what is saved to disk)."""

    # Recompute decoder layers in backward: ~30% more compute, activations of one layer only.
    enabled: bool = True
    # Recompute every k-th decoder layer only (1: all). Fewer recomputed layers: less compute,
    # more activation memory.
    every: int = 1
    # What a recomputed layer keeps for backward (kit.recipe.recompute):
    # inputs: only its input; backward reruns the whole layer (~1/3 more compute, least memory).
    # matmuls: the results of the frozen linear layers, attention and the adapters; backward
    #   reruns only norms, RoPE, SiLU, dropout: no matmul twice, about half the memory of
    #   keeping all.
    # mlp_matmuls: the MLP's widest results (gate and up projections), attention's and the
    #   adapters'; q/k/v/o and down are recomputed (about a fifth of the matmul work twice): ~80%
    #   of the memory of matmuls.
    # attention_matmuls: only the attention block's matmul results (q, k, v, o, attention) and the
    #   MLP's down projection; gate/up are recomputed (half of the matmul work twice): about half
    #   the memory of matmuls.
    # auto: the planner picks the policy and batch that it predicts fastest within memory
    # (kit.budget.plan); inputs where it does not plan (a CPU, training.plan=off).
    keeps: Literal["auto", "inputs", "matmuls", "mlp_matmuls", "attention_matmuls"] = "auto"
    # How many recomputed layers (the first ones) keep every matmul's result whatever `keeps`
    # says (mlp_matmuls or attention_matmuls only): the memory between two policies, used a
    # layer at a time. Measured on one H100 at the 8B shape, 24 GiB: +0.44 GiB and ~+0.2%
    # tokens/s per layer at batch 4 (benchmarks/records/2026-11-27-layers-24gib-8b-1xh100), within the
    # run-to-run spread, so the planner leaves it at 0; the estimate counts what you set.
    matmul_layers: int = 0
    # Run each layer's MLP this many tokens at a time, keeping only its input (kit.recipe.recompute):
    # at long sequences its gate/up intermediates are a layer's widest tensors (at the 8B shape
    # 56 KiB per token each). 0: off. Eager layers with keeps=inputs (or recompute off) only.
    # auto: the planner's, 8,192 when nothing fits without (kit.budget.plan), else 0.
    mlp_tile_tokens: int | Literal["auto"] = "auto"
    # Run each layer's attention block this many queries at a time, keeping only its input
    # (kit.recipe.levers.attention_tiles): at long sequences q, k, v, attention's output and the adapters'
    # dropped inputs are most of what a recomputed layer holds (~90 KiB per token at the 8B
    # shape). 0: off. As mlp_tile_tokens; adapters ungrouped; rows without padding. auto: as
    # mlp_tile_tokens, after it, with lean_norms.
    attention_tile_tokens: int | Literal["auto"] = "auto"
    # RMSNorms that keep their bf16 input and not its fp32 copy (kit.recipe.levers.norms): 24 KiB less
    # per token and layer at the 8B shape, the same forward, op for op. Eager layers (as the tiles).
    # auto: the planner's, on with attention tiles.
    lean_norms: bool | Literal["auto"] = "auto"


@dataclass
class TrainingConfig:
    # auto (the default): every value below left at "auto" is chosen by the planner
    # (kit.budget.plan) from the model's shape, the GPUs, the engine and the data: the fastest
    # configuration its memory estimate says fits; a value you set is kept. `kit plan CONFIG`
    # shows the choices and why. off: "auto" values take the recipe's plain ones (batch 8, loss
    # hf, no compile, recompute keeps inputs, adapters ungrouped).
    plan: Literal["auto", "off"] = "auto"
    steps: int = 20  # optimizer steps
    # Sequences per device per micro-step; auto: the largest the plan finds fastest within memory
    # (8 on a CPU).
    batch_size: int | Literal["auto"] = "auto"
    grad_accum: int = 1  # micro-steps per optimizer step
    lr: float = 2e-4  # for real models with LoRA; tiny random models learn at 1e-2 (tiny-cpu.yaml)
    weight_decay: float = 0.0
    warmup_steps: int = 2
    scheduler: Literal["cosine", "linear", "constant"] = "cosine"
    max_grad_norm: float = 1.0  # 0 disables clipping
    # What a decoder layer keeps for backward and recomputes (kit.recipe.recompute).
    recompute: RecomputeConfig = field(default_factory=RecomputeConfig)
    # "hf": transformers' loss (upcasts all logits to fp32 at once); "chunked": the same loss in
    # fp32 over chunks of tokens, recomputed in backward (kit.recipe.levers.loss): ~2.6 GB less per 2k tokens
    # with a 128k vocabulary; "fused": the output head and the loss together, a chunk of tokens
    # at a time, gradient taken in forward: no logits for the whole batch ever exist (a further
    # ~1 GB per 2k tokens at 128k vocabulary). Needs a frozen output head; in training the
    # model's output then holds no logits (evaluation still gets them).
    # auto: fused on GPUs where the model allows it (a frozen head, no logit softcapping or
    # scaling), else chunked; hf on a CPU.
    loss: Literal["auto", "hf", "chunked", "fused"] = "auto"
    # What autograd keeps for backward waits in pinned host memory (kit.recipe.levers.offload): with whole-layer
    # recompute, each layer's input; with recompute off, all the layers keep. Saves GPU memory,
    # costs host memory and PCIe copies (a side stream overlaps them with compute). GPUs only.
    # auto: the planner offloads only when nothing fits in GPU memory otherwise (off on a CPU).
    offload_activations: bool | Literal["auto"] = "auto"
    # torch.compile each decoder layer (after sharding, so FSDP's hooks stay outside the graph):
    # fuses the norm, rotary, activation, dropout and LoRA element-wise work around the matmuls.
    # The first step pays the compile (tens of seconds; a new batch shape compiles once more).
    # auto: on GPUs (off on a CPU and with MLP or attention tiles; with offloaded activations
    # only under whole-layer recompute).
    compile: bool | Literal["auto"] = "auto"
    # With compile: the host code that launches a compiled layer's kernels, inductor's Python
    # (python) or C++ (cpp: its cpp_wrapper, process-wide; the first step also compiles it, about
    # a minute more). Where the GPU waits on the host, cpp is the faster: on one H200 the 8B
    # shape at batch 2 keeping every matmul ran 14,121 tokens/s with it (9,830 with neither it
    # nor FSDP2 leaving the frozen weights alone; the plan's batch 5: 12,579), in
    # benchmarks/records/2026-11-30-host-overhead-1xh200; with it the planner takes that
    # batch at 24 GiB (14,846 in a 2,000-step run's plan, 1.30x unsloth in one invocation:
    # benchmarks/records/2026-11-30-loss-kernel-1xh200). GPUs and dense models only (torch
    # 2.11's C++ wrapper has no grouped GEMM, which a mixture of experts needs). auto: the plan's
    # choice, cpp for the dense families it was measured on (GPU, FSDP2, compiled layers) where
    # the run's steps repay its compile by the step model (the 8B shape: from ~1,600 steps at 24
    # GiB), python elsewhere and on a CPU.
    compile_wrapper: Literal["auto", "python", "cpp"] = "auto"
    # With compile: the share of a compiled layer's activations kept for backward (1.0: the
    # default partitioner). Below 1, torch's partitioner recomputes the cheapest work in backward
    # (element-wise first, matmuls last) until the kept activations fit this fraction: selective
    # recompute chosen by cost, inside each compiled layer, instead of whole-layer checkpointing.
    activation_memory_budget: float = 1.0
    eval_every: int = 10  # steps between validation losses; 0: only at the end
    eval_batches: int = 2
    log_every: int = 1
    seed: int = 42
    device: Literal["auto", "cpu", "cuda"] = "auto"
    # "auto": continue from the newest complete checkpoint in output_dir (if any); or a path to one.
    resume: str = ""
    stop_at_step: int = 0  # end the run early after this step, as an interruption would; 0: never


@dataclass
class DataConfig:
    # A local .json/.jsonl/.parquet file (text, messages or ShareGPT rows), a .csv (text rows
    # only: its cells are strings), or "kit:sample" (ships with the kit).
    path: str = "kit:sample"
    format: Literal["auto", "text", "messages"] = "auto"  # auto: messages if that field exists
    text_field: str = "text"
    messages_field: str = "messages"
    # Tokens per row; longer rows are cut. auto: the longest tokenized row of the training data
    # (rounded up to a multiple of 8), at most the model's max_position_embeddings; with packing,
    # 2048 (or the model's maximum if smaller). Activation memory grows linearly with it (sdpa).
    max_seq_len: int | Literal["auto"] = "auto"
    # Pack several samples into each row (no padding); attention never crosses samples (position
    # ids restart per sample). See kit.recipe.data.
    packing: bool = False
    val_fraction: float = 0.1
    val_path: str = ""  # a separate validation file; overrides val_fraction
    # Chat rows: the loss on the assistant's turns only (what is to be learned; the system prompt
    # and the user's turns are context), or on every token (all). Text rows train on every token.
    train_on: Literal["assistant", "all"] = "assistant"


@dataclass
class CheckpointingConfig:
    save_adapter: bool = True  # PEFT-format adapter in <output_dir>/adapter, verified after writing
    # Training checkpoints (adapter + optimizer + scheduler + data position + RNG of every rank)
    # in <output_dir>/checkpoints/step-NNNNNN every N steps; 0: none.
    save_every: int = 0
    # sharded: torch.distributed.checkpoint, each rank writes its shard in parallel (fast, any world
    # size can load it); full: gathered to rank 0 into one torch.save file (portable, slower).
    format: Literal["sharded", "full"] = "sharded"
    keep_last: int = 2  # older complete checkpoints are deleted; 0 keeps all
    # Keep the checkpoint with the lowest held-out loss too, whatever keep_last prunes (each
    # checkpoint's manifest records the loss of its step's evaluation): for a run whose held-out
    # loss rises. Needs an evaluation at every checkpoint: save_every a multiple of eval_every.
    keep_best: bool = False
    # A fixed probe batch's logits, saved next to the adapter: lets anyone check that the adapter
    # reloaded without FSDP reproduces the trained model.
    save_probe_logits: bool = True


@dataclass
class RunConfig:
    name: str = "default"
    output_dir: str = ""  # "": launch/<name>
    # Start over in an output_dir that holds an earlier run: its files move, byte for byte, into
    # <output_dir>/earlier/<time>/ (kit.folder.runfolder); nothing is deleted. Off: such a start is
    # refused, so re-running a command never touches what was trained.
    start_over: bool = False
    # Collective timeout (NCCL/gloo). Raise it when gathering or saving a large model takes long.
    dist_timeout_min: int = 30
    # Where rank 0's metrics go besides metrics.jsonl (always written; kit.recipe.trackers):
    # tensorboard (event files in <output_dir>/tensorboard/), trackio (a local project in
    # <output_dir>/trackio/, needs `pip install trackio`). One name or a list.
    report_to: list[Tracker] = field(default_factory=lambda: ["jsonl"])


@dataclass
class Config:
    run: RunConfig = field(default_factory=RunConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    quantization: QuantizationConfig = field(default_factory=QuantizationConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)
    sharding: ShardingConfig = field(default_factory=ShardingConfig)
    attention: AttentionConfig = field(default_factory=AttentionConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    data: DataConfig = field(default_factory=DataConfig)
    checkpointing: CheckpointingConfig = field(default_factory=CheckpointingConfig)

    @property
    def output_dir(self) -> Path:
        return Path(self.run.output_dir or f"launch/{self.run.name}")

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)


# --------------------------------------------------------------------------- loading and checking


def _describe(tp: Any) -> str:
    origin = get_origin(tp)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in get_args(tp))
    if origin in (Union, types.UnionType):
        return " or ".join(_describe(a) for a in get_args(tp))
    if origin is list:
        return f"a list of {_describe(get_args(tp)[0])}"
    return {bool: "true or false", int: "an integer", float: "a number", str: "a string"}.get(
        tp, str(tp)
    )


def _coerce(name: str, value: Any, tp: Any) -> Any:
    """Return value as type tp, or raise ConfigError naming the field."""
    origin = get_origin(tp)
    if origin is Literal:
        # YAML 1.1 (PyYAML) reads a bare off / on as false / true: `training.plan=off` is meant
        if isinstance(value, bool) and ("on" if value else "off") in get_args(tp):
            return "on" if value else "off"
        if not isinstance(value, bool) and value in get_args(tp):
            return value
    elif origin in (Union, types.UnionType):
        for option in get_args(tp):
            try:
                return _coerce(name, value, option)
            except Unprintable:
                raise  # the type fits, the characters do not: say so, not the type
            except ConfigError:
                pass
    elif origin is list:
        if isinstance(value, str) and get_origin(get_args(tp)[0]) is Literal:
            value = [value]  # run.report_to=tensorboard: a list of one name
        if isinstance(value, (list, tuple)):
            return [_coerce(f"{name}[{i}]", v, get_args(tp)[0]) for i, v in enumerate(value)]
    elif tp is bool:
        if isinstance(value, bool):
            return value
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif tp is float:
        number = None
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            number = float(value)
        elif isinstance(value, str):  # YAML 1.1 reads "2e-4" as a string
            try:
                number = float(value)
            except ValueError:
                pass
        if number is not None and math.isfinite(number):
            return number
        if number is not None:
            raise ConfigError(f"{name}: {value!r} is not allowed; expected a finite number")
    elif tp is str:
        if isinstance(value, str):
            return _printable(name, value)
    raise ConfigError(f"{name}: {value!r} is not allowed; expected {_describe(tp)}")


def _printable(name: str, value: str) -> str:
    """value, refused when it holds a control or line-break character: every string field can
    reach a generated file (run.sh, job.sbatch, YAML), where such a character starts a line of
    its own, and no file name or hub id needs one."""
    bad = [c for c in value if unicodedata.category(c) in ("Cc", "Zl", "Zp")]
    if bad:
        raise Unprintable(f"{name}: {value!r} is not allowed; expected text without control "
                          f"characters ({bad[0]!r} here: newline, carriage return, tab, NUL and "
                          "the like would end a line of run.sh or a YAML file)")
    return value


# Keys that were renamed: a config that still uses one gets a one-line hint to the new name.
RENAMED = {
    "training.activation_checkpointing": "training.recompute.enabled",
    "training.checkpoint_every": "training.recompute.every",
    "training.checkpoint_keeps": "training.recompute.keeps (inputs, matmuls, mlp_matmuls, "
                                 "attention_matmuls; mlp -> mlp_matmuls, attention -> "
                                 "attention_matmuls)",
    "run.overwrite": "run.start_over (the earlier run moves into <output_dir>/earlier/; the kit "
                     "never deletes a run)",
}


def _build(cls: type, data: Any, prefix: str) -> Any:
    if not isinstance(data, dict):
        raise ConfigError(f"{prefix or 'config'}: {data!r} is not allowed; expected a mapping")
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    kwargs = {}
    for key, value in data.items():
        path = f"{prefix}{key}"
        if path in RENAMED:
            raise ConfigError(f"{path}: renamed; use {RENAMED[path]}")
        if key not in names:
            near = difflib.get_close_matches(str(key), names, n=1, cutoff=0.6)
            hint = f"did you mean {prefix}{near[0]}? " if near else ""
            raise ConfigError(f"{path}: unknown key; {hint}allowed keys: {', '.join(names)}")
        tp = hints[key]
        if dataclasses.is_dataclass(tp):
            kwargs[key] = _build(tp, value if value is not None else {}, f"{path}.")
        else:
            kwargs[key] = _coerce(path, value, tp)
    return cls(**kwargs)


def apply_overrides(tree: dict, overrides: list[str] | None) -> dict:
    """Set each ``key=value`` of `overrides` in the config tree `tree` (values read as YAML), in
    place; returns the tree. Nothing is validated here: load_config and config_from_dict do that."""
    for item in overrides or []:
        _set_override(tree, item)
    return tree


def _set_override(tree: dict, item: str) -> None:
    if "=" not in item:
        raise ConfigError(f"override {item!r}: expected key=value, e.g. training.lr=2e-4")
    key, raw = item.split("=", 1)
    if not key.isprintable():  # a newline or control character: one line, naming it as written
        raise ConfigError(f"override {item!r}: the key {key!r} is not allowed; expected a "
                          "dotted name, e.g. training.lr")
    parts = key.strip().split(".")
    node = tree
    for part in parts[:-1]:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise ConfigError(f"{key}: {part!r} is not a section")
    try:
        node[parts[-1]] = yaml.load(raw, Loader=UniqueKeyLoader) if raw.strip() else ""
    except yaml.YAMLError as e:
        what = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise ConfigError(f"{key}: {raw!r} is not allowed; expected a YAML value ({what})") \
            from None


RUN_NAME = r"[A-Za-z0-9][A-Za-z0-9._-]*"


def _need(ok: bool, name: str, value: Any, allowed: str) -> None:
    if not ok:
        raise ConfigError(f"{name}: {value!r} is not allowed; {allowed}")


def _check(cfg: Config) -> None:
    """Range and combination checks that types alone cannot express, part by part (the first
    value refused is the one named)."""
    for part in (_check_names_and_counts, _check_recompute, _check_optimizer, _check_data,
                 _check_tiles_and_offload, _check_model_and_lora):
        part(cfg)
    for _, violation in pitfalls.config_violations(cfg):  # FSDP1 and attention combinations
        raise ConfigError(str(violation))


def _check_names_and_counts(cfg: Config) -> None:
    t, rc, m = cfg.training, cfg.training.recompute, cfg.model
    _need(m.name.strip() != "", "model.name", m.name, "expected a hub id, a local path or kit:<name>")
    # A name stays a name: launch/<run.name>/ must not climb out of launch/ (run.output_dir is the
    # key for a folder elsewhere).
    _need(re.fullmatch(RUN_NAME, cfg.run.name) is not None, "run.name", cfg.run.name,
          "expected letters, digits, '.', '_' or '-', starting with a letter or digit (it names a "
          "folder under launch/; run.output_dir=<path> writes elsewhere)")
    # Every generator the run seeds takes seed + rank, and torch's take at most 2**64 - 1.
    _need(0 <= t.seed < 2**63, "training.seed", t.seed, "expected an integer from 0 to 2**63 - 1")
    ranges = [  # (field, its value, smallest allowed)
        *((f"training.{n}", getattr(t, n), 1)
          for n in ("steps", "batch_size", "grad_accum", "eval_batches", "log_every")),
        ("training.recompute.every", rc.every, 1), ("run.dist_timeout_min", cfg.run.dist_timeout_min, 1),
        ("training.stop_at_step", t.stop_at_step, 0),
        ("checkpointing.save_every", cfg.checkpointing.save_every, 0),
        ("checkpointing.keep_last", cfg.checkpointing.keep_last, 0),
    ]  # fmt: skip
    for name, value, low in ranges:
        if value == AUTO:  # training.batch_size: the planner's (kit.budget.plan)
            continue
        unit = " (minutes)" if name == "run.dist_timeout_min" else ""
        _need(value >= low, name, value, f"expected an integer >= {low}{unit}")


def _check_recompute(cfg: Config) -> None:
    t, rc, lo = cfg.training, cfg.training.recompute, cfg.lora
    _need(0 < t.activation_memory_budget <= 1, "training.activation_memory_budget",
          t.activation_memory_budget, "expected a number in (0, 1]")
    _need(t.compile_wrapper != "cpp" or t.compile is not False, "training.compile_wrapper", "cpp",
          "only with training.compile=true or auto (it launches a compiled layer's kernels)")
    _need(t.compile is not False or t.activation_memory_budget == 1, "training.activation_memory_budget",
          t.activation_memory_budget, "only 1.0 without training.compile=true (the budget steers "
          "the compiler's recompute)")
    _need(rc.enabled or rc.keeps in ("inputs", AUTO), "training.recompute.keeps",
          rc.keeps, "only 'inputs' with training.recompute.enabled=false")
    _need(rc.keeps in ("inputs", AUTO) or t.activation_memory_budget == 1,
          "training.activation_memory_budget", t.activation_memory_budget,
          f"only 1.0 with training.recompute.keeps={rc.keeps!r} (its policy decides "
          "what is recomputed)")
    _need(rc.matmul_layers >= 0, "training.recompute.matmul_layers", rc.matmul_layers,
          "expected an integer >= 0")
    _need(rc.matmul_layers == 0 or (rc.enabled and rc.keeps in
                                            ("mlp_matmuls", "attention_matmuls", AUTO)),
          "training.recompute.matmul_layers", rc.matmul_layers,
          "only 0 unless training.recompute.keeps is mlp_matmuls or attention_matmuls (the "
          "layers it names keep every matmul instead)")
    _need(not (lo.recompute and rc.enabled and rc.keeps not in ("inputs", AUTO)),
          "lora.recompute", lo.recompute, "only false with training.recompute.keeps="
          f"{rc.keeps!r} (its policy already recomputes the adapters' branch)")


def _check_optimizer(cfg: Config) -> None:
    """Steps between evaluations and warm-up, the best checkpoint, the optimizer's numbers."""
    t, c = cfg.training, cfg.checkpointing
    for name in ("warmup_steps", "eval_every"):
        _need(getattr(t, name) >= 0, f"training.{name}", getattr(t, name), "expected an integer >= 0")
    _need(not c.keep_best or (c.save_every > 0 and t.eval_every > 0 and c.save_every % t.eval_every
                              == 0), "checkpointing.keep_best", c.keep_best, "only false unless "
          "every checkpoint has a held-out loss: checkpointing.save_every > 0 a multiple of "
          f"training.eval_every > 0 (they are {c.save_every} and {t.eval_every})")
    _need(t.lr > 0, "training.lr", t.lr, "expected a number > 0")
    _need(t.weight_decay >= 0, "training.weight_decay", t.weight_decay, "expected a number >= 0")
    _need(t.max_grad_norm >= 0, "training.max_grad_norm", t.max_grad_norm, "expected >= 0 (0: off)")


def _check_data(cfg: Config) -> None:
    d = cfg.data
    _need(d.max_seq_len == AUTO or d.max_seq_len >= 2, "data.max_seq_len", d.max_seq_len,
          "expected an integer >= 2")
    _need(0 <= d.val_fraction < 1, "data.val_fraction", d.val_fraction, "expected 0 <= x < 1")


def _check_tiles_and_offload(cfg: Config) -> None:
    """The long-sequence levers run outside a compiled graph and a selective recompute policy."""
    t, rc, lo = cfg.training, cfg.training.recompute, cfg.lora
    _need(rc.mlp_tile_tokens == AUTO or rc.mlp_tile_tokens >= 0, "training.recompute.mlp_tile_tokens",
          rc.mlp_tile_tokens, "expected an integer >= 0 (tokens per tile; 0: off) or auto")
    _need(rc.mlp_tile_tokens in (0, AUTO) or (t.compile is not True and rc.keeps in ("inputs", AUTO)),
          "training.recompute.mlp_tile_tokens", rc.mlp_tile_tokens,
          "only 0 with training.compile=true or a selective training.recompute.keeps (the tiles "
          "run outside their graph and policy)")
    _need(rc.attention_tile_tokens == AUTO or rc.attention_tile_tokens >= 0,
          "training.recompute.attention_tile_tokens", rc.attention_tile_tokens,
          "expected an integer >= 0 (queries per tile; 0: off) or auto")
    _need(rc.attention_tile_tokens in (0, AUTO) or (t.compile is not True and rc.keeps in ("inputs", AUTO)
                                            and lo.group_inputs is not True),
          "training.recompute.attention_tile_tokens", rc.attention_tile_tokens,
          "only 0 with training.compile=true, a selective training.recompute.keeps or "
          "lora.group_inputs=true (the tiles run outside their graph, policy and groups)")
    _need(rc.lean_norms in (False, AUTO) or (t.compile is not True and rc.keeps in ("inputs", AUTO)),
          "training.recompute.lean_norms", rc.lean_norms,
          "only false with training.compile=true or a selective training.recompute.keeps (the "
          "norms' own backward runs outside their graph and policy)")
    # Offloaded layer inputs pair with compiled layers under whole-layer recompute: the
    # checkpoint around each compiled layer saves its input through autograd, where the offload
    # hook sees it as in eager (tests/test_offload.py). A selective policy's matmul results are
    # kept inside the checkpoint, and without recompute a compiled graph saves its own tensors:
    # neither was measured offloaded.
    _need(not (t.offload_activations is True and t.compile is True)
          or (rc.enabled and rc.keeps in ("inputs", AUTO)), "training.offload_activations", True,
          "with training.compile=true only under whole-layer recompute "
          "(training.recompute.enabled=true, keeps=inputs)")


def _check_model_and_lora(cfg: Config) -> None:
    m, lo = cfg.model, cfg.lora
    _need(m.loading != "stream" or cfg.sharding.engine != "ddp", "model.loading", m.loading,
          "only with sharding.engine=fsdp2 or fsdp1 (it shards as it loads); with ddp: full "
          "or rank0")
    _need(not cfg.quantization.fp8_matmul or cfg.quantization.method != "none",
          "quantization.fp8_matmul", True, "only with quantization.method nf4 or fp4 (it runs the "
          "4-bit layers' matmuls)")
    _need(lo.r >= 1, "lora.r", lo.r, "expected an integer >= 1")
    _need(lo.alpha >= 1, "lora.alpha", lo.alpha, "expected an integer >= 1")
    _need(0 <= lo.dropout < 1, "lora.dropout", lo.dropout, "expected 0 <= x < 1")
    _need(lo.target_modules not in ([], ""), "lora.target_modules", lo.target_modules,
          'expected "all-linear" or a non-empty list of module names')


class DuplicateKey(yaml.YAMLError):
    def __init__(self, key: Any, mark: Any):
        super().__init__(f"key {key!r} given twice")
        self.key, self.mark = key, mark


class UniqueKeyLoader(yaml.SafeLoader):
    """yaml.safe_load's loader, but a mapping key given twice is an error (safe_load keeps the
    last silently: a second `training:` section would drop the first without a word)."""

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":  # `<<: *anchor` may be overridden
                continue
            key = self.construct_object(key_node, deep=deep)
            if isinstance(key, typing.Hashable) and key in seen:
                raise DuplicateKey(key, key_node.start_mark)
            seen.add(key)
        return super().construct_mapping(node, deep)


def read_yaml(path: Path) -> dict:
    """A YAML config file as a tree; a syntax error or a key given twice is one line naming the
    file, line and column."""
    try:
        tree = yaml.load(Path(path).read_text(), Loader=UniqueKeyLoader)
    except DuplicateKey as e:
        raise ConfigError(f"config file: {str(path)!r} line {e.mark.line + 1}: key {e.key!r} is "
                          "given twice; expected each key once (merge the two, or the later "
                          "would silently replace the earlier)") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" line {mark.line + 1} column {mark.column + 1}" if mark else ""
        what = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise ConfigError(f"config file: {str(path)!r}{where} is not valid YAML ({what})") from None
    if tree is None:
        return {}
    if not isinstance(tree, dict):
        raise ConfigError(f"config file: {str(path)!r} holds {type(tree).__name__} "
                          f"{tree!r:.40}; expected a mapping of sections (run:, model:, ...)")
    return tree


BUNDLED = Path(__file__).resolve().parent / "configs"  # tiny-cpu, ...: configs by name


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> Config:
    """Read YAML (or defaults when path is None), apply key=value overrides, validate, return.
    A path that is no file but a bundled config's name (tiny-cpu: kit/configs/) reads that."""
    tree: dict = {}
    if path is not None:
        p = Path(path)
        bundled = BUNDLED / f"{path}.yaml"
        if not p.exists() and "/" not in str(path) and bundled.is_file():
            p = bundled
        if not p.is_file():
            bundled = ", ".join(sorted(f.stem for f in BUNDLED.glob("*.yaml")))
            raise ConfigError(f"config file: {str(p)!r} does not exist; a YAML file, or a "
                              f"bundled config: {bundled}")
        tree = read_yaml(p)
    apply_overrides(tree, overrides)
    cfg = _build(Config, tree, "")
    _check(cfg)
    return cfg


def config_from_dict(tree: dict) -> Config:
    cfg = _build(Config, tree, "")
    _check(cfg)
    return cfg
