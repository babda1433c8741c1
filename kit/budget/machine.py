"""The machine a start plans for, probed once, and the rules read from it.

    machine = probe(nproc_per_node=2)   # GPUs (nvidia-smi), host RAM, variables, packages
    hw = for_plan(machine, world_size=2, device="cuda")   # what the planner needs of it
    fp8({"name": "NVIDIA H100 80GB HBM3"})                # True: compute capability 9.0

One machine probe with one FP8 rule: `probe` (nvidia-smi, never this process's CUDA) is what a
start checks and plans for (kit.run.check, kit.doctor); a rank that plans for itself (a start
nobody checked) describes its own GPU the same way (kit.recipe.planning.hardware), and `fp8`
decides from the compute capability either way (from the name where only a name is given:
`kit plan --gpu NAME`, a doctor's machine as a dict). The notebook's report of this machine
(packages, attention, bitsandbytes) is kit.lab.hardware.

Kernel side, no torch; the rank side reads its rules (nothing here reaches kit.run).
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess

# FP8 tensor cores: compute capability 8.9 (Ada) and later (Hopper, Blackwell).
FP8_CAPABILITY = (8, 9)
# The compute capability of a GPU known by its name only (`kit plan --gpu NAME`, a doctor's
# machine given as a dict): the first name contained in it.
CAPABILITY = {"H100": "9.0", "H200": "9.0", "B200": "10.0", "A100": "8.0", "L40": "8.9",
              "4090": "8.9"}


def capability(gpu: dict) -> tuple[int, int] | None:
    """(major, minor) of a GPU dict: its probed "capability" ("9.0"), else by its name."""
    found = gpu.get("capability") or next(
        (v for k, v in CAPABILITY.items() if k in str(gpu.get("name", ""))), None)
    try:
        major, minor = str(found).split(".")
        return int(major), int(minor)
    except ValueError:
        return None


def fp8(gpu: dict) -> bool:
    """The one FP8 rule: the GPU computes FP8 on tensor cores (FP8_CAPABILITY or later)."""
    found = capability(gpu)
    return found is not None and found >= FP8_CAPABILITY


# torch._grouped_mm's CUTLASS kernel (a mixture of experts' grouped GEMMs, kit.recipe.
# grouped_experts): compute capability 9.0 (Hopper) and later; older GPUs loop inside torch.
GROUPED_GEMM_CAPABILITY = (9, 0)
# Triton's bf16 tensor-core dot (kit.recipe.lora_down's kernels): compute capability 8.0 (Ampere)
# and later.
TRITON_CAPABILITY = (8, 0)


def grouped_gemm(gpu: dict) -> bool:
    """The one grouped-GEMM rule: the GPU runs `torch._grouped_mm` as one kernel."""
    found = capability(gpu)
    return found is not None and found >= GROUPED_GEMM_CAPABILITY


def triton_kernels(gpu: dict, packages: dict) -> bool:
    """The one Triton rule: the kit's Triton kernels run on this GPU (TRITON_CAPABILITY or later)
    with triton installed (CUDA builds of torch bring it; `kit plan --gpu NAME` assumes one)."""
    found = capability(gpu)
    return found is not None and found >= TRITON_CAPABILITY and bool(packages.get("triton"))


def column_shares(rows: int, width: int, units: int) -> int:
    """Shares of its columns the down-projection kernel splits each block of 64 rows into, on a GPU
    of `units` multiprocessors: its row blocks alone leave most of them idle when the rows are few
    (a dense layer at batch 2: 4,096 rows, 64 blocks on 132; 9.4 ms of a 268 ms step on an H200,
    3.8 split: benchmarks/records/2026-11-30-split-gather-2xh200), so the columns are split until
    there are ~4 programs a multiprocessor, at least 4 tiles of 64 a share, at most 16 shares; a
    mixture of experts' ~200,000 sorted rows take one."""
    blocks = max(1, -(-rows // 64))
    return max(1, min(16, -(-4 * units // blocks), width // 256))


def _nvidia_smi() -> list[dict]:
    """This machine's GPUs as nvidia-smi lists them (name, memory, compute capability), without
    touching this process's CUDA; a driver too old to report compute_cap leaves it out."""
    if not shutil.which("nvidia-smi"):
        return []
    for fields in ("name,memory.total,compute_cap", "name,memory.total"):
        try:
            proc = subprocess.run(["nvidia-smi", f"--query-gpu={fields}",
                                   "--format=csv,noheader,nounits"],
                                  capture_output=True, text=True, timeout=20)
            found = []
            for line in proc.stdout.strip().splitlines() if proc.returncode == 0 else []:
                cells = [c.strip() for c in line.split(",")]
                gpu = {"name": cells[0], "memory_gib": round(float(cells[1]) / 1024, 2)}
                found.append({**gpu, "capability": cells[2]} if len(cells) > 2 else gpu)
            if found:
                return found
        except (OSError, ValueError, IndexError, subprocess.SubprocessError):
            continue
    return []


def available_gib() -> float | None:
    """This node's available host memory (MemAvailable), GiB; None where /proc/meminfo is not
    there to say (the standard library has no portable one)."""
    try:
        with open("/proc/meminfo") as f:
            kib = next(int(line.split()[1]) for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError):
        return None
    return kib / 2**20


def probe(vars: dict | None = None, nproc_per_node: int | None = None) -> dict:
    """The machine a run would start on: env vars, GPUs (nvidia-smi), host RAM, installed optional
    packages. `vars` adds or overrides variables (e.g. what a launch script exports);
    `nproc_per_node` defaults to LOCAL_WORLD_SIZE, the GPU count, else 2."""
    gpus = _nvidia_smi()
    env_vars = {**os.environ, **(vars or {})}
    nproc = nproc_per_node or int(env_vars.get("LOCAL_WORLD_SIZE", 0)) or len(gpus) or 2
    return {
        "vars": env_vars,
        "gpus": gpus,
        "host_ram_gib": available_gib(),
        "nproc_per_node": nproc,
        "nnodes": int(env_vars.get("NNODES", 1) or 1),
        "packages": {name: importlib.util.find_spec(name) is not None
                     for name in ("flash_attn", "triton")},
    }


def for_plan(machine: dict, world_size: int, device: str):
    """What the planner (kit.budget.plan.Hardware) needs of `machine` (`probe`'s dict, or a rank's
    own GPU described alike) for `world_size` processes on `device` ("cuda" or "cpu"): the
    smallest GPU's memory and its name, FP8 by `fp8`, flash-attn installed, and the node's host
    memory over its processes (None where unknown: not checked)."""
    from kit.budget.fit import Hardware

    if device != "cuda" or not machine.get("gpus"):
        return Hardware("cpu", world_size)
    gpu = min(machine["gpus"], key=lambda g: g["memory_gib"])
    ram = machine.get("host_ram_gib")
    per_node = max(1, int(machine.get("nproc_per_node") or 1))
    return Hardware("cuda", world_size, gpu["memory_gib"], gpu.get("name", ""), fp8(gpu),
                    bool((machine.get("packages") or {}).get("flash_attn")),
                    round(ram / per_node, 1) if ram else None, grouped_gemm(gpu),
                    triton_kernels(gpu, machine.get("packages") or {}))
