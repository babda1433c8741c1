"""Reload a saved adapter in a fresh single process with plain PEFT (no FSDP, no kit) and compare
its logits with the ones the trained, sharded model produced (`probe.pt`). Prints JSON."""

import json
import sys

import torch
import yaml
from peft import AutoPeftModelForCausalLM
from transformers import BitsAndBytesConfig

run = sys.argv[1]
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
model = AutoPeftModelForCausalLM.from_pretrained(
    f"{run}/adapter", dtype=dtype, quantization_config=quant
).eval()
probe = torch.load(f"{run}/probe.pt")
inputs = {"input_ids": probe["input_ids"], "attention_mask": probe["attention_mask"]}
mask = probe["attention_mask"].bool()
with torch.no_grad():
    with_adapter = model(**inputs).logits.float()
    with model.disable_adapter():
        without = model(**inputs).logits.float()
print(json.dumps({
    "max_diff": (with_adapter - probe["logits"])[mask].abs().max().item(),
    "max_diff_without_adapter": (without - probe["logits"])[mask].abs().max().item(),
}))
