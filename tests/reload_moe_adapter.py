"""Reload a mixture-of-experts run's adapter in a fresh single process with plain PEFT on the
unquantized base, and compare its logits with the ones the trained, sharded model produced
(`probe.pt`). Prints JSON.

Two bases, both plain transformers + PEFT (of the kit only the folder a kit: name stands for):
- "max_diff": the base as trained, in dense form: its linear layers through BitsAndBytesConfig
  (as tests/reload_adapter.py), its expert stacks (which bitsandbytes does not quantize) replaced
  by their NF4 round trip made here with bitsandbytes.functional (the (E*out, in) layout, blocks
  of 64, double quant) — the values the kit's 4-bit experts computed with;
- "max_diff_dense": the bf16 base, nothing quantized: the adapter on the model it came from.
"""

import json
import sys

import bitsandbytes.functional as F
import torch
import yaml
from peft import PeftModel
from transformers import AutoModelForCausalLM, BitsAndBytesConfig

from kit.inputs.builtin import resolve

run = sys.argv[1]
cfg = yaml.safe_load(open(f"{run}/config.yaml"))
dtype = getattr(torch, cfg["model"]["dtype"])
q = cfg["quantization"]
probe = torch.load(f"{run}/probe.pt")
inputs = {"input_ids": probe["input_ids"], "attention_mask": probe["attention_mask"]}
mask = probe["attention_mask"].bool()


def nf4_round_trip(stack: torch.Tensor, transposed: bool) -> torch.Tensor:
    experts, a, b = stack.shape
    w = stack.transpose(1, 2) if transposed else stack
    flat = w.reshape(-1, w.shape[-1]).contiguous()
    packed, state = F.quantize_4bit(flat, blocksize=64, compress_statistics=q["double_quant"],
                                    quant_type=q["method"], quant_storage=dtype)
    back = F.dequantize_4bit(packed, state).reshape(w.shape)
    return (back.transpose(1, 2) if transposed else back).contiguous()


def logits(quantized: bool) -> tuple[torch.Tensor, torch.Tensor]:
    quant = BitsAndBytesConfig(
        load_in_4bit=True, bnb_4bit_quant_type=q["method"],
        bnb_4bit_use_double_quant=q["double_quant"], bnb_4bit_compute_dtype=dtype,
        bnb_4bit_quant_storage=dtype) if quantized and q["method"] != "none" else None
    base = AutoModelForCausalLM.from_pretrained(resolve(cfg["model"]["name"]), dtype=dtype,
                                                quantization_config=quant)
    if quant is not None:
        with torch.no_grad():
            for module in base.modules():
                if hasattr(module, "has_gate") and hasattr(module, "is_transposed"):
                    for p in module.parameters(recurse=False):
                        if p.dim() == 3:
                            p.copy_(nf4_round_trip(p.data, module.is_transposed))
    model = PeftModel.from_pretrained(base, f"{run}/adapter").eval()
    with torch.no_grad():
        for name, p in model.named_parameters():  # trained in model.dtype under FSDP
            if "lora_" in name:
                p.data = p.data.to(dtype)
        with_adapter = model(**inputs).logits.float()
        with model.disable_adapter():
            without = model(**inputs).logits.float()
    return with_adapter, without


ref = probe["logits"]
trained, without = logits(True)
dense, _ = logits(False)
print(json.dumps({
    "max_diff": (trained - ref)[mask].abs().max().item(),
    "max_diff_without_adapter": (without - ref)[mask].abs().max().item(),
    "max_diff_dense": (dense - ref)[mask].abs().max().item(),
    "scale": ref[mask].abs().max().item(),
}))
