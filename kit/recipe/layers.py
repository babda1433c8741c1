"""What a decoder layer is, for every stage that acts per layer: FSDP's wrapping unit
(kit.lab.sharding), what is recomputed and what is compiled (kit.recipe.recompute).

One definition: the classes the model itself names in `_no_split_modules` (what transformers
refuses to split across devices), so any causal LM works without naming LlamaDecoderLayer
anywhere, and sharding and recomputation can never disagree about a custom model's layers.
"""

from __future__ import annotations

from torch import nn


def decoder_layer_classes(model: nn.Module) -> set[type]:
    names: set[str] = set()
    for m in model.modules():
        names.update(getattr(m, "_no_split_modules", None) or [])
    # By the class's own name or a base's: FSDP2 swaps each sharded layer's class for a subclass
    # (FSDPLlamaDecoderLayer), which must still count as the layer it is.
    classes = {cls for m in model.modules() for cls in type(m).__mro__ if cls.__name__ in names}
    if not classes:
        raise ValueError(
            f"model.name: {type(model).__name__} declares no _no_split_modules found in it; "
            "the kit cannot tell its decoder layers apart"
        )
    return classes


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The model's decoder layers, in order (through any wrapper: PEFT, FSDP, checkpointing)."""
    classes = tuple(decoder_layer_classes(model))
    return [m for m in model.modules() if isinstance(m, classes)]
