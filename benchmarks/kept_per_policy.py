"""What a compiled NF4 + LoRA decoder layer keeps for backward under each training.recompute.keeps,
per token and layer, in units of hidden-size values (CPU, float32, a few seconds per policy).

    python3 benchmarks/kept_per_policy.py

The kit model `kit:tiny-llama-8b-ratios` (2 layers, hidden 128, the 8B shape's ratios), built
and loaded as the recipe loads it (kit.quantize, kit.lora), compiled per layer. Bytes are counted
with saved-tensor hooks (kit.memory.measure_saved_activations) at two sequence lengths; the
difference removes what does not grow with tokens (weights included), and the logits' share
(vocabulary / hidden per token, spread over the layers) is subtracted.
Results: benchmarks/results/profile-8b-1xh100.md.
"""

import sys

import torch

from kit import builtin, lora, memory, quantize, recompute
from kit.config import load_config

T = 256


def main(policies) -> None:
    spec = builtin.SPECS["tiny-llama-8b-ratios"]
    hidden, layers = spec["hidden_size"], spec["num_hidden_layers"]
    logits = spec["vocab_size"] / hidden / layers
    cfg = load_config(None, ["model.name=kit:tiny-llama-8b-ratios", "lora.dropout=0.05",
                             "lora.r=8", "quantization.method=nf4", "model.dtype=float32"])
    for keeps in policies:
        torch.manual_seed(0)
        model, _ = quantize.load_model(cfg, torch.device("cpu"))
        model = lora.apply_lora(model, cfg)
        if keeps == "inputs":
            recompute.enable_activation_checkpointing(model)
        elif keeps != "none":
            recompute.selective_checkpointing(model, keeps, cfg.lora.r)
        model.train()
        torch._dynamo.reset()
        recompute.compile_layers(model)
        longer, shorter = (memory.measure_saved_activations(model, 1, n) for n in (T, T // 2))
        per_token_layer = (longer - shorter) / (T // 2) / layers / (4 * hidden) - logits
        print(f"{keeps:<10} {per_token_layer:6.2f} hidden-size values per token and layer", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:] or ["none", "matmuls", "mlp", "attention", "inputs"])
