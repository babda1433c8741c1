"""What autograd keeps in one forward of the compiled, recomputed kit model (one process, no FSDP),
per 4-bit path: `custom` (the custom op kit::nf4_linear, the tree before), `triton` (the
triton_op layer with its own backward, this record), `split` (the triton_op dequantize, then
torch's linear and its autograd). Run by hand on the device, from a checkout's root:
    python3 kept_per_path.py triton matmuls cpp
Call 2 ran it with kit:llama-1b, call 3 as here (kit:llama-8b). "weight-shaped" counts kept
tensors whose shape is a 4-bit weight's or its transpose: at batch 2 x 2048 the MLP's
(4,096 x 14,336) activations have the down-projection's shape, so it is not a count of weights."""
import sys
import collections
import torch
from kit.config import load_config
from kit.recipe import model, recompute, nf4

variant, keeps, wrapper = sys.argv[1], sys.argv[2], sys.argv[3]
if variant == "custom":
    def lin(x, weight, bias, state):
        return nf4.linear_op(x, nf4._bytes(weight), *nf4._tensors(state), list(state.shape),
                             state.blocksize, state.dtype, bias)
    nf4.linear = lin
elif variant == "split":
    def lin(x, weight, bias, state):
        k = nf4.kernels()
        packed = nf4._bytes(weight)
        w = k.dequant_op(packed, *nf4._tensors(state), list(state.shape), state.blocksize,
                         state.dtype, packed)
        return torch.nn.functional.linear(x, w if w.dtype == x.dtype else w.to(x.dtype), bias)
    nf4.linear = lin
common = ["model.name=kit:llama-8b", "training.device=cuda", "lora.dropout=0.05", "lora.r=16",
          "quantization.method=nf4", "lora.fused_down=true", "lora.group_inputs=true",
          "training.compile=true", f"training.recompute.keeps={keeps}"]
built = model.build(load_config(None, common), torch.device("cuda"))
torch._dynamo.reset()
recompute.compile_layers(built.model, 1.0, wrapper)
m = built.model
weights = {p.untyped_storage().data_ptr() for p in m.parameters()}
wshapes = {tuple(p.quant_state.shape) for p in m.parameters() if hasattr(p, "quant_state")}
ids = torch.randint(0, 1000, (2, 2048), device="cuda")
for it in range(2):
    seen = {}
    def pack(t):
        p = t.untyped_storage().data_ptr()
        if p not in weights:
            seen[p] = (tuple(t.shape), t.dtype, t.untyped_storage().nbytes())
        return t
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = m(input_ids=ids, labels=ids, use_cache=False).loss
    after_fwd = torch.cuda.memory_allocated()
    loss.backward()
    m.zero_grad(set_to_none=True)
    peak = torch.cuda.max_memory_allocated()
    c = collections.Counter((s, str(d)) for s, d, _ in seen.values())
    wkept = sum(n for s, d, n in seen.values() if s in wshapes or s[::-1] in wshapes)
    print(f"{variant} {keeps} {wrapper} iter {it}: kept {sum(n for *_, n in seen.values())/2**20:.1f} MiB "
          f"(weight-shaped {wkept/2**20:.1f} MiB), fwd +{(after_fwd-base)/2**20:.0f} MiB, "
          f"peak {(peak-base)/2**20:.0f} MiB over base {base/2**30:.2f} GiB", flush=True)
top = sorted(c.items(), key=lambda kv: -kv[1])[:12]
for k, v in top:
    print("   ", v, k)
