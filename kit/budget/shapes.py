"""A decoder-only model's shape, and what follows from it by counting: parameters, LoRA's
trainable parameters, model FLOPs per token. No weights, no torch.

    shape = shape_of("kit:llama-8b")         # or a config dict, a folder, a transformers config
    shape.params, lora_params(shape, r=16), flops_per_token(shape, seq=2048)

Kernel side: imports no torch. Read by the memory estimate (kit.budget.estimate), the LoRA table
(kit.recipe.lora), the doctor's model facts and the benchmarks' MFU (kit.bench.worker, notebook 09).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Shape:
    """What the budget needs to know about a decoder-only transformer."""

    vocab: int
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    tied_embeddings: bool = False
    # A mixture of experts (every layer's MLP routed; 0: dense): `intermediate` is then what one
    # token's active experts span (active x expert_intermediate), for the activations' estimate.
    experts: int = 0
    active_experts: int = 0
    expert_intermediate: int = 0
    # Beside the routed experts, a dense MLP every token passes (shared experts, this wide in all:
    # 0 for none), and the first layers whose MLP is dense (DeepSeek's first_k_dense_replace,
    # Qwen's mlp_only_layers), dense_intermediate wide. The per-layer views (linears, the
    # estimate's bytes, the adapters) count every layer as a routed one: a few layers over.
    shared_intermediate: int = 0
    dense_layers: int = 0
    dense_intermediate: int = 0

    def linears(self) -> dict[str, tuple[int, int]]:
        """(in_features, out_features) of each linear layer in one decoder layer (Llama family);
        a mixture of experts: attention and the shared experts' MLP (its routed experts:
        expert_stacks)."""
        h, q, kv, i = self.hidden, self.heads * self.head_dim, self.kv_heads * self.head_dim, self.intermediate
        attention = {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h)}
        if self.experts:
            s = self.shared_intermediate
            shared = {"shared_expert.gate_proj": (h, s), "shared_expert.up_proj": (h, s),
                      "shared_expert.down_proj": (s, h)}
            return {**attention, **shared} if s else attention
        return {**attention, "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}

    def expert_stacks(self) -> dict[str, tuple[int, int]]:
        """(in, out) of one expert's matrices in each fused stack of a MoE layer (transformers'
        gate_up_proj and down_proj; kit.recipe.experts stores them in 4 bits)."""
        h, i = self.hidden, self.expert_intermediate
        return {"gate_up_proj": (h, 2 * i), "down_proj": (i, h)} if self.experts else {}

    @property
    def router_params(self) -> int:
        """The router's (experts x hidden) per layer: kept in the model dtype, frozen."""
        return self.experts * self.hidden

    @property
    def layer_linear_params(self) -> int:
        """The matrices of one decoder layer that are stored in 4 bits: linears and experts."""
        experts = self.experts * sum(a * b for a, b in self.expert_stacks().values())
        return sum(a * b for a, b in self.linears().values()) + experts

    @property
    def active_layer_params(self) -> int:
        """What one token multiplies through in a decoder layer: all of a dense one; attention,
        the router and its active experts in a mixture of experts."""
        if not self.experts:
            return self.layer_linear_params
        active = self.active_experts * sum(a * b for a, b in self.expert_stacks().values())
        return sum(a * b for a, b in self.linears().values()) + active + self.router_params

    @property
    def dense_layer_params(self) -> int:
        """The matrices of one of a mixture of experts' dense first layers."""
        attention = {k: v for k, v in self.linears().items() if not k.startswith("shared_")}
        return sum(a * b for a, b in attention.values()) + 3 * self.hidden * self.dense_intermediate

    @property
    def active_linear_params(self) -> int:
        """What one token multiplies through in all decoder layers."""
        routed = self.layers - self.dense_layers
        return routed * self.active_layer_params + self.dense_layers * self.dense_layer_params

    @property
    def active_params(self) -> int:
        return self.active_linear_params + self.embedding_params + self.norm_params

    @property
    def embedding_params(self) -> int:
        """Input embedding plus output head (one matrix when tied)."""
        return self.vocab * self.hidden * (1 if self.tied_embeddings else 2)

    @property
    def norm_params(self) -> int:
        return (2 * self.layers + 1) * self.hidden

    @property
    def params(self) -> int:
        routed = self.layers - self.dense_layers
        return (routed * (self.layer_linear_params + self.router_params)
                + self.dense_layers * self.dense_layer_params
                + self.embedding_params + self.norm_params)


# The names config.json gives one quantity under (transformers' attribute_map aliases, read here
# without transformers: DeepSeek's and GLM-4.5's n_routed_experts, ERNIE's moe_num_experts and
# moe_k, Bailing's num_experts_per_token); Nemotron-H gives its depth as layers_block_type.
EXPERT_COUNT = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")
ACTIVE_EXPERTS = ("num_experts_per_tok", "num_experts_per_token", "moe_k")
SHARED_EXPERTS = ("n_shared_experts", "num_shared_experts", "moe_num_shared_experts")


def _first(model: dict, names: tuple[str, ...]) -> int:
    return next((model[n] for n in names if model.get(n)), 0)


