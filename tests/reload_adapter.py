"""Reload a saved adapter in a fresh single process with plain PEFT (no FSDP; of the kit only the
folder a kit: base model name stands for) and compare its logits with the ones the trained,
sharded model produced (`probe.pt`). Prints JSON.

The base is named by the run's config, as adapter_config.json names it (kit:tiny-llama, a hub id
or a folder): PEFT's own pattern for a base found elsewhere, PeftModel.from_pretrained(base, dir)."""

import json
import sys

import torch
import yaml
from peft import PeftModel
from transformers import AutoModelForCausalLM, BitsAndBytesConfig

from kit.inputs.builtin import resolve

run = sys.argv[1]
device = sys.argv[2] if len(sys.argv) > 2 else "cpu"
cfg = yaml.safe_load(open(f"{run}/config.yaml"))
dtype = getattr(torch, cfg["model"]["dtype"])
quant = None
if cfg["quantization"]["method"] != "none":
    quant = BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type=cfg["quantization"]["method"],
        bnb_4bit_use_double_quant=cfg["quantization"]["double_quant"],
        bnb_4bit_compute_dtype=dtype,
        bnb_4bit_quant_storage=dtype,
    )
base = AutoModelForCausalLM.from_pretrained(
    resolve(cfg["model"]["name"]), dtype=dtype, quantization_config=quant,
    **({"device_map": {"": 0}} if device == "cuda" else {}),
)
model = PeftModel.from_pretrained(base, f"{run}/adapter").eval()
probe = torch.load(f"{run}/probe.pt")
inputs = {"input_ids": probe["input_ids"].to(device), "attention_mask": probe["attention_mask"].to(device)}
mask = probe["attention_mask"].bool()


def logits():
    return model(**inputs).logits.float().cpu()


with torch.no_grad():
    as_loaded = logits()  # PEFT upcasts the adapter to float32 on load
    # Training computed LoRA in model.dtype (FSDP mixed precision / bf16 adapters): do the same.
    for name, p in model.named_parameters():
        if "lora_" in name:
            p.data = p.data.to(dtype)
    with_adapter = logits()
    with model.disable_adapter():
        without = logits()
ref = probe["logits"]
print(json.dumps({
    "max_diff": (with_adapter - ref)[mask].abs().max().item(),
    "max_diff_fp32_adapter": (as_loaded - ref)[mask].abs().max().item(),
    "max_diff_without_adapter": (without - ref)[mask].abs().max().item(),
    "scale": ref[mask].abs().max().item(),
}))
