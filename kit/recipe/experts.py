"""Mixture-of-experts layers: the experts stored in NF4, and LoRA on them (rank side).

transformers keeps each MoE layer's experts as fused 3-D parameters (`gate_up_proj` (E, 2I, H),
`down_proj` (E, H, I); gpt_oss transposed, with biases) in a module its `use_experts_implementation`
decorator marks (`has_gate`, `is_transposed`, ...). bitsandbytes' `load_in_4bit` quantizes only
nn.Linear, so the experts, nearly all of an MoE's bytes, would stay in model.dtype. Here:

- storage: each 3-D expert parameter is replaced, right after loading (model.loading=full, rank0)
  or as its unit is filled (stream, initialised at load), by a bitsandbytes Params4bit of the stack
  laid out (E*out, in): the same NF4, double quant, blocksize and float `quant_storage` as the
  kit's Linear4bit weights, so FSDP2 shards it with its decoder layer like any 4-bit weight. The
  quantization state stays on the module (`_kit_nf4`), as Linear4bit keeps its own: FSDP2
  gathers a plain tensor. The router is a small (E, H) parameter, left in model.dtype and frozen:
  4-bit routing logits would move tokens between experts, for a few kB saved per layer.
- forward: grouped (kit.recipe.grouped_experts): the routed rows sorted by expert once per layer,
  each stack dequantized by one call per pass, every expert's projection and LoRA factors as
  grouped GEMMs (`torch._grouped_mm` on Hopper, a loop over the sorted groups elsewhere), same
  routing and gating as transformers (the module's own `_apply_gate`). Nothing of the dequantized
  stack is kept between forward and backward: backward dequantizes it again for the input's
  gradient (the base is frozen). `loop_forward`, transformers' eager loop with
  `bitsandbytes.matmul_4bit` per hit expert, is the reference (model.experts=loop, `choose`).
- LoRA: PEFT's `target_parameters` builds its lora.ParamWrapper modules (one per expert parameter,
  nested), so the adapter's keys, shapes and adapter_config.json are PEFT's own, and plain PEFT
  reloads it on the unquantized base. PEFT computes ParamWrapper by adding B@A to the dense stack
  (a parametrization), which cannot run on packed weights and cannot drop out the input; the
  kit's forward runs the same factors per expert, x A_e^T B_e^T * scale, with lora.dropout on
  the expert's input, as lora.Linear does. adapter_config.json says lora_dropout 0: PEFT refuses
  any other value with target_parameters, and dropout does nothing at inference.

Gaps filled by hand: transformers' experts implementations (eager, batched_mm, grouped_mm) all
read the dense 3-D stack; bitsandbytes has no 4-bit expert stack; PEFT's ParamWrapper reads the
target's shape from the parameter (here packed) and merges into the dense weight in forward.
"""

from __future__ import annotations

import contextlib
import types

import torch

from kit.config import ConfigError
from kit.recipe import grouped_experts


def is_experts(module: torch.nn.Module) -> bool:
    """A transformers experts module (fused 3-D expert weights, `use_experts_implementation`)."""
    return all(hasattr(module, a) for a in ("has_gate", "is_transposed", "num_experts")) and any(
        name in getattr(module, "_kit_nf4", {}) or (p is not None and p.dim() == 3)
        for name, p in module._parameters.items())  # fmt: skip


