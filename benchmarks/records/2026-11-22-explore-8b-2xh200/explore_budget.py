"""What a compiled decoder layer keeps for backward, per activation memory budget (issue 6).

One decoder layer of Llama-3-8B's shape (random weights), NF4 + LoRA r16 on all linear layers
(dropout 0.05), as the kit builds it (kit.recipe.model.build); eager, then compiled at budgets 1.0 / 0.5 /
0.3 / 0.15, optionally under FSDP2 (world of one). Per row: dynamo graphs and graph breaks,
activation bytes kept for backward (saved-tensor hooks; parameters excluded), peak memory and
forward+backward time.
Usage: python benchmarks/explore_budget.py [--device cuda] [--seq 2048] [--batch 4]
"""
import argparse
import json
import os
import time

import torch


def build(path: str, device: str):
    """The one-layer model, built as the recipe builds it (kit.recipe.model.build: NF4 with double quant
    and bf16 storage, LoRA r16 on all linear layers in bf16, sdpa, nothing recomputed: the
    compiler's budget decides), from a local folder written here once."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from kit.config import load_config
    from kit.inputs import builtin
    from kit.recipe import model as kmodel

    if not os.path.exists(path):
        cfg = LlamaConfig(vocab_size=1024, hidden_size=4096, intermediate_size=14336,
                          num_hidden_layers=1, num_attention_heads=32, num_key_value_heads=8,
                          max_position_embeddings=8192)
        LlamaForCausalLM(cfg).to(torch.bfloat16).save_pretrained(path)
        builtin.train_tokenizer().save_pretrained(path)  # the recipe loads one with the model
    cfg = load_config(None, [
        f"model.name={path}", "model.dtype=bfloat16", f"training.device={device}",
        "quantization.method=nf4", "quantization.double_quant=true", "quantization.storage=bfloat16",
        "lora.r=16", "lora.alpha=32", "lora.dropout=0.05", "lora.target_modules=all-linear",
        "lora.dtype=bfloat16", "attention.implementation=sdpa", "training.recompute.enabled=false",
        "training.seed=0",
    ])
    dev = torch.device(device, 0) if device == "cuda" else torch.device("cpu")
    return kmodel.build(cfg, dev).model


def measure(model, layer, x, pos, device, steps):
    import torch._dynamo.utils as dutils

    weights, kept = set(), {}

    def params_now(module, args, kwargs=None):  # after FSDP2's unshard: the gathered weights
        for p in module.parameters():
            try:
                weights.add(p.untyped_storage().data_ptr())
            except RuntimeError:  # a sharded DTensor
                pass

    hook = layer.register_forward_pre_hook(params_now)

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in weights and t.device.type != "meta":
            kept[ptr] = t.untyped_storage().nbytes()
        return t

    dutils.counters.clear()
    times = []
    for _ in range(steps):
        kept.clear()
        if device == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
        t = time.perf_counter()
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = layer(x, position_embeddings=pos)
        out = out[0] if isinstance(out, tuple) else out
        out.float().pow(2).mean().backward()
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    hook.remove()
    peak = (torch.cuda.max_memory_allocated() - base) / 2**30 if device == "cuda" else None
    return {"graphs": dutils.counters["stats"].get("unique_graphs", 0),
            "graph_breaks": sum(dutils.counters["graph_break"].values()),
            "break_reasons": list(dutils.counters["graph_break"])[:4],
            "kept_gib": round(sum(kept.values()) / 2**30, 3),
            "peak_gib": round(peak, 3) if peak is not None else None,
            "fwd_bwd_ms": round(1000 * sorted(times[1:] or times)[len(times[1:] or times) // 2], 1)}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--path", default="/tmp/kit_l8b1")
    ap.add_argument("--fsdp", action="store_true", help="shard the layer with FSDP2 (world of one), as the kit does")
    a = ap.parse_args()
    import torch._functorch.config as fc

    from kit.recipe.recompute import compile_layers

    if a.fsdp:
        import torch.distributed as dist

        from kit.config import load_config
        from kit.lab import sharding
        dist.init_process_group("nccl" if a.device == "cuda" else "gloo",
                                init_method="tcp://127.0.0.1:29533", rank=0, world_size=1)
    rows = []
    for fsdp in ([True] if a.fsdp else [False]):
        for budget in (None, 1.0, 0.5, 0.3, 0.15):
            torch._dynamo.reset()
            model = build(a.path, a.device)
            layer = model.base_model.model.model.layers[0]
            dev = torch.device(a.device, 0) if a.device == "cuda" else torch.device("cpu")
            if fsdp:  # as the kit shards: each decoder layer, then the root; bf16 compute
                model = sharding.shard(model, load_config(None, ["sharding.engine=fsdp2"]), dev)
            if budget is not None:
                compile_layers(model, budget)
            g = torch.Generator().manual_seed(1)
            x = torch.randn(a.batch, a.seq, 4096, generator=g).to(dev, torch.bfloat16)
            x.requires_grad_(True)
            pos_ids = torch.arange(a.seq, device=dev)[None]
            with torch.no_grad():
                pos = model.base_model.model.model.rotary_emb(x, pos_ids)
            row = {"fsdp2": fsdp, "budget": budget or "eager", "batch": a.batch, "seq": a.seq,
                   **measure(model, layer, x, pos, a.device, a.steps)}
            row["kept_gib_per_seq"] = round(row["kept_gib"] / a.batch, 3)
            print(json.dumps(row), flush=True)
            rows.append(row)
            del model, layer, x
            if a.device == "cuda":
                torch.cuda.empty_cache()
    fc.activation_memory_budget = 1.0


if __name__ == "__main__":
    main()
