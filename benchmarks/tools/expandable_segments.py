"""The second article's claim B15: PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True reduces
out-of-memory errors from fragmentation. One GPU, measured side by side:

    python benchmarks/tools/expandable_segments.py OUT.jsonl [--model kit:llama-1b] [--steps 60]

The same QLoRA training steps (the kit's model build: NF4 base, LoRA, recomputation) on batches
whose sequence length changes every step, as unpacked data gives them (seeded, 128 to 4,096
tokens), once per allocator setting, each in a fresh process (CUDA reads the variable when it
starts). Per setting, first free: peak allocated and peak reserved (what fragmentation costs is
the gap), the allocator's retries (torch.cuda.memory_stats: a cudaMalloc that failed, cache
freed, tried again); then the same steps again under memory caps of `--caps` x the free runs'
peak allocated (set_per_process_memory_fraction), without emptying the cache between steps:
the steps that ran out of memory. The kit sets the variable in every run.sh (kit/run/launch.py);
the rows, recorded under benchmarks/records/, are for the cell that settles claim B15.

`--device cpu` runs 2 steps of each setting on the tiny model with no memory figures: a check
of the script itself, not a measurement.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

SETTINGS = {"default": None, "expandable_segments": "expandable_segments:True"}


def lengths(steps: int, seed: int = 0) -> list[int]:
    """Sequence lengths, one per step: multiples of 8 from 128 to 4,096, seeded."""
    import random

    rng = random.Random(seed)
    return [8 * rng.randint(16, 512) for _ in range(steps)]


def child(args) -> dict:
    import torch

    from kit.config import load_config
    from kit.recipe.model import build

    device = torch.device(args.device)
    cuda = device.type == "cuda"
    config = "kit/configs/llama-1b-gpu.yaml" if cuda else "kit/configs/tiny-cpu.yaml"
    cfg = load_config(config, [f"model.name={args.model}", f"training.device={args.device}",
                               f"data.max_seq_len={4096 if cuda else 512}", "model.loading=full"])
    torch.manual_seed(0)
    model = build(cfg, device).model
    vocab = model.config.vocab_size
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    steps = lengths(args.steps) if cuda else [64, 128]

    def run() -> tuple[int, int]:
        """The steps in order, the cache never emptied; (steps that ran, steps out of memory)."""
        ran = ooms = 0
        for i, seq in enumerate(steps):
            g = torch.Generator().manual_seed(i)
            ids = torch.randint(3, vocab, (args.batch, seq), generator=g).to(device)
            try:
                model(input_ids=ids, labels=ids).loss.backward()
                opt.step()
                ran += 1
            except torch.OutOfMemoryError:
                ooms += 1
            finally:
                opt.zero_grad(set_to_none=True)
                del ids
        return ran, ooms

    row = {"setting": args.child, "PYTORCH_CUDA_ALLOC_CONF": os.environ.get("PYTORCH_CUDA_ALLOC_CONF"),
           "model": args.model, "batch": args.batch, "steps": len(steps),
           "seq_lens": f"{min(steps)}-{max(steps)}"}
    started = time.perf_counter()
    row["steps_ran"], row["steps_oom"] = run()
    row["seconds"] = round(time.perf_counter() - started, 1)
    if not cuda:
        return row
    stats = torch.cuda.memory_stats(device)
    allocated, reserved = torch.cuda.max_memory_allocated(device), torch.cuda.max_memory_reserved(device)
    row.update(device=torch.cuda.get_device_name(device),
               peak_allocated_gib=round(allocated / 2**30, 3),
               peak_reserved_gib=round(reserved / 2**30, 3),
               reserved_over_allocated=round(reserved / allocated, 3),
               alloc_retries=stats.get("num_alloc_retries", 0), ooms=stats.get("num_ooms", 0))
    return row


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", nargs="?")
    parser.add_argument("--model", default="kit:llama-1b")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--caps", default="1.02,1.1",
                        help="the caps of the capped passes, x the free runs' peak allocated")
    parser.add_argument("--cap-gib", type=float, default=0.0, help="(child) the cap in GiB; 0: none")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--child", choices=list(SETTINGS))
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child_with_cap(args)), flush=True)
        return 0
    if not args.out:
        parser.error("OUT.jsonl is required")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    rows = []
    caps = [float(c) for c in args.caps.split(",")] if args.device == "cuda" else []
    for phase in ["free", *(f"capped {c}x" for c in caps)]:
        cap = 0.0
        if phase != "free":
            cap = round(float(phase.split()[1][:-1]) * max(r["peak_allocated_gib"] for r in rows
                                                          if r["phase"] == "free"), 3)  # fmt: skip
        for name, value in SETTINGS.items():
            env = {k: v for k, v in os.environ.items() if k != "PYTORCH_CUDA_ALLOC_CONF"}
            if value:
                env["PYTORCH_CUDA_ALLOC_CONF"] = value
            cmd = [sys.executable, __file__, "--child", name, "--model", args.model,
                   "--steps", str(args.steps), "--batch", str(args.batch), "--device", args.device,
                   "--cap-gib", str(cap)]
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
            if proc.returncode != 0:
                sys.stderr.write(proc.stderr[-3000:])
                return proc.returncode
            row = {"phase": phase, **json.loads(proc.stdout.strip().splitlines()[-1])}
            print(json.dumps(row), flush=True)
            rows.append(row)
    with out.open("a") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    return 0


def child_with_cap(args) -> dict:
    """The child's work: the steps free, or under --cap-gib (then the OOMs it caused)."""
    import torch

    if args.cap_gib and args.device == "cuda":
        device = torch.device("cuda", torch.cuda.current_device())  # the call needs an index
        total = torch.cuda.get_device_properties(device).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, args.cap_gib * 2**30 / total), device)
    row = child(args)
    row["cap_gib"] = args.cap_gib or None
    return row


if __name__ == "__main__":
    sys.exit(main())