def shape_of(model) -> Shape:
    """A Shape from a Shape, a `kit:` name, a config dict, a transformers config or a folder."""
    if isinstance(model, Shape):
        return model
    if isinstance(model, str) and model.startswith("kit:"):
        from kit.inputs.builtin import SPECS

        if model[4:] not in SPECS:
            raise ValueError(f"model: {model!r} is not a kit model; allowed: kit:{', kit:'.join(SPECS)}")
        model = SPECS[model[4:]]
    elif isinstance(model, (str, Path)):
        path = Path(model).expanduser() / "config.json"
        if path.is_file():
            model = json.loads(path.read_text())
        else:  # a hub id: transformers reads config.json (from its cache when offline)
            from transformers import AutoConfig

            model = AutoConfig.from_pretrained(str(model))
    if not isinstance(model, dict):
        model = model.to_dict()
    model = model.get("text_config", model)  # multimodal configs nest the language model
    heads = model["num_attention_heads"]
    experts = _first(model, EXPERT_COUNT)
    dense_i = model.get("intermediate_size") or model.get("moe_intermediate_size")
    expert_i = (model.get("moe_intermediate_size") or dense_i) if experts else 0
    active = _first(model, ACTIVE_EXPERTS) if experts else 0
    layers = model.get("num_hidden_layers") or len(model.get("layers_block_type") or [])
    if not (dense_i and layers):
        raise KeyError("intermediate_size" if not dense_i else "num_hidden_layers")
    # shared experts: Qwen's one shared MLP of its own width, DeepSeek's n of the experts' width
    shared = (model.get("shared_expert_intermediate_size") or _first(model, SHARED_EXPERTS) * expert_i
              if experts else 0)  # fmt: skip
    dense_layers = (model.get("first_k_dense_replace") or len(model.get("mlp_only_layers") or [])
                    if experts else 0)  # fmt: skip
    return Shape(
        vocab=model["vocab_size"],
        hidden=model["hidden_size"],
        intermediate=active * expert_i if experts else dense_i,
        experts=experts, active_experts=active, expert_intermediate=expert_i,
        shared_intermediate=shared, dense_layers=min(dense_layers, layers),
        dense_intermediate=model.get("intermediate_size") or 0 if dense_layers else 0,
        layers=layers,
        heads=heads,
        kv_heads=model.get("num_key_value_heads") or heads,
        head_dim=model.get("head_dim") or model["hidden_size"] // heads,
        tied_embeddings=bool(model.get("tie_word_embeddings", False)),
    )


def lora_targets(shape: Shape, targets) -> dict[str, tuple[int, int]]:
    """The linear layers of one decoder layer that get an adapter."""
    linears = shape.linears()
    if targets == "all-linear":  # in a mixture of experts, every expert stack too (not the router)
        return {**linears, **shape.expert_stacks()}
    linears = {**linears, **shape.expert_stacks()}
    names = [targets] if isinstance(targets, str) else list(targets)
    unknown = [n for n in names if n not in linears]
    if unknown:
        raise ValueError(f"lora_targets: {unknown} not among {', '.join(linears)}")
    return {n: linears[n] for n in names}


# Linear layers of one decoder layer that read the same input (kit.recipe.levers.lora_groups groups their
# adapters under lora.group_inputs).
SHARED_INPUT_GROUPS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))
NO_SHARED_INPUT = ("lora.group_inputs: True is not allowed for this model; it has no adapted "
                   "projections named " + " or ".join("/".join(g) for g in SHARED_INPUT_GROUPS)
                   + " that share an input; allowed: false")  # the doctor's and the ranks' line


def shared_input_groups(adapted: list[str]) -> list[tuple[str, ...]]:
    """The groups of SHARED_INPUT_GROUPS whose every member is among `adapted` (full module
    names), under one parent: what lora.group_inputs can group in such a model."""
    have = set(adapted)
    parents = dict.fromkeys(n.rpartition(".")[0] for n in adapted)
    return [tuple(f"{p}.{m}" if p else m for m in g) for p in parents for g in SHARED_INPUT_GROUPS
            if all((f"{p}.{m}" if p else m) in have for m in g)]


def dropped_inputs(shape: Shape, targets, grouped: bool = False) -> dict[str, int]:
    """Per adapted linear layer, the width of the input its adapter drops and keeps a copy of:
    its fan-in (times the active experts for an expert stack), or, with grouped adapters
    (lora.group_inputs), 0 for every member of a fully adapted group but the first (the group
    drops its shared input once)."""
    stacks = shape.expert_stacks()  # a token passes its active experts: a copy for each
    widths = {n: fan_in * (shape.active_experts if n in stacks else 1)
              for n, (fan_in, _) in lora_targets(shape, targets).items()}
    if grouped:
        for group in SHARED_INPUT_GROUPS:
            if all(n in widths for n in group):
                widths.update(dict.fromkeys(group[1:], 0))
    return widths


def lora_params(shape: Shape, r: int, targets="all-linear") -> int:
    """Trainable LoRA parameters: A (r x in) and B (out x r) per targeted linear, every layer;
    per expert for an expert stack (PEFT's ParamWrapper: A (r*E x in), B (out x r*E))."""
    stacks = shape.expert_stacks()
    return shape.layers * sum(r * (a + b) * (shape.experts if n in stacks else 1)
                              for n, (a, b) in lora_targets(shape, targets).items())


def flops_per_token(shape: Shape, seq: int) -> float:
    """Model FLOPs per trained token for LoRA: forward (2N) + input gradients (2N) through the
    frozen linear layers and the output head, attention's matmuls forward and backward (causal),
    no recompute counted (checkpointing's extra forward is overhead, not model work). Frozen
    weights get no gradient; the adapters' own matmuls (r wide) are left out. A mixture of
    experts: from its active parameters (attention, router, the active and shared experts, the
    dense first layers)."""
    linear = shape.active_linear_params + shape.hidden * shape.vocab
    # QK^T and AV, per token, forward: 2 matmuls x 2 FLOPs x seq x width, halved by the mask.
    attention = 2 * seq * (shape.heads * shape.head_dim) * shape.layers
    return 4 * linear + 3 * attention
