"""Notebook 05's cases, rank side: the recipe's order of operations, and the same lines with one
step moved, each run for real on every rank.

    torchrun --nproc_per_node=2 -m kit.lab.order_rank CONFIG OUT [FUNCTION-ENGINE-BASE ...]

`recipe_order` is the order kit.recipe.model.build and kit.lab.sharding follow: load the 4-bit base, add
LoRA, switch on activation checkpointing, train mode, shard, then build the optimizer. Every other
case function is those lines with one step moved, removed or changed, and nothing else
(tests/test_order.py holds that). Each runs under FSDP2 and FSDP1 (RUNS), in turn, in one process group; a `Trial`
carries the pieces they share (load, LoRA, shard, train) and measures what happened: every step's
loss, step 1's layer forwards and the bytes autograd kept for backward, which tensors the
optimizer holds, whether the adapters are sharded and equal on every rank, where the weights
were placed, or the exception's first line. The runs are a case table on the experiment harness
(kit.bench.experiment: the group, the rows, the cleanup); rank 0 writes
OUT/cases/<function>-<engine>-<base>.json, and kit.lab.order (kernel side) reads them.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import importlib.metadata
import logging
import sys
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from peft import LoraConfig, get_peft_model
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp import fully_shard
from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy
from torch.distributed.tensor import DTensor
from transformers import AutoModelForCausalLM, BitsAndBytesConfig

from kit.bench import experiment
from kit.inputs import builtin
from kit.recipe import dist as kdist
from kit.recipe import quantize
from kit.recipe.layers import decoder_layer_classes, decoder_layers
from kit.recipe.recompute import enable_activation_checkpointing


def trainable(model) -> list[torch.nn.Parameter]:
    return [p for p in model.parameters() if p.requires_grad]


# --------------------------------------------------------------------------- the cases


def recipe_order(t):
    """The recipe's order: load, LoRA, checkpointing, train mode, shard, then the optimizer."""
    model = t.load()
    model = t.add_lora(model)
    enable_activation_checkpointing(model)
    model.train()
    model = t.shard(model)
    opt = torch.optim.AdamW(trainable(model), lr=t.lr)
    return t.train(model, opt)


def optimizer_first(t):
    """The optimizer built on the LoRA model, then the model sharded."""
    model = t.load()
    model = t.add_lora(model)
    enable_activation_checkpointing(model)
    model.train()
    opt = torch.optim.AdamW(trainable(model), lr=t.lr)
    model = t.shard(model)
    return t.train(model, opt)


def lora_after_shard(t):
    """The base model sharded, then LoRA added to the sharded model."""
    model = t.load()
    model = t.shard(model)
    model = t.add_lora(model)
    enable_activation_checkpointing(model)
    model.train()
    opt = torch.optim.AdamW(trainable(model), lr=t.lr)
    return t.train(model, opt)


def checkpointing_after_shard(t):
    """Activation checkpointing switched on after sharding."""
    model = t.load()
    model = t.add_lora(model)
    model.train()
    model = t.shard(model)
    enable_activation_checkpointing(model)
    opt = torch.optim.AdamW(trainable(model), lr=t.lr)
    return t.train(model, opt)


def no_train_mode(t):
    """No model.train(): the model stays in the eval mode from_pretrained returns."""
    model = t.load()
    model = t.add_lora(model)
    enable_activation_checkpointing(model)
    model = t.shard(model)
    opt = torch.optim.AdamW(trainable(model), lr=t.lr)
    return t.train(model, opt)


def device_map_auto(t):
    """Every rank loads with device_map="auto", as a one-process script would."""
    model = t.load(device_map="auto")
    model = t.add_lora(model)
    enable_activation_checkpointing(model)
    model.train()
    model = t.shard(model)
    opt = torch.optim.AdamW(trainable(model), lr=t.lr)
    return t.train(model, opt)


# (function, engine, base): "nf4" is the recipe's 4-bit base; "bf16" the same model unquantized.
RUNS = [
    ("recipe_order", "fsdp2", "nf4"), ("recipe_order", "fsdp1", "nf4"),
    ("optimizer_first", "fsdp2", "nf4"), ("optimizer_first", "fsdp1", "nf4"),
    ("lora_after_shard", "fsdp2", "nf4"), ("lora_after_shard", "fsdp1", "nf4"),
    ("lora_after_shard", "fsdp2", "bf16"), ("recipe_order", "fsdp2", "bf16"),
    ("checkpointing_after_shard", "fsdp2", "nf4"), ("checkpointing_after_shard", "fsdp1", "nf4"),
    ("no_train_mode", "fsdp2", "nf4"), ("no_train_mode", "fsdp1", "nf4"),
    ("device_map_auto", "fsdp2", "nf4"), ("device_map_auto", "fsdp1", "nf4"),
]  # fmt: skip


# --------------------------------------------------------------------------- what they share


