"""Where the step time of the 8B QLoRA recipe goes, and what each speed lever does, on ONE GPU.

    python3 benchmarks/explore_levers.py OUT_DIR

An exploration run (not the benchmark: no sharding, one process): it builds the Llama-3-8B-shaped
kit model once as the recipe does (kit.recipe.model.build: NF4, LoRA r16 on all linear layers, dropout
0.05, adapters in bf16 as FSDP's mixed precision computes them, every layer recomputed), then times
variants in the same process at sequence length 2048 on synthetic tokens: attention backend, loss,
checkpointing (full / every 2nd layer / none), batch, LoRA dropout, torch.compile of the decoder
layers; and profiles one configuration's kernels. The results decided which levers kit.bench
measures on 2 GPUs (benchmarks/results/bench-8b-2xh200.md).
"""

from __future__ import annotations

import json
import sys
import time
import traceback
from contextlib import nullcontext
from pathlib import Path

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from kit.config import load_config
from kit.inputs import builtin
from kit.recipe import model as kmodel
from kit.recipe.levers import loss as kloss
from kit.recipe.recompute import enable_activation_checkpointing

SEQ = 2048
OUT = Path(sys.argv[1] if len(sys.argv) > 1 else "/tmp/explore")
OUT.mkdir(parents=True, exist_ok=True)
rows = []


def batch_of(b: int, step: int) -> dict:
    g = torch.Generator().manual_seed(1000 + step)
    ids = torch.randint(3, 128000, (b, SEQ), generator=g).cuda()
    return {"input_ids": ids, "labels": ids}


def run_variant(model, opt, name, b, *, backend=None, steps=3, warmup=1, note=""):
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    times, losses = [], []
    ctx = (lambda: sdpa_kernel([backend])) if backend is not None else nullcontext
    row = {"variant": name, "batch": b, "note": note}
    try:
        for i in range(warmup + steps):
            batch = batch_of(b, i)
            torch.cuda.synchronize()
            t = time.perf_counter()
            with ctx():
                loss = model(**batch).loss
                loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            torch.cuda.synchronize()
            if i >= warmup:
                times.append(time.perf_counter() - t)
                losses.append(loss.item())
            elif i == 0:
                row["first_step_s"] = round(time.perf_counter() - t, 2)
        step = sorted(times)[len(times) // 2]
        row.update(status="ok", step_s=round(step, 4), tokens_per_s=round(b * SEQ / step),
                   peak_gib=round(torch.cuda.max_memory_allocated() / 2**30, 2),
                   reserved_gib=round(torch.cuda.max_memory_reserved() / 2**30, 2),
                   loss=round(losses[-1], 4))
    except torch.OutOfMemoryError:
        row.update(status="oom")
    except Exception as e:  # a lever that breaks is a result too
        row.update(status="error", error=f"{type(e).__name__}: {str(e)[:300]}")
        traceback.print_exc()
    opt.zero_grad(set_to_none=True)
    rows.append(row)
    print(json.dumps(row), flush=True)
    (OUT / "levers.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def set_checkpointing(model, every):
    if every == 0:
        model.gradient_checkpointing_disable()
    else:
        enable_activation_checkpointing(model, every)
    model.train()


def main():
    cfg = load_config("kit/configs/llama-1b-gpu.yaml", [
        "model.name=kit:llama-8b", "training.device=cuda", f"data.max_seq_len={SEQ}",
        "lora.r=16", "lora.alpha=32", "lora.dropout=0.05", "lora.target_modules=all-linear",
        "lora.dtype=bfloat16", "attention.implementation=sdpa", "training.recompute.enabled=true",
        "training.recompute.keeps=inputs", "training.loss=hf",
    ])
    t = time.perf_counter()
    builtin.resolve(cfg.model.name)
    print(f"build: {time.perf_counter() - t:.1f}s", flush=True)
    t = time.perf_counter()
    model = kmodel.build(cfg, torch.device("cuda", 0)).model
    print(f"load+quantize+LoRA: {time.perf_counter() - t:.1f}s", flush=True)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    print(torch.cuda.get_device_name(0), torch.__version__, flush=True)

    run_variant(model, opt, "reference: sdpa, hf loss, full ckpt", 4)  # as built: every layer
    run_variant(model, opt, "reference: sdpa, hf loss, full ckpt", 8)
    run_variant(model, opt, "sdpa cudnn, full ckpt", 4, backend=SDPBackend.CUDNN_ATTENTION)
    run_variant(model, opt, "sdpa flash, full ckpt", 4, backend=SDPBackend.FLASH_ATTENTION)
    kloss.install(model, "chunked")
    run_variant(model, opt, "chunked loss, full ckpt", 8)
    run_variant(model, opt, "chunked loss + cudnn, full ckpt", 8, backend=SDPBackend.CUDNN_ATTENTION)
    set_checkpointing(model, 2)
    run_variant(model, opt, "chunked loss + cudnn, every 2nd layer", 4,
                backend=SDPBackend.CUDNN_ATTENTION)
    set_checkpointing(model, 0)
    run_variant(model, opt, "chunked loss + cudnn, no ckpt", 2, backend=SDPBackend.CUDNN_ATTENTION)
    run_variant(model, opt, "chunked loss + cudnn, no ckpt", 4, backend=SDPBackend.CUDNN_ATTENTION)
    set_checkpointing(model, 1)
    # Profile one configuration: which kernels take the GPU time, and how busy the CPU is.
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        run_variant(model, opt, "profiled: chunked + cudnn, full ckpt", 4,
                    backend=SDPBackend.CUDNN_ATTENTION, steps=1, warmup=0)
    table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=30, max_name_column_width=60)
    (OUT / "profile.txt").write_text(table)
    print(table, flush=True)
    # LoRA dropout (changes what is learned: information only).
    drops = []
    for m in model.modules():
        if hasattr(m, "lora_dropout"):
            for k in list(m.lora_dropout.keys()):
                drops.append((m.lora_dropout, k, m.lora_dropout[k]))
                m.lora_dropout[k] = torch.nn.Identity()
    run_variant(model, opt, "no LoRA dropout (info), chunked + cudnn, full ckpt", 4,
                backend=SDPBackend.CUDNN_ATTENTION)
    for d, k, mod in drops:
        d[k] = mod
    # torch.compile of each decoder layer (same code: one compile serves all layers).
    try:
        for layer in model.get_base_model().model.layers:
            layer.compile()
        run_variant(model, opt, "compiled layers, chunked + cudnn, full ckpt", 4,
                    backend=SDPBackend.CUDNN_ATTENTION, warmup=2)
    except Exception as e:
        rows.append({"variant": "compiled layers", "status": "error", "error": str(e)[:300]})
    (OUT / "levers.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


if __name__ == "__main__":
    main()
