"""LoRA adapters with PEFT: which modules get them, how many parameters train, in what dtype.
Notebook 03's instruments (a few training steps in the kernel, the scale conventions side by
side) are kit/lab/lora_adapters.py."""

from __future__ import annotations

import torch

from kit.config import Config, ConfigError
from kit.recipe import engines


def linear_module_names(model) -> list[str]:
    """Distinct names of linear layers (the candidates for target_modules)."""
    import bitsandbytes as bnb

    kinds = (torch.nn.Linear, bnb.nn.Linear4bit)
    return sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, kinds)})


def check_targets(model, targets: str | list[str], model_name: str) -> None:
    """Every name in lora.target_modules matches a module (peft's own matching), or one line
    naming each that does not: PEFT itself only refuses names when none matches, and otherwise
    skips them, training fewer layers without a word. (The doctor's pre-flight says the same.)"""
    if targets == "all-linear":
        return
    from peft import LoraConfig
    from peft.tuners.tuners_utils import check_target_module_exists

    if isinstance(targets, str):  # one regex, matched against whole module names
        configs = {targets: LoraConfig(target_modules=targets)}
    else:
        configs = {t: LoraConfig(target_modules=[t]) for t in targets}
    names = [n for n, _ in model.named_modules() if n]
    unmatched = [t for t, config in configs.items()
                 if not any(check_target_module_exists(config, n) for n in names)]
    if unmatched:
        raise ConfigError(
            f"lora.target_modules: {', '.join(map(repr, unmatched))} "
            f"match{'es' if len(unmatched) == 1 else ''} no module of {model_name}; "
            f"its linear layers: {', '.join(linear_module_names(model))}"
        )


def apply_lora(model, cfg: Config):
    """Wrap `model` with PEFT LoRA per cfg.lora; adapters cast to the dtype the sharding engine
    needs (kit.recipe.engines: float32, or model.dtype under FSDP1, which flattens one dtype per unit)."""
    from peft import LoraConfig, get_peft_model

    from kit.recipe import experts

    lc = cfg.lora
    targets, stacks = lc.target_modules, []
    moe = bool(experts.find(model))
    if moe:  # mixture of experts: expert stacks through PEFT's target_parameters (kit.recipe.experts)
        targets, stacks = experts.split_targets(model, targets)
    if targets is not None:
        check_targets(model, targets, cfg.model.name)
    config = LoraConfig(
        r=lc.r,
        lora_alpha=lc.alpha,
        # PEFT refuses dropout with target_parameters: the kit applies it (below), the file says 0
        lora_dropout=0.0 if stacks else lc.dropout,
        target_modules=targets,
        target_parameters=stacks or None,
        bias="none",
        task_type="CAUSAL_LM",
    )
    with experts.logical_shapes(model):
        peft_model = get_peft_model(model, config)
    if moe:
        _drop_out(peft_model, lc.dropout)
        experts.adapt(peft_model, lc.dropout)
    dtype = engines.get(cfg.sharding.engine).adapter_dtype(cfg)
    for p in peft_model.parameters():
        if p.requires_grad:
            p.data = p.data.to(dtype)
    return peft_model


def _drop_out(peft_model, p: float) -> None:
    """lora.dropout on every lora.Linear input (what PEFT does when its config says so)."""
    from peft.tuners.lora import LoraLayer
    from peft.tuners.lora.layer import ParamWrapper

    for module in peft_model.modules():
        if isinstance(module, LoraLayer) and not isinstance(module, ParamWrapper) and p > 0:
            for name in module.lora_dropout:
                module.lora_dropout[name] = torch.nn.Dropout(p)


def trainable_summary(peft_model) -> dict[str, float]:
    """Trainable vs all parameters, a packed 4-bit weight counted as its logical size (two
    weights per byte of storage). Gap filled: PEFT's get_nb_trainable_parameters counts every
    Params4bit as packed, and one not yet quantized (model.loading=stream: on the meta device
    until the engine fills it) already holds its logical shape, so PEFT counted it 2-4x over."""
    trainable = total = 0
    for p in peft_model.parameters():
        n = p.numel()
        if type(p).__name__ == "Params4bit" and getattr(p, "bnb_quantized", True):
            n *= 2 * p.element_size()
        total += n
        trainable += n if p.requires_grad else 0
    summary = {"trainable": trainable, "total": total, "percent": 100.0 * trainable / max(total, 1)}
    from kit.recipe import experts

    if experts.find(peft_model):  # a mixture of experts: what its expert stacks take
        summary["experts_bytes"] = experts.stored_bytes(peft_model)
    return summary


def recompute_adapters(peft_model) -> int:
    """Keep only each adapter's input for backward (lora.recompute): returns how many layers.

    PEFT's LoRA forward stores, for every adapted linear layer, the dropout mask and the dropped
    copy of its input (3 bytes per input element in bf16), and clones the base layer's output; q,
    k and v each drop the same input separately. Here the branch B(A(dropout(x))) * scale runs under
    torch.utils.checkpoint: backward recomputes it from x (which q, k and v share) with the same
    dropout mask (the RNG state is restored), so the result and gradients are the same and the
    activations lose ~130 MB per decoder layer and 2k-token sequence at the 8B shape. The module
    tree is untouched: adapter keys, saving and merging are PEFT's."""
    import types

    from peft.tuners.lora import LoraLayer

    count = 0
    for module in peft_model.modules():
        if not isinstance(module, LoraLayer) or not hasattr(module, "lora_A"):
            continue
        if type(module).__name__ == "ParamWrapper":  # experts: kit.recipe.experts runs them
            continue
        if getattr(module, "lora_variant", None):
            raise ConfigError("lora.recompute: True is not allowed with DoRA or other LoRA variants; "
                              "allowed: false")
        module.forward = types.MethodType(_recomputed_forward, module)
        count += 1
    return count


def _branch(x, down, up, scale: float, p: float, training: bool) -> torch.Tensor:
    """One adapter's B(A(dropout(x))) * scale, from tensors and numbers only: a module-level
    function, so that torch.compile traces it once for every layer (a closure over each module
    would compile once per module)."""
    x = x.to(down.dtype)
    if p > 0 and training:
        x = torch.nn.functional.dropout(x, p, True)
    return torch.nn.functional.linear(torch.nn.functional.linear(x, down), up) * scale


def _recomputed_forward(self, x, *args, **kwargs):
    from torch.utils.checkpoint import checkpoint

    if self.disable_adapters or self.merged or kwargs.get("adapter_names") is not None:
        return type(self).forward(self, x, *args, **kwargs)
    result = self.base_layer(x, *args, **kwargs)
    for name in self.active_adapters:
        if name not in self.lora_A:
            continue
        drop = self.lora_dropout[name]
        p = drop.p if isinstance(drop, torch.nn.Dropout) else 0.0
        delta = checkpoint(_branch, x, self.lora_A[name].weight, self.lora_B[name].weight,
                           self.scaling[name], p, self.training, use_reentrant=False)
        result = result + delta.to(result.dtype)
    return result


def sample_rows(model: str, seq_len: int = 32) -> tuple[dict, dict]:
    """(train, validation) token rows of the bundled sample text, as the recipe tokenizes them."""
    from transformers import AutoTokenizer

    from kit.config import load_config
    from kit.inputs import builtin
    from kit.recipe import data

    cfg = load_config(None, [f"model.name={model}", f"data.max_seq_len={seq_len}"])
    tokenizer = AutoTokenizer.from_pretrained(builtin.resolve(model))
    train, val = data.build_datasets(cfg.data, tokenizer, cfg.training.seed)
    return train.tensors, val.tensors
