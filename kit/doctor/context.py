"""What the doctor looks at before a run: the machine (env), the config tree, the model's shape.

The config may be a kit Config, a dict tree (possibly one load_config would reject), a kit YAML
or an `accelerate config` YAML; all become one merged tree (defaults + given values) that the
checks read through `Context`. The model is built on the meta device: names and parameter
counts, no weights, no download.
"""

from __future__ import annotations

import copy
import functools
import importlib.util
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

from kit.config import BUNDLED, Config, ConfigError, apply_overrides, read_yaml
from kit.findings import Finding


def complete_env(env: dict | None) -> dict:
    """A caller's env dict with the keys it left out: no GPUs, RAM unknown, 2 ranks; None: this
    machine (kit.budget.machine.probe)."""
    if env is None:
        from kit.budget import machine

        return machine.probe()
    gpus = list(env.get("gpus") or [])
    full = {
        "vars": {},
        "gpus": gpus,
        "host_ram_gib": None,
        "nproc_per_node": len(gpus) or 2,
        "nnodes": 1,
        "packages": {"flash_attn": False},
    }
    full.update({k: v for k, v in env.items() if v is not None})
    return full


def _merge(base: dict, over: dict) -> dict:
    out = copy.deepcopy(base)
    for k, v in over.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def lookup(tree: dict, key: str, default=None):
    node = tree
    for part in key.split("."):
        if not isinstance(node, dict) or part not in node:
            return default
        node = node[part]
    return node


def from_accelerate(acc: dict) -> dict:
    """An `accelerate config` YAML (the second article's fsdp_config.yaml) as a kit tree, so the
    same checks apply; the keys no kit field has go under `accelerate`."""
    fsdp = acc.get("fsdp_config") or {}
    kind = str(acc.get("distributed_type", "NO")).upper()
    strategy = fsdp.get("fsdp_sharding_strategy", "FULL_SHARD")
    strategies = {1: "FULL_SHARD", 2: "SHARD_GRAD_OP", 3: "NO_SHARD", 4: "HYBRID_SHARD"}
    mp = {"bf16": "bfloat16", "fp16": "float16"}.get(str(acc.get("mixed_precision")), "float32")
    tree = {
        "model": {"dtype": mp},
        "sharding": {
            "engine": ("fsdp2" if str(fsdp.get("fsdp_version")) == "2" else "fsdp1")
            if kind == "FSDP"
            else "ddp",
            "strategy": strategies.get(strategy, str(strategy).upper()),
            "use_orig_params": bool(fsdp.get("fsdp_use_orig_params", False)),
            "cpu_offload": bool(fsdp.get("fsdp_offload_params", False)),
            "sync_module_states": bool(fsdp.get("fsdp_sync_module_states", False)),
        },
        "accelerate": {
            "distributed_type": kind,
            "use_cpu": bool(acc.get("use_cpu", False)),
            "cpu_ram_efficient_loading": bool(fsdp.get("fsdp_cpu_ram_efficient_loading", False)),
            "num_processes": int(acc.get("num_processes", 1) or 1),
            "num_machines": int(acc.get("num_machines", 1) or 1),
        },
    }
    if "fsdp_activation_checkpointing" in fsdp:
        tree["training"] = {"recompute": {"enabled": bool(fsdp["fsdp_activation_checkpointing"])}}
    return tree


def read_config(cfg, overrides: list[str] | None = None) -> tuple[dict | None, list[Finding]]:
    """(raw tree, findings) from a Config, a dict tree, or a YAML path (kit or accelerate)."""
    if isinstance(cfg, Config):
        tree = cfg.to_dict()
    elif isinstance(cfg, dict):
        tree = copy.deepcopy(cfg)
    else:
        path = Path(cfg)
        if not path.exists() and (BUNDLED / f"{cfg}.yaml").is_file():  # tiny-cpu: kit/configs/
            path = BUNDLED / f"{cfg}.yaml"
        if not path.is_file():
            msg = f"config file {str(path)!r} does not exist"
            return None, [Finding("error", "config_missing", msg, "give the path of a YAML file, "
                                  "or a bundled config's name")]
        try:
            tree = read_yaml(path)  # a syntax error names the file, line and column
        except ConfigError as e:
            return None, [Finding("error", "config_invalid", str(e), "fix the YAML syntax")]
    if not isinstance(tree, dict):
        msg = f"config: {tree!r} is not a mapping"
        return None, [Finding("error", "config_invalid", msg, "give a YAML mapping of sections")]
    if "distributed_type" in tree or "fsdp_config" in tree:
        tree = from_accelerate(tree)
    try:
        apply_overrides(tree, overrides)
    except ConfigError as e:
        return None, [Finding("error", "config_invalid", str(e), "write key=value overrides")]
    return tree, []


# Architectures whose decoder layers have Llama's linears (q/k/v/o, gate/up/down): kit.budget.shapes'
# Shape counts their parameters from the config alone, without importing torch.
LLAMA_LIKE = {"llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2"}


