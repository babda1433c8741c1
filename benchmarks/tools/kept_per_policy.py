"""What a compiled NF4 + LoRA decoder layer keeps for backward under each training.recompute.keeps,
per token and layer, in units of hidden-size values (CPU, float32, a few seconds per policy).

    python3 benchmarks/tools/kept_per_policy.py                       # every policy, and none
    python3 benchmarks/tools/kept_per_policy.py matmuls inputs        # some

The kit model `kit:tiny-llama-8b-ratios` (2 layers, hidden 128, the 8B shape's ratios), built as
the recipe builds it (kit.recipe.model.build: load in NF4 -> LoRA -> recompute per the policy -> loss ->
train mode), then compiled per layer (kit.recipe.recompute.compile_layers). "none" is
training.recompute.enabled=false. Bytes are counted with saved-tensor hooks
(kit.lab.memory.measure_saved_activations) at two sequence lengths; the difference removes what does
not grow with tokens (weights included), and the logits' share (vocabulary / hidden per token,
spread over the layers) is subtracted. Results: benchmarks/records/2026-11-23-profile-8b-1xh100.
"""

import sys

import torch

from kit.config import load_config
from kit.inputs import builtin
from kit.lab import memory
from kit.recipe import model, recompute

T = 256
POLICIES = ["none", *recompute.KEEPS]


def main(policies) -> None:
    spec = builtin.SPECS["tiny-llama-8b-ratios"]
    hidden, layers = spec["hidden_size"], spec["num_hidden_layers"]
    logits = spec["vocab_size"] / hidden / layers
    common = ["model.name=kit:tiny-llama-8b-ratios", "training.device=cpu", "lora.dropout=0.05",
              "lora.r=8", "quantization.method=nf4", "model.dtype=float32"]
    for keeps in policies:
        policy = (["training.recompute.enabled=false"] if keeps == "none"
                  else [f"training.recompute.keeps={keeps}"])
        built = model.build(load_config(None, common + policy), torch.device("cpu"))
        torch._dynamo.reset()
        recompute.compile_layers(built.model)
        longer, shorter = (memory.measure_saved_activations(built.model, 1, n) for n in (T, T // 2))
        per_token_layer = (longer - shorter) / (T // 2) / layers / (4 * hidden) - logits
        print(f"{keeps:<17} {per_token_layer:6.2f} hidden-size values per token and layer",
              flush=True)


if __name__ == "__main__":
    main(sys.argv[1:] or POLICIES)
