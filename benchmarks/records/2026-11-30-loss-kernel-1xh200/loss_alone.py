"""loss-alone.txt: the fused loss's head and loss, forward and backward, on random bf16 hidden
states and head, with kit.recipe.levers.loss._kernel forced False (the eager chunks) and True
(the Triton kernel); 3 warm-up + 5 timed steps each. One CUDA GPU, from the repository root:

    python3 benchmarks/records/2026-11-30-loss-kernel-1xh200/loss_alone.py > loss-alone.txt

As it ran in device call 1 (there inline in the call's script)."""
import time

import torch

from kit.recipe.levers import loss as kloss

for name, (n, h, v) in {"8B b2": (4096, 4096, 128256), "30B-A3B b10": (20480, 2048, 151936)}.items():
    g = torch.Generator(device="cuda").manual_seed(0)
    hid = torch.randn(n, h, device="cuda", dtype=torch.bfloat16, generator=g)
    w = torch.randn(v, h, device="cuda", dtype=torch.bfloat16, generator=g) * 0.02
    t = torch.randint(0, v, (n,), device="cuda", generator=g)
    den = torch.tensor(float(n), device="cuda")
    for kernel in (False, True):
        kloss._kernel = lambda device, k=kernel: k
        x = hid.clone().requires_grad_()
        for i in range(8):
            if i == 3:
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                torch.cuda.reset_peak_memory_stats()
            kloss._HeadAndLoss.apply(x, w, t, -100, den, kloss.FUSED_CHUNK_LOGITS // v).backward()
        torch.cuda.synchronize()
        ms = (time.perf_counter() - t0) / 5 * 1e3
        head = 2 * 2 * n * h * v / 1e12 / 989 * 1e3  # the two matmuls at the dense bf16 peak, ms
        print(f"{name}: kernel={kernel} {ms:.1f} ms a step (the two matmuls at peak: {head:.1f} ms), "
              f"peak {torch.cuda.max_memory_allocated() / 2**30:.2f} GiB")