def find(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """(name, module) of every experts module, PEFT's wrappers left out of the names."""
    return [(n.replace(".base_layer", ""), m) for n, m in model.named_modules() if is_experts(m)]


def weight_names(module: torch.nn.Module) -> list[str]:
    """The module's expert weight stacks (quantized or not): its 3-D parameters."""
    stored = getattr(module, "_kit_nf4", {})
    return [n for n, p in module._parameters.items()
            if n in stored or (p is not None and p.dim() == 3)]  # fmt: skip


def quantize_weight(module: torch.nn.Module, name: str, value: torch.Tensor, kwargs: dict) -> None:
    """Replace module.<name> by `value` (its logical 3-D stack) quantized per `kwargs`
    (kit.recipe.quantize.params4bit_kwargs), on value's device."""
    import bitsandbytes as bnb

    experts, a, b = value.shape
    out, inn = (b, a) if module.is_transposed else (a, b)
    block, storage = kwargs["blocksize"], torch.empty((), dtype=kwargs["quant_storage"])
    if (out * inn) % block or (out * inn) % (2 * storage.element_size()):
        raise ConfigError(f"quantization: the experts' {name} ({out} x {inn} per expert) does not "
                          f"split into {block}-value blocks; allowed: quantization.method=none")
    stack = value.transpose(1, 2) if module.is_transposed else value
    packed = bnb.nn.Params4bit(stack.reshape(experts * out, inn).contiguous(),
                               requires_grad=False, **kwargs).to(value.device)  # quantizes
    if not hasattr(module, "_kit_nf4"):
        module._kit_nf4 = {}
    module._kit_nf4[name] = dict(state=packed.quant_state, shape=tuple(value.shape), out=out)
    module._parameters[name] = packed
    module.forward = types.MethodType(forward, module)


def quantize(model: torch.nn.Module, kwargs: dict) -> int:
    """Quantize every expert stack of `model` that holds values; returns how many."""
    count = 0
    for _, module in find(model):
        for name in weight_names(module):
            p = module._parameters[name]
            if name not in getattr(module, "_kit_nf4", {}) and not p.is_meta:
                quantize_weight(module, name, p.data, kwargs)
                count += 1
    return count


def round_trip(model: torch.nn.Module, kwargs: dict) -> int:
    """Replace every expert stack by its NF4 round trip, dense in the compute dtype: the values
    a run trained against, for plain PEFT to load an adapter onto (kit.inference.merge: inference,
    merging). The experts' own forward is transformers' again. Returns how many stacks."""
    count = 0
    for _, module in find(model):
        for name in weight_names(module):
            if name not in getattr(module, "_kit_nf4", {}):
                quantize_weight(module, name, module._parameters[name].data, kwargs)
            module._parameters[name] = torch.nn.Parameter(dequantized(module, name),
                                                          requires_grad=False)
            count += 1
        del module._kit_nf4, module.forward  # the class's forward (transformers') again
    return count


def dequantized(module: torch.nn.Module, name: str) -> torch.Tensor:
    """module.<name> as its logical 3-D stack in the compute dtype (the packed one restored)."""
    import bitsandbytes.functional as F

    stored = module._kit_nf4[name]
    packed = getattr(module, name)
    packed = packed.full_tensor() if hasattr(packed, "full_tensor") else packed
    flat = F.dequantize_4bit(packed.reshape(-1, 1), stored["state"])
    experts, a, b = stored["shape"]
    stack = flat.reshape(experts, stored["out"], -1)
    return stack.transpose(1, 2).contiguous() if module.is_transposed else stack


def stored_bytes(model: torch.nn.Module) -> dict[str, int]:
    """{"packed": bytes of the quantized expert stacks (this rank's shards once sharded; a stack
    still on the meta device, to be quantized as it is streamed in, as it will be),
    "state": of their quantization constants (scales, whole on every rank), "dense": of the
    stacks still in model dtype, "logical_bf16": what all of them would take in bf16}."""
    sizes = {"packed": 0, "state": 0, "dense": 0, "logical_bf16": 0}
    for _, module in find(model):
        stored = getattr(module, "_kit_nf4", {})
        for name in weight_names(module):
            p = module._parameters[name]
            p = p.to_local() if hasattr(p, "to_local") else p
            if p.is_meta and name in getattr(module, "_kit_nf4_pending", ()):
                sizes["packed"] += p.numel() // 2  # model.loading=stream: NF4 once filled
                sizes["logical_bf16"] += 2 * p.numel()
                continue
            kind = "packed" if name in stored else "dense"
            if name in stored:
                state = stored[name]["state"]
                extra = [state.absmax, state.code, *((state.state2.absmax, state.state2.code)
                                                     if state.nested else ())]  # fmt: skip
                sizes["state"] += sum(t.numel() * t.element_size() for t in extra)
            sizes[kind] += p.numel() * p.element_size()
            shape = stored[name]["shape"] if name in stored else tuple(p.shape)
            sizes["logical_bf16"] += 2 * shape[0] * shape[1] * shape[2]
    return sizes


# ---- forward -------------------------------------------------------------------------------------


def forward(self, hidden_states, *args, lora=None, **kwargs):
    """What every experts module runs: grouped, or `loop_forward` (model.experts=loop, `choose`)."""
    run = loop_forward if getattr(self, "_kit_loop", False) else grouped_experts.forward
    return run(self, hidden_states, *args, lora=lora, **kwargs)


def choose(model: torch.nn.Module, how: str) -> int:
    """model.experts on every experts module of `model` ('grouped' or 'loop'); returns how many."""
    for _, m in (found := find(model)):
        m._kit_loop = how == "loop"
    return len(found)


def loop_forward(self, hidden_states, top_k_index=None, top_k_weights=None, router_indices=None,
                 routing_weights=None, lora=None):  # fmt: skip
    """transformers' eager experts loop on the packed stacks, one expert at a time: the reference
    the grouped forward (kit.recipe.grouped_experts, what runs) is tested and timed against. Its
    dropout masks are the grouped forward's (the same seeds; each a function of the flat row)."""
    index = top_k_index if top_k_index is not None else router_indices
    weights = top_k_weights if top_k_weights is not None else routing_weights
    lora = lora or {}
    absmax = {name: _absmax(s["state"]) for name, s in getattr(self, "_kit_nf4", {}).items()}
    final = torch.zeros_like(hidden_states)
    first = "gate_up_proj" if self.has_gate else "up_proj"
    masks = grouped_experts.dropout_masks(lora, (first, "down_proj"), hidden_states.device)
    with torch.no_grad():
        mask = torch.nn.functional.one_hot(index, num_classes=self.num_experts + 1)
        mask = mask.permute(2, 1, 0)
        hit = torch.greater(mask.sum(dim=(-1, -2)), 0).nonzero().flatten().tolist()
    for e in hit:
        if e == self.num_experts:
            continue
        position, token = torch.where(mask[e])
        rows = token * index.shape[1] + position  # the flat rows the masks are asked at
        h = _project(self, first, e, hidden_states[token], absmax, lora, masks, rows)
        h = self._apply_gate(h) if self.has_gate else self.act_fn(h)
        h = _project(self, "down_proj", e, h, absmax, lora, masks, rows)
        if getattr(self, "has_post_expert_norm", False):
            h = self.post_expert_norm(h)
        h = h * weights[token, position, None]
        final.index_add_(0, token, h.to(final.dtype))
    return final


def _absmax(state):
    """The per-block scales as float32 (double quant: the quantized scales restored), so that
    each expert's blocks can be sliced out of them."""
    if not state.nested:
        return state.absmax
    import bitsandbytes.functional as F

    return (F.dequantize_blockwise(state.absmax, state.state2) + state.offset).float()


def _project(self, name, e, x, absmax, lora, masks, rows):
    """Expert e's `name` projection of x: 4-bit base (+ bias) + its LoRA branches."""
    import bitsandbytes as bnb
    from bitsandbytes.functional import QuantState

    stored = getattr(self, "_kit_nf4", {}).get(name)
    if stored is None:  # quantization.method=none: the dense stack
        w = getattr(self, name)[e]
        y = x @ w if self.is_transposed else torch.nn.functional.linear(x, w)
    else:
        state, out = stored["state"], stored["out"]
        inn = state.shape[1]
        packed = getattr(self, name).reshape(-1)
        per = out * inn // (2 * packed.element_size())  # storage elements per expert
        blocks = out * inn // state.blocksize
        expert_state = QuantState(absmax=absmax[name][e * blocks:(e + 1) * blocks],
                                  shape=(out, inn), code=state.code, blocksize=state.blocksize,
                                  quant_type=state.quant_type, dtype=state.dtype)  # fmt: skip
        y = bnb.matmul_4bit(x.to(state.dtype), packed[e * per:(e + 1) * per].reshape(-1, 1).t(),
                            quant_state=expert_state)  # fmt: skip
    bias = getattr(self, f"{name}_bias", None) if getattr(self, "has_bias", False) else None
    if bias is not None:
        y = y + bias[e]
    for (down, up, scale, p), drop in zip(lora.get(name, ()), masks[name], strict=True):
        rank = down.shape[0] // self.num_experts
        a = down.reshape(self.num_experts, rank, -1)[e]  # PEFT's layout (get_delta_factors)
        b = up.reshape(up.shape[0], rank, self.num_experts)[:, :, e]
        dropped = grouped_experts.dropped(x.to(a.dtype), None if drop is None else drop.at(rows), p)
        y = y + (dropped @ a.t() @ b.t() * scale).to(y.dtype)
    return y


# ---- LoRA through PEFT's ParamWrapper ------------------------------------------------------------


def split_targets(model, targets) -> tuple[object, list[str]]:
    """lora.target_modules -> (PEFT's target_modules, target_parameters) for a model with experts.
    all-linear: every linear layer but the output head, the routers (`routers`), the layers
    backward never reaches (`undifferentiated`: sparse-attention indexers) and the linear
    layers whose forward is not a linear map (an nn.Linear subclass with a forward of its own:
    PhiMoE's and Llama 4's routers return a tuple, DeepSeek-V4's grouped output projection is
    block-diagonal: an adapter over the whole input does not fit it), and every expert stack
    (PEFT's own all-linear would take the routers). A list: its names of expert stacks (gate_up_proj,
    down_proj, ...) go to target_parameters, the rest stay module names."""
    import bitsandbytes as bnb

    stacks = sorted({f"{n.rsplit('.', 1)[-1]}.{w}" for n, m in find(model) for w in weight_names(m)})
    if targets == "all-linear":  # by name; a name the head or a router shares: full paths
        plain = (torch.nn.Linear.forward, bnb.nn.Linear4bit.forward)
        left = {id(model.get_output_embeddings()), *map(id, routers(model)),
                *map(id, undifferentiated(model))}
        every = [(n, m) for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
        refused = {k for k in {n.rsplit(".", 1)[-1] for n, _ in every} if peft_refuses(model, k)}
        linear = [(n, id(m) in left or type(m).forward not in plain  # a forward of its own
                   or n.rsplit(".", 1)[-1] in refused) for n, m in every]
        shared = {n.rsplit(".", 1)[-1] for n, out in linear if out}
        return sorted({n if n.rsplit(".", 1)[-1] in shared else n.rsplit(".", 1)[-1]
                       for n, out in linear if not out}), stacks
    if isinstance(targets, str):  # one regex over module names: the experts only if listed
        return targets, []
    chosen = [s for s in stacks if s.rsplit(".", 1)[-1] in targets]
    named = {s.rsplit(".", 1)[-1] for s in chosen}
    return [t for t in targets if t not in named] or None, chosen


def peft_refuses(model: torch.nn.Module, name: str) -> bool:
    """PEFT's own refusal of a LoRA target name for this model (its rule for Mamba-based models:
    a mamba mixer's out_proj and conv1d; NVIDIA's Nemotron-H MoE is one). Asked of PEFT's
    checker, so that the rule stays PEFT's; a PEFT without it refuses nothing here."""
    try:
        from peft import LoraConfig
        from peft.tuners.tuners_utils import _check_lora_target_modules_mamba
    except ImportError:
        return False
    try:
        _check_lora_target_modules_mamba(LoraConfig(), model, name)
    except ValueError:
        return True
    return False


# Sparse-attention indexers (DeepSeek-V3.2's lightning indexer and its kin) whose scores reach the
# model only as the indices of a top-k: backward never reaches their linear layers, so adapters
# there never train (measured: tests/test_families.py, every MoE family's step). Other families'
# indexers (MiniMax-M3, Qwen4's QSA) feed their scores on and do train: not listed.
UNDIFFERENTIATED = ("DeepseekV32Indexer", "GlmMoeDsaIndexer", "HYV4Indexer", "AXK2Indexer",
                    "Dots3NoteTextIndexer")


def undifferentiated(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The linear layers inside an UNDIFFERENTIATED module: all-linear leaves them out."""
    return [m for parent in model.modules() if type(parent).__name__ in UNDIFFERENTIATED
            for m in parent.modules() if isinstance(m, torch.nn.Linear)]


def routers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The linear layers that route tokens: in a block that holds an experts module (its parent),
    outside the experts, one output per expert, and no linear layer beside them reading that
    output (as an MLP's down-projection reads its gate's) (PhiMoE's and Llama 4's routers are nn.Linear
    subclasses returning a tuple, AFMoE's `gate`, Hunyuan's `gate.wg`). Frozen, never adapted:
    LoRA on a router moves tokens between experts, and PEFT's wrapper cannot return a tuple."""
    found = []
    for name, ex in find(model):
        block = model.get_submodule(name.rpartition(".")[0]) if "." in name else model
        inside = {id(m) for m in ex.modules()}
        for sub, m in block.named_modules():
            if not isinstance(m, torch.nn.Linear) or id(m) in inside or m.out_features != ex.num_experts:
                continue
            parent = block.get_submodule(sub.rpartition(".")[0]) if "." in sub else block
            if not any(isinstance(o, torch.nn.Linear) and o is not m and o.in_features == m.out_features
                       for o in parent.children()):  # else an MLP's gate or up projection as wide
                found.append(m)  # as the experts are many (Qwen3-Next's shared expert: 512)
    return found


@contextlib.contextmanager
def logical_shapes(model: torch.nn.Module):
    """While PEFT builds its ParamWrapper modules, each expert stack (packed, or on the meta
    device) is a zero-strided placeholder of its logical shape and dtype: PEFT reads both from the
    parameter, and puts its new adapters on its device (the CPU for one on meta, where
    kit.recipe.loading keeps adapters until their unit is filled)."""
    kept = []
    for _, module in find(model):
        stored = getattr(module, "_kit_nf4", {})
        for name in weight_names(module):
            p = module._parameters[name]
            shape = stored[name]["shape"] if name in stored else tuple(p.shape)
            dtype = stored[name]["state"].dtype if name in stored else p.dtype
            device = torch.device("cpu") if p.is_meta else p.device
            module._parameters[name] = torch.nn.Parameter(
                torch.zeros((), dtype=dtype, device=device).expand(shape), requires_grad=False)
            kept.append((module, name, p))
    try:
        yield
    finally:
        for module, name, p in kept:  # frozen, as PEFT froze the placeholders
            module._parameters[name] = p.requires_grad_(False)


def adapt(peft_model, dropout: float) -> int:
    """Give each outermost ParamWrapper over an experts module the kit's forward (the packed
    experts with its LoRA factors and `dropout`); returns how many."""
    from peft.tuners.lora.layer import ParamWrapper

    count = 0
    for module in peft_model.modules():
        if isinstance(module, ParamWrapper):
            for inner in _chain(module)[1:]:
                inner._kit_inner = True
    for module in peft_model.modules():
        if isinstance(module, ParamWrapper) and not getattr(module, "_kit_inner", False):
            if not is_experts(_chain(module)[-1]):
                raise ConfigError(f"lora.target_modules: PEFT wrapped the parameter "
                                  f"{module.parameter_name!r} of a {type(module.get_base_layer()).__name__}; "
                                  "allowed: linear layers and expert stacks")
            module._kit_dropout = dropout
            module.forward = types.MethodType(adapted_forward, module)
            count += 1
    return count


def _chain(wrapper) -> list[torch.nn.Module]:
    """[wrapper, its nested ParamWrappers ..., the experts module]."""
    from peft.tuners.lora.layer import ParamWrapper

    chain = [wrapper]
    while isinstance(chain[-1], ParamWrapper):
        chain.append(chain[-1].base_layer)
    return chain


def adapted_forward(self, hidden_states, *args, **kwargs):
    """The outermost ParamWrapper's forward: the experts with its chain's LoRA factors."""
    return forward(_chain(self)[-1], hidden_states, *args, lora=lora_factors(self), **kwargs)


def lora_factors(self) -> dict[str, list]:
    """{weight name: [(A, B, scale, dropout p)]} of an outermost ParamWrapper's chain: the
    active adapters, dropout only in training."""
    chain = _chain(self)
    lora: dict[str, list] = {}
    for wrapper in chain[:-1]:
        if wrapper.disable_adapters or wrapper.merged:
            continue
        for name in wrapper.active_adapters:
            if name in wrapper.lora_A:
                lora.setdefault(wrapper.parameter_name, []).append((
                    wrapper.lora_A[name].weight, wrapper.lora_B[name].weight,
                    wrapper.scaling[name], self._kit_dropout if self.training else 0.0))
    return lora
