"""The host link's speed, as activation offloading uses it (GPU only): pinned host memory to and
from the GPU on a side stream, alone and while the compute stream runs bf16 matmuls
(benchmarks/results/host-layers-8b-1xh100.md).

    python3 benchmarks/host_link.py            # prints GB/s per direction, and the matmuls' slowdown

One copy is 587 MB, one 8B layer's gate and up results at batch 5 x 2,048 tokens."""

import time

import torch


def timed(fn, n: int = 5) -> float:
    fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(n):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / n


def main() -> None:
    gpu = torch.empty(2 * 5 * 2048 * 14336, dtype=torch.bfloat16, device="cuda")
    host = torch.empty(gpu.shape, dtype=gpu.dtype, pin_memory=True)
    side = torch.cuda.Stream()
    a = torch.randn(10240, 4096, dtype=torch.bfloat16, device="cuda")
    w = torch.randn(4096, 14336, dtype=torch.bfloat16, device="cuda")
    nbytes = gpu.numel() * gpu.element_size()

    def copies(direction):
        with torch.cuda.stream(side):
            (host.copy_(gpu, non_blocking=True) if direction == "out"
             else gpu.copy_(host, non_blocking=True))
        torch.cuda.current_stream().wait_stream(side)

    def matmuls():
        for _ in range(20):
            a @ w

    def both(direction):
        with torch.cuda.stream(side):
            (host.copy_(gpu, non_blocking=True) if direction == "out"
             else gpu.copy_(host, non_blocking=True))
        matmuls()
        torch.cuda.current_stream().wait_stream(side)

    alone = timed(matmuls)
    print(f"{torch.cuda.get_device_name(0)}; copy {nbytes / 1e6:.0f} MB; "
          f"20 matmuls 10240x4096x14336 alone {alone * 1e3:.1f} ms")
    for direction in ("out", "back"):
        t = timed(lambda d=direction: copies(d))
        with_mm = timed(lambda d=direction: both(d))
        print(f"{'to host' if direction == 'out' else 'to GPU'}: {nbytes / t / 1e9:.1f} GB/s alone; "
              f"with the matmuls {with_mm * 1e3:.1f} ms against {max(alone, t) * 1e3:.1f} ms "
              "for the longer of the two")


if __name__ == "__main__":
    main()
