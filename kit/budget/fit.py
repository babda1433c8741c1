"""What fits the machine: the plan's view of it (`Hardware`), the estimate asked of each recompute
policy and batch (`fits`), the fastest of those by the step model (`search`), and, where nothing
fits, one line naming the smallest change that does (`refusal`). kit.budget.plan's search calls
these in the order its choices depend on one another.

Kernel side, no torch.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, replace

from kit.budget.estimate import OUTSIDE_GIB, Setup, estimate
from kit.budget.shapes import Shape
from kit.budget.step_model import PEAK_BF16_FLOPS, speed
from kit.config import AUTO, Config


@dataclass(frozen=True)
class Hardware:
    """What the plan needs of the machine: one process per GPU (or per CPU rank)."""

    device: str  # "cuda" | "cpu"
    world_size: int = 1
    memory_gib: float | None = None  # per GPU: what the run may use (a cap, or the GPU's)
    name: str = ""
    fp8: bool = False  # compute capability 8.9 or higher: FP8 tensor cores
    flash_attn: bool = False  # the flash-attn package is installed
    # Host memory each process may fill with offloaded tensors (the node's available memory over
    # its processes); None: not known (`kit plan` for other machines), not checked.
    host_gib: float | None = None
    grouped_gemm: bool = False  # compute capability 9.0 or higher: one grouped-GEMM kernel
    triton: bool = False  # compute capability 8.0 or higher and triton: the kit's Triton kernels
    # What the process holds outside torch's allocator, left free of the plan's memory: the
    # measured OUTSIDE_GIB where memory_gib is a card's own; 0 where it is a cap on the allocator
    # (torch.cuda.set_per_process_memory_fraction: kit.bench's caps), which that memory sits beside.
    outside_gib: float = OUTSIDE_GIB

    @property
    def peak_flops(self) -> float | None:
        return next((v for k, v in PEAK_BF16_FLOPS.items() if k in self.name), None)

    def grouped_kernel(self, dtype: str) -> bool:
        """A mixture's experts run as one grouped GEMM here in `dtype` (model.dtype): bf16 on a GPU
        that has the kernel, as kit.recipe.grouped_experts.grouped_kernel decides at run time."""
        return self.grouped_gemm and dtype == "bfloat16"



def setup_of(cfg: Config, hw: Hardware, seq_len: int) -> Setup:
    probe = copy.deepcopy(cfg)
    probe.data.max_seq_len = seq_len
    if probe.training.batch_size == AUTO:  # each candidate sets its own (Setup.batch_size)
        probe.training.batch_size = 1
    grouped = hw.grouped_kernel(cfg.model.dtype) and cfg.model.experts == "grouped"
    return replace(Setup.from_config(probe, world_size=hw.world_size), grouped_gemm=grouped)


# Of the host memory a process may use, the share offloaded tensors may fill (the rest: the
# process itself, its pinned staging, the data).
HOST_SHARE = 0.8


def fits(cfg: Config, hw: Hardware, seq_len: int, shape: Shape, **changes) -> float | None:
    """The estimate's needed GiB when `changes` (Setup fields) fit hw, GPU and host, else None."""
    est = estimate(shape, replace(setup_of(cfg, hw, seq_len), **changes))
    need = est.needed_gib(hw.outside_gib)
    if hw.host_gib is not None and est.cpu_bytes / 2**30 > HOST_SHARE * hw.host_gib:
        return None
    return need if hw.memory_gib is None or need <= hw.memory_gib else None


def rate(cfg: Config, hw: Hardware, seq_len: int, shape: Shape, keeps: str, batch: int) -> float:
    """The step model's tokens/s for `cfg` (its recompute, wrapper, offloading) at keeps, batch."""
    t = cfg.training
    return speed(shape, seq_len, batch, keeps if t.recompute.enabled else None, hw,
                 t.recompute.matmul_layers, wrapper=t.compile_wrapper,
                 offloaded=t.offload_activations is True)


