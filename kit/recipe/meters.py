"""What a rank measures about itself while it trains: device memory now and at its peak, and the
host's resident set (CPU ranks). The recipe (kit.train), the SFT entry (kit.sft.trainer) and the
benchmark's ranks report these; torch is imported inside the functions.
"""

from __future__ import annotations

import resource


def allocated_gib(device) -> float:
    """What tensors hold on `device` now: allocated CUDA memory on a GPU, the resident set on CPU."""
    import torch

    if device.type == "cuda":
        return torch.cuda.memory_allocated(device) / 2**30
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 2**20  # KiB -> GiB
    return 0.0


def peak_gib(device) -> float:
    """Peak memory of this process on `device` so far: allocated CUDA memory on a GPU, the peak
    resident set on CPU (each rank's own: every row of metrics.jsonl carries it)."""
    import resource

    import torch

    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    # The process's peak RSS. Not ru_maxrss: on Linux it carries over the launching parent's peak.
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 2**20  # KiB -> GiB
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


# --------------------------------------------------------------------------- host memory (kit.recipe.loading)

class HostMemory:
    """Peak host memory of this process while the block runs, split as the kernel counts it:
    anonymous (this process's own; what the OOM killer frees by killing it) and file-backed
    (pages of memory-mapped checkpoint files: the page cache, shared by every rank that maps
    the same file and reclaimable). Sampled from /proc/self/status every `every_s` seconds.
    Gap filled: getrusage and psutil give one peak for both, or none."""

    def __init__(self, every_s: float = 0.01):
        self.every_s, self.peak = every_s, {"RssAnon": 0.0, "RssFile": 0.0, "VmRSS": 0.0}

    def sample(self) -> None:
        for line in open("/proc/self/status"):
            key, _, value = line.partition(":")
            if key in self.peak:
                self.peak[key] = max(self.peak[key], int(value.split()[0]) / 1024)

    def __enter__(self):
        import threading

        self._stop = threading.Event()
        self.sample()

        def run():
            while not self._stop.wait(self.every_s):
                self.sample()

        self._thread = threading.Thread(target=run, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.sample()


def peak_rss_mib() -> float:
    """This process's peak resident host memory so far (VmHWM; not ru_maxrss, which on Linux
    carries the launching parent's peak over exec). It counts pages of memory-mapped checkpoint
    files a rank has touched (HostMemory splits them out)."""
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024  # KiB -> MiB
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