@dataclass(frozen=True)
class ModelParts:
    """What the checks count of a model without its weights: its parameters, the linear ones
    bitsandbytes quantizes, its modules' names (built on the meta device, on demand). What the
    model allows (attention, the fused loss) is kit.inputs.sources.model_facts."""

    name: str
    trust_remote_code: bool
    config: dict  # the transformers config, as a dict (kit.budget.shapes reads it too)
    params: int
    linear_4bit_params: int  # what bitsandbytes quantizes: every Linear but the output head

    @functools.cached_property
    def modules(self) -> dict[str, str]:
        """Full module name -> class name, from the model built on the meta device."""
        return {n: type(m).__name__ for n, m in _meta_model(self).named_modules() if n}

    def linear_names(self) -> list[str]:
        return sorted({n.rsplit(".", 1)[-1] for n, c in self.modules.items() if c == "Linear"})

    def host_bytes(self, dtype: str, quantized: bool) -> float:
        """Bytes of the loaded model: 4-bit linears at ~0.53 B/param (+ scales), rest in dtype."""
        size = 4 if dtype == "float32" else 2
        if not quantized:
            return self.params * size
        return self.linear_4bit_params * 0.53 + (self.params - self.linear_4bit_params) * size


def _meta_model(facts: ModelParts):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = dict(facts.config)
    config = AutoConfig.for_model(config.pop("model_type"), **config)
    with torch.device("meta"):  # shapes only: no memory, no weights
        return AutoModelForCausalLM.from_config(config, trust_remote_code=facts.trust_remote_code)


@functools.lru_cache(maxsize=8)
def model_parts(name: str, trust_remote_code: bool = False) -> ModelParts:
    """Parameter counts (and, on demand, module names) of model.name from its config.json
    (kit.inputs.sources.model_config), without weights. Raises ValueError when none is at hand."""
    from kit.inputs.sources import model_config

    config = model_config(name)
    if config is None:
        raise ValueError(f"no config.json of {name!r} at hand (a hub id is read from the local "
                         "cache only)")
    facts = ModelParts(name, trust_remote_code, config, 0, 0)
    if config.get("model_type") in LLAMA_LIKE and importlib.util.find_spec("kit.budget.shapes"):
        from kit.budget.shapes import shape_of

        shape = shape_of(config)
        params, linear = shape.params, shape.layers * shape.layer_linear_params
    else:
        import torch

        model = _meta_model(facts)
        head = model.get_output_embeddings()
        params = sum(p.numel() for p in model.parameters())
        linear = sum(
            m.weight.numel()
            for m in model.modules()
            if isinstance(m, torch.nn.Linear) and m is not head
        )
    return ModelParts(name, trust_remote_code, config, params, linear)


class Context:
    """What every check sees: the merged tree (defaults + raw), the raw tree, env, device."""

    def __init__(self, raw: dict, env: dict, planned=None):
        self.raw, self.env = raw, env
        self.given_plan = planned  # the start's plan (kit.run.check.check), or its refusal
        self.tree = _merge(Config().to_dict(), {k: v for k, v in raw.items() if k != "accelerate"})
        self.accelerate = raw.get("accelerate")
        wants = self.get("training.device")
        self.device = "cuda" if wants == "cuda" or (wants == "auto" and env["gpus"]) else "cpu"
        self.ranks = int(env["nproc_per_node"]) * int(env["nnodes"])
        if self.accelerate:
            n = self.accelerate["num_machines"]
            self.ranks = self.accelerate["num_processes"]
            env["nproc_per_node"] = max(1, self.ranks // n)
        self.facts_error = ""

    def get(self, key: str):
        return lookup(self.tree, key)

    @property
    def quantized(self) -> bool:
        return self.get("quantization.method") != "none"

    @property
    def fsdp1(self) -> bool:
        return self.get("sharding.engine") == "fsdp1"

    @functools.cached_property
    def facts(self) -> ModelParts | None:
        if self.accelerate:  # an accelerate config names no model
            return None
        try:
            return model_parts(
                str(self.get("model.name")), bool(self.get("model.trust_remote_code"))
            )
        except Exception as e:  # noqa: BLE001 - any failure means: cannot inspect this model
            self.facts_error = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
            return None

    def planned(self):
        """The plan (kit.budget.plan) of a config with values left at auto on these GPUs: the
        start's own where it planned (kit.run.check.check), else planned here; None when nothing
        is left to plan (or the config is refused elsewhere); a Finding when it cannot be planned
        here or does not fit."""
        from kit.budget import machine
        from kit.budget import plan as kplan
        from kit.config import ConfigError, config_from_dict

        if self.given_plan is not None:
            return self.given_plan
        try:
            cfg = config_from_dict(self.tree)
        except ConfigError:
            return None
        if kplan.is_planned(cfg):
            return None
        if cfg.data.max_seq_len == "auto":
            return Finding("info", "memory_planned_at_start", "data.max_seq_len=auto: the batch and "
                           "recompute policy are planned when the run starts, from the data's rows "
                           "(`kit plan CONFIG` shows the plan now)",
                           "data.max_seq_len=<tokens> to check the memory here", "data.max_seq_len")
        try:
            return kplan.plan(cfg, machine.for_plan(self.env, self.ranks, "cuda"),
                              cfg.data.max_seq_len, self.facts.config)
        except ConfigError as e:
            return refused_plan(e)


def refused_plan(e: Exception) -> Finding:
    """The planner's refusal (nothing fits the GPUs) as the pre-flight's finding."""
    return Finding("error", "memory_over_gpu", str(e), str(e).rsplit(": ", 1)[-1],
                   "training.batch_size")


def namespace(tree: dict):
    """A dict tree with attribute access, as kit.budget.estimate.Setup.from_config reads a Config."""
    return SimpleNamespace(
        **{k: namespace(v) if isinstance(v, dict) else v for k, v in tree.items()}
    )