@dataclass
class Trial:
    """One case on this rank: the pieces every case uses, and what they measured (`notes`)."""

    cfg: object  # the launch's kit Config: model, seed, lr, steps, device
    env: kdist.DistEnv
    engine: str  # fsdp2 | fsdp1
    base: str  # nf4 | bf16
    notes: dict = field(default_factory=dict)

    @property
    def lr(self) -> float:
        return self.cfg.training.lr

    def load(self, device_map=None):
        """from_pretrained as the articles write it: NF4 with bf16 compute and storage (or bf16
        weights), each rank onto its own device unless `device_map` says otherwise."""
        quantization = BitsAndBytesConfig(
            load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
            bnb_4bit_compute_dtype=torch.bfloat16, bnb_4bit_quant_storage=torch.bfloat16,
        ) if self.base == "nf4" else None  # fmt: skip
        with _info_logged("transformers.modeling_utils") as said:
            model = AutoModelForCausalLM.from_pretrained(
                builtin.resolve(self.cfg.model.name), dtype=torch.bfloat16,
                quantization_config=quantization, device_map=device_map or {"": self.env.device},
            )  # fmt: skip
        quantize.keep_packing(model)  # no CPU-only repacking of 4-bit weights (kit.recipe.quantize)
        self.notes.update(
            placed=sorted({str(p.device) for p in model.parameters()}),
            device_map=_plain(getattr(model, "hf_device_map", None)),
            accelerate_hooks=sum(hasattr(m, "_hf_hook") for m in model.modules()),
            transformers_info=[line for line in said if "device_map" in line],
        )
        return model

    def add_lora(self, model):
        """get_peft_model: LoRA r=8 on q_proj and v_proj (dropout 0.05, the kit's default), the
        adapters cast to bf16 (FSDP1 flattens one dtype per unit; FSDP2 gets the same, so that
        the engines compare)."""
        torch.manual_seed(self.cfg.training.seed)  # the same adapters on every rank
        config = LoraConfig(r=8, lora_alpha=16, lora_dropout=0.05,
                            target_modules=["q_proj", "v_proj"])  # fmt: skip
        model = get_peft_model(model, config)
        for p in trainable(model):
            p.data = p.data.to(torch.bfloat16)
        lora = [p for name, p in model.named_parameters() if ".lora_" in name]
        self.notes.update(lora_tensors=len(lora), lora_trainable=sum(p.requires_grad for p in lora))
        return model

    def shard(self, model):
        """FSDP2: fully_shard each decoder layer, then the root. FSDP1: one FlatParameter per
        decoder layer, with use_orig_params=True (LoRA needs it: notebook 11)."""
        if self.engine == "fsdp2":
            for layer in decoder_layers(model):
                fully_shard(layer)
            return fully_shard(model)
        each_layer = functools.partial(transformer_auto_wrap_policy,
                                       transformer_layer_cls=decoder_layer_classes(model))
        self.weights_on_own_devices(model)  # else one rank raises below, the others wait forever
        return FSDP(model, auto_wrap_policy=each_layer, device_id=self.env.device,
                    use_orig_params=True)

    def weights_on_own_devices(self, model):
        """FSDP1 raises on a rank whose weights are not on its `device_id` (`Inconsistent compute
        device`), and only there: on 2 GPUs with `device_map="auto"` rank 0 raised while rank 1
        went on into FSDP's first collective and waited for it until stopped
        (benchmarks/records/2026-11-26-notebooks-moe-235b-scale-4xh100). Every rank checks every rank's placement first,
        so that all of them raise the same error together."""
        mine = (str(self.env.device), sorted({str(p.device) for p in model.parameters()}))
        every = [None] * self.env.world_size
        dist.all_gather_object(every, mine)
        off = [f"rank {r}'s on {', '.join(placed)} (its device_id {own})"
               for r, (own, placed) in enumerate(every) if placed != [own]]
        if off:
            raise ValueError(f"weights off their rank's device: {'; '.join(off)}: FSDP1 raises "
                             f"there and the other ranks wait in its first collective")

    def train(self, model, opt) -> dict:
        """cfg.training.steps AdamW steps on this rank's own fixed batch; measures step 1 (each
        decoder layer's forwards, the bytes autograd kept for backward) and what the steps
        changed."""
        vocab = model.get_input_embeddings().num_embeddings
        rows = torch.Generator().manual_seed(self.cfg.training.seed + self.env.rank)
        ids = torch.randint(3, vocab, (2, 32), generator=rows).to(self.env.device)
        layers = decoder_layers(model)
        held = {id(p) for group in opt.param_groups for p in group["params"]}
        dropouts = [m for name, m in model.named_modules()
                    if ".lora_dropout." in name and isinstance(m, torch.nn.Dropout)]  # fmt: skip
        self.notes.update(
            optimizer_holds=sum(id(p) in held for p in trainable(model)),
            optimizer_tensors=len(held),
            trainable=len(trainable(model)),
            layers_in_train_mode=sum(layer.training for layer in layers), layers=len(layers),
            lora_dropout_active=sum(m.training for m in dropouts), lora_dropouts=len(dropouts),
        )  # fmt: skip
        losses = []
        for step in range(self.cfg.training.steps):
            if step == 0:
                loss = _first_step(model, ids, layers, self.notes)
                self.notes["optimizer_with_grad"] = sum(
                    p.grad is not None for group in opt.param_groups for p in group["params"])
            else:
                loss = model(input_ids=ids, labels=ids).loss
                loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        self.notes["losses"] = losses
        self.notes.update(_adapters(model, self.engine))
        return self.notes


