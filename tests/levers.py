"""Helpers the lever tests share: the tiny model in float32, and what autograd keeps for backward."""

import torch
from transformers import AutoModelForCausalLM

from kit.inputs import builtin


def tiny_model():
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_pretrained(builtin.resolve("kit:tiny-llama"), dtype=torch.float32)


def saved_bytes(fn, exclude=frozenset()) -> tuple:
    """(fn's result, bytes autograd keeps for backward while fn runs): distinct storages, less
    those whose data pointers are in `exclude`."""
    seen = {}

    def pack(t):
        if t.untyped_storage().data_ptr() not in exclude:
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return out, sum(seen.values())


def kept_by(model, ids) -> int:
    """Bytes autograd keeps in one forward of `model` on `ids` (its loss), its weights not counted."""
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
    return saved_bytes(lambda: model(input_ids=ids, labels=ids, use_cache=False).loss, weights)[1]