def search(cfg: Config, hw: Hardware, seq_len: int, shape: Shape, policies, batches):
    """((keeps, batch), needed GiB) predicted fastest among those that fit; None if none does.
    Layers that keep every matmul (training.recompute.matmul_layers) are yours to set: the
    estimate and the step model count them."""
    rc = cfg.training.recompute
    best, best_speed = None, -1.0
    for keeps in policies:
        for batch in batches:
            need = fits(cfg, hw, seq_len, shape, batch_size=batch, recompute_keeps=keeps)
            if need is None:
                break  # a larger batch needs more
            s = rate(cfg, hw, seq_len, shape, keeps, batch)
            if s > best_speed * 1.001:  # a tie goes to the smaller batch (less memory)
                best, best_speed = ((keeps, batch), need), s
        if not rc.enabled:
            break
    return best


def refusal(cfg: Config, hw: Hardware, seq_len: int, shape: Shape, policies, batches) -> str:
    """One line: nothing fits; the smallest single change that does (tried in this order)."""
    t = cfg.training
    est = estimate(shape, replace(setup_of(cfg, hw, seq_len), batch_size=batches[0],
                                  recompute_keeps=policies[-1]))
    need, host = est.needed_gib(hw.outside_gib), est.cpu_bytes / 2**30
    trials = []
    if batches[0] > 1:  # a batch you set: the largest that fits, with the policies allowed
        for batch in range(batches[0] - 1, 0, -1):
            if any(fits(cfg, hw, seq_len, shape, batch_size=batch, recompute_keeps=k)
                   is not None for k in policies):
                return _line(cfg, hw, seq_len, need, f"training.batch_size={batch}", host)
    if policies != ["inputs"] and t.recompute.enabled:
        trials.append(("training.recompute.keeps=inputs", dict(recompute_keeps="inputs")))
    if not t.recompute.enabled:
        trials.append(("training.recompute.enabled=true",
                       dict(recompute=True, recompute_keeps="inputs")))
    if t.loss != "fused":
        trials.append(("training.loss=fused", dict(loss="fused")))
    if t.offload_activations is not True and (t.compile is not True or t.recompute.enabled):
        trials.append(("training.offload_activations=true", dict(offload_activations=True)))
    trials += [(f"lora.r={r}", dict(lora_r=r)) for r in (8, 4) if r < cfg.lora.r]  # MoE: per expert
    base = dict(batch_size=batches[0], recompute_keeps=policies[-1])
    for text, change in trials:
        if fits(cfg, hw, seq_len, shape, **{**base, **change}) is not None:
            return _line(cfg, hw, seq_len, need, text, host)
    for seq in (s for s in (131072, 65536, 32768, 16384, 8192, 4096, 2048, 1024, 512)
                if s < seq_len):
        if fits(cfg, hw, seq, shape, **base) is not None:
            return _line(cfg, hw, seq_len, need, f"data.max_seq_len={seq}", host)
    for gpus in (2, 4, 8, 16, 32, 64):
        if gpus > hw.world_size and cfg.sharding.engine != "ddp" and fits(
                cfg, replace(hw, world_size=gpus), seq_len, shape, **base) is not None:
            return _line(cfg, hw, seq_len, need, f"{gpus} GPUs (FSDP shards the weights)", host)
    return _line(cfg, hw, seq_len, need, "a larger GPU or sharding.cpu_offload=true", host)


def _line(cfg: Config, hw: Hardware, seq_len: int, need: float, change: str,
          host: float = 0.0) -> str:
    over = (f", and {host:.1f} GiB of host memory per process for offloaded tensors, "
            f"{HOST_SHARE * hw.host_gib:.1f} available" if hw.host_gib is not None
            and host > HOST_SHARE * hw.host_gib else "")
    return (f"training.batch_size: {cfg.training.batch_size!r} does not fit: it needs "
            f"{need:.1f} GiB per GPU with headroom (kit.budget.estimate), {hw.memory_gib:g} GiB "
            f"available ({hw.world_size} x {hw.name or hw.device}, sequence {seq_len}){over}; "
            f"the smallest change that fits: {change}")