@contextlib.contextmanager
def _info_logged(name: str):
    """The messages logger `name` emits at info level and above meanwhile (transformers logs at
    warning level by default: its info lines are seen by nobody)."""
    said: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record):
            said.append(record.getMessage())

    logger, keep = logging.getLogger(name), Keep(logging.INFO)
    level = logger.level
    logger.setLevel(logging.INFO)
    logger.addHandler(keep)
    try:
        yield said
    finally:
        logger.removeHandler(keep)
        logger.setLevel(level)


def _first_step(model, ids, layers, notes: dict):
    """Forward and backward, measured: each decoder layer's forwards (a checkpointed layer runs
    again in backward; transformers recomputes its forward, not its hooks, so a hook on its first
    child counts both) and the bytes that autograd holds for backward once forward is done
    (each storage once, at its size then: a weight FSDP freed after forward counts 0)."""
    calls, kept = [], {}

    def keep(t):
        storage = t.untyped_storage()
        kept[storage._cdata] = storage  # alive until backward: the graph holds it
        return t

    hooks = [next(layer.children()).register_forward_hook(lambda *a: calls.append(1))
             for layer in layers]  # fmt: skip
    try:
        with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
            loss = model(input_ids=ids, labels=ids).loss
        notes["bytes_kept"] = sum(s.nbytes() for s in kept.values())
        kept.clear()
        loss.backward()
    finally:
        for hook in hooks:
            hook.remove()
    notes["layer_forwards"] = len(calls)
    return loss


def _adapters(model, engine: str) -> dict:
    """Whether the LoRA tensors are sharded (DTensors) and, under FSDP2, equal on every rank
    (a collective). FSDP1's views are this rank's piece of a flat buffer: not compared."""
    lora = [p for name, p in model.named_parameters() if ".lora_" in name]
    out = {"lora_sharded": sum(isinstance(p, DTensor) for p in lora)}
    if engine == "fsdp2" and lora:
        whole = torch.cat([(p.full_tensor() if isinstance(p, DTensor) else p).detach().float()
                           .flatten() for p in lora])  # fmt: skip
        every = [torch.empty_like(whole) for _ in range(dist.get_world_size())]
        dist.all_gather(every, whole)
        out["ranks_differ_by"] = max((e - every[0]).abs().max().item() for e in every)
    return out


def _plain(value):
    return None if value is None else {k: str(v) for k, v in value.items()}


# --------------------------------------------------------------------------- running them


VERSIONS = {name: importlib.metadata.version(name)
            for name in ("torch", "transformers", "peft", "bitsandbytes")}  # fmt: skip


def run_one(cfg, env, function: str, engine: str, base: str, notes: dict | None = None) -> dict:
    """One run on this rank: what it measured, with ok and error (an exception is raised; the
    harness records it)."""
    trial = Trial(cfg, env, engine, base, {} if notes is None else notes)
    torch.manual_seed(cfg.training.seed)
    globals()[function](trial)
    return {"ok": True, "error": "", **trial.notes}


def _case(function: str, engine: str, base: str):
    def run(case: experiment.Case) -> dict:
        try:
            return run_one(case.cfg, case.env, function, engine, base, case.notes)
        finally:
            gc.collect()

    return run


def _row(case: experiment.Case, got: dict | None, error: str, trace: str) -> dict:
    """Rank 0's record of a run: which, where, how long, then what it measured (or the error and
    what it measured before)."""
    function, engine, base = case.name.split("-")
    if trace:
        print(trace, file=sys.stderr, flush=True)
    return {"index": case.index, "function": function, "engine": engine, "base": base,
            "device": str(case.env.device), "ranks": case.env.world_size, "versions": VERSIONS,
            "seconds": round(case.seconds, 2), "ok": not error, "error": error[:300],
            **case.notes}  # fmt: skip


EXPERIMENT = experiment.Experiment(
    prog="kit.lab.order_rank", doc=__doc__,
    cases={"-".join(run): _case(*run) for run in RUNS},
    row_path=lambda out, name, rank: out / "cases" / f"{name}.json",
    row=_row, writers="main", failures="record",
)

if __name__ == "__main__":
    kdist.leave(experiment.main(EXPERIMENT))
