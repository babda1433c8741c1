"""What a compiled NF4 + LoRA decoder layer keeps for backward under each training.checkpoint_keeps,
per token and layer, in units of hidden-size values (CPU, float32, a few seconds per policy).

    python3 benchmarks/kept_per_policy.py

A 2-layer Llama with the 8B shape's ratios (hidden 256, MLP 3.5x, a quarter as many key/value
heads), built and loaded as the recipe loads it (kit.quantize, kit.lora), compiled per layer.
Bytes are counted with saved-tensor hooks (kit.memory.measure_saved_activations) at two sequence
lengths; the difference removes what does not grow with tokens (weights included), and the logits' share (vocab 1024 = 4 hidden
per token, over 2 layers) is subtracted. Results: benchmarks/results/profile-8b-1xh100.md.
"""

import shutil
import sys
import tempfile
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from kit import lora, memory, quantize, recompute, tiny
from kit.config import load_config

H, T = 256, 256


def main(policies) -> None:
    folder = Path(tempfile.mkdtemp()) / "model"
    shutil.copytree(tiny.resolve("kit:tiny-llama"), folder)  # its tokenizer
    config = LlamaConfig(vocab_size=1024, hidden_size=H, intermediate_size=H * 7 // 2,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=1)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    cfg = load_config(None, [f"model.name={folder}", "lora.dropout=0.05", "lora.r=8",
                             "quantization.method=nf4", "model.dtype=float32"])
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
        per_token_layer = (longer - shorter) / (T // 2) / 2 / (4 * H) - 2  # less the logits
        print(f"{keeps:<10} {per_token_layer:6.2f} hidden-size values per token and layer", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:] or ["none", "matmuls", "mlp", "attention", "inputs"])
