"""Attention tiles on a GPU (kit.recipe.levers.attention_tiles): a tile of queries over the keys up to its
end, causal at its lower right, with grouped-query heads. Checks its result and gradients against
the math path with an explicit mask (small sizes), then the peak memory, time and kernel of one
8,192-query tile over 131,072 keys at the 8B shape's heads. `python benchmarks/tile_sdpa_check.py`
"""

import time
import types

import torch

from kit.recipe.levers.attention_tiles import _attend

dev, bf = torch.device("cuda"), torch.bfloat16
attn = types.SimpleNamespace(scaling=128**-0.5)
g = torch.Generator(device=dev).manual_seed(0)
q = torch.randn(1, 8, 64, 128, device=dev, dtype=bf, generator=g, requires_grad=True)
k = torch.randn(1, 2, 256, 128, device=dev, dtype=bf, generator=g, requires_grad=True)
v = torch.randn(1, 2, 256, 128, device=dev, dtype=bf, generator=g, requires_grad=True)
out = _attend(attn, q, k, v, 192)
out.float().square().sum().backward()
got = [out.detach(), q.grad, k.grad, v.grad]
q.grad = k.grad = v.grad = None
mask = torch.ones(64, 256, dtype=torch.bool, device=dev).tril(192)
ref = torch.nn.functional.scaled_dot_product_attention(
    q.float(), k.float().repeat_interleave(4, 1), v.float().repeat_interleave(4, 1), attn_mask=mask,
    scale=attn.scaling)
ref.square().sum().backward()
want = [ref.detach(), q.grad, k.grad, v.grad]
print("max abs difference (out, dq, dk, dv):",
      [round((a.float() - b.float()).abs().max().item(), 4) for a, b in zip(got, want, strict=True)])
q = torch.randn(1, 32, 8192, 128, device=dev, dtype=bf, requires_grad=True)
k = torch.randn(1, 8, 131072, 128, device=dev, dtype=bf, requires_grad=True)
v = torch.randn(1, 8, 131072, 128, device=dev, dtype=bf, requires_grad=True)
torch.cuda.synchronize()
base = torch.cuda.memory_allocated()
torch.cuda.reset_peak_memory_stats()
with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
    t = time.perf_counter()
    out = _attend(attn, q, k, v, 131072 - 8192)
    out.sum().backward()
    torch.cuda.synchronize()
print(f"8192 x 131072 tile, forward + backward: {1e3 * (time.perf_counter() - t):.0f} ms, "
      f"peak {(torch.cuda.max_memory_allocated() - base) / 2**30:.2f} GiB above inputs")
names = {e.name[:70] for e in prof.events() if "attention" in e.name.lower() or "flash" in e.name.lower()
         or "fmha" in e.name.lower()}
print("attention kernels:", sorted(names)[:6])
