"""Write a built-in shape's checkpoint folder with random weights, as published ones are stored
(transformers' own save_pretrained: a mixture of experts one tensor per expert), at `--layers` of
its depth: what `model.loading` must stream (kit.recipe.expert_source) within the plan, and what
stacks other than the kit read (kit.bench.unsloth).

    python3 benchmarks/tools/moe_checkpoint.py /tmp/q30-half --layers 24   # Qwen3-30B-A3B, ~30 GB
    python3 benchmarks/tools/moe_checkpoint.py /tmp/q32 --shape qwen25-32b  # Qwen2.5-32B, ~65 GB

The weights are initialised on the GPU where there is one (seconds), then written; the tokenizer
is the kit's own (kit.inputs.builtin.train_tokenizer), as the built-in shapes carry."""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from kit.inputs import builtin


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--shape", default="qwen3-30b-a3b", choices=sorted(builtin.SPECS))
    parser.add_argument("--layers", type=int, default=None, help="default: the shape's own")
    args = parser.parse_args()
    if (args.out / "config.json").is_file():
        print(f"{args.out}: written already")
        return
    start = time.time()
    spec = dict(builtin.SPECS[args.shape])
    spec["num_hidden_layers"] = args.layers or spec["num_hidden_layers"]
    tokenizer = builtin.train_tokenizer()
    config = AutoConfig.for_model(spec.pop("model_type"), **spec, bos_token_id=tokenizer.bos_token_id,
                                  eos_token_id=tokenizer.eos_token_id,
                                  pad_token_id=tokenizer.pad_token_id)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    with torch.device(device):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(args.out, max_shard_size="4GB")
    tokenizer.save_pretrained(args.out)
    from safetensors import safe_open

    names = [k for f in sorted(args.out.glob("*.safetensors"))
             for k in safe_open(f, "pt").keys()]  # fmt: skip
    per_expert = sum(".experts.0." in k for k in names)
    print(json.dumps({"folder": str(args.out), "shape": args.shape, "layers": spec["num_hidden_layers"],
                      "parameters": sum(p.numel() for p in model.parameters()),
                      "tensors": len(names), "expert_0_tensors": per_expert,
                      "bytes": sum(p.stat().st_size for p in args.out.glob("*.safetensors")),
                      "seconds": round(time.time() - start, 1)}))


if __name__ == "__main__":
    main()
