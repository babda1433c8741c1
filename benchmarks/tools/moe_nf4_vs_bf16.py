"""NF4 experts against bf16 experts on a tiny mixture of experts, on the CPU: the held-out loss
after a short LoRA training, two seeds each (the seed moves the LoRA init and the batch order).
One process, the recipe's build (kit.recipe.model: load, quantize, LoRA, recompute, loss), a
plain AdamW loop. NF4 passes when its mean held-out loss is within the spread of the two seeds
(of either side) of bf16's.

    python benchmarks/tools/moe_nf4_vs_bf16.py [MODEL] [STEPS] [OUT.json]   # kit:tiny-qwen3-moe 40

Recorded in benchmarks/records/2026-11-25-moe-nf4-vs-bf16-cpu (too slow for the test suite: 4
trainings). Prints the result as one JSON line; OUT.json gets it too.
"""

import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from kit.config import load_config  # noqa: E402
from kit.recipe import model as kmodel  # noqa: E402
from kit.recipe.lora import sample_rows  # noqa: E402

name = sys.argv[1] if len(sys.argv) > 1 else "kit:tiny-qwen3-moe"
steps = int(sys.argv[2]) if len(sys.argv) > 2 else 40
train, val = sample_rows(name)


def held_out_loss(quant: str, seed: int) -> float:
    cfg = load_config(Path(__file__).parents[2] / "kit/configs/tiny-cpu.yaml",
                      [f"model.name={name}", f"quantization.method={quant}",
                       "model.loading=full", f"training.seed={seed}"])
    peft_model = kmodel.build(cfg, torch.device("cpu")).model
    params = [p for p in peft_model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=cfg.training.lr, weight_decay=0.0)
    order = torch.randperm(len(train["input_ids"]), generator=torch.Generator().manual_seed(seed))
    for step in range(steps):
        rows = order[(step * 8) % len(order):][:8]
        loss = peft_model(**{k: v[rows] for k, v in train.items()}).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
    peft_model.eval()
    with torch.no_grad():
        return peft_model(**val).loss.item()


started = time.time()
losses = {q: [held_out_loss(q, seed) for seed in (0, 1)] for q in ("none", "nf4")}
spread = max(max(v) - min(v) for v in losses.values())
gap = abs(statistics.mean(losses["nf4"]) - statistics.mean(losses["none"]))
result = {"model": name, "steps": steps, "held_out_loss": losses, "seed_spread": spread,
          "nf4_vs_bf16_gap": gap, "within_seed_noise": gap <= spread,
          "seconds": round(time.time() - started, 1)}
print(json.dumps(result))
if len(sys.argv) > 3:
    Path(sys.argv[3]).write_text(json.dumps(result, indent=1) + "\n")
