"""What this machine offers for QLoRA fine-tuning, and what that means for the config.

    info = report()            # a dict; the probing runs in a child process
    for line in advice(info): print(line)

Kernel side: `report()` runs `collect()`, the probe itself, in a child process (kit.run.child), so
the notebook kernel never imports torch, never initialises CUDA and can still start torchrun (or
fork) safely afterwards. Which attention implementations run here is kit.recipe.attention.usable's answer
(the one probe of that), for the device and dtype a run would use. The machine a start checks and
plans for, and the rules read from it (FP8, grouped GEMMs): kit.budget.machine.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import platform
import re
import shutil
import subprocess

PACKAGES = ("torch", "transformers", "peft", "bitsandbytes", "accelerate", "flash-attn")
# Connection kinds in `nvidia-smi topo -m`, fastest first.
LINKS = {
    "NV": "NVLink",
    "PIX": "PCIe, one switch",
    "PXB": "PCIe, several switches",
    "PHB": "PCIe through the CPU's host bridge",
    "NODE": "PCIe across host bridges of one CPU socket",
    "SYS": "PCIe across CPU sockets",
}


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def _cpu() -> dict:
    flags: set[str] = set()
    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags") and not flags:
                    flags = set(line.split(":", 1)[1].split())
                elif line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
    except OSError:
        pass
    try:
        ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    except (ValueError, OSError, AttributeError):
        ram = None
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return {
        "model": model,
        "cores": cores,
        "ram_gib": round(ram, 1) if ram else None,
        # Native bf16 matmul instructions; without them bf16 on CPU is emulated (~4x slower).
        "bf16_instructions": bool(flags & {"avx512_bf16", "amx_bf16"}),
    }


def link_between(topo: str, a: int = 0, b: int = 1) -> str | None:
    """The connection between GPU a and GPU b in `nvidia-smi topo -m` output, e.g. 'NV18'."""
    topo = re.sub(r"\x1b\[[0-9;]*m", "", topo)  # some versions underline the header
    header, rows = None, {}
    for line in topo.splitlines():
        cells = line.split()
        if header is None and line[:1].isspace() and "GPU0" in cells:
            header = cells  # the column labels: GPU0 GPU1 ... CPU Affinity ...
        elif header is not None and cells and re.fullmatch(r"GPU\d+", cells[0]):
            rows[cells[0]] = dict(zip(header, cells[1:], strict=False))  # affinity columns
    return rows.get(f"GPU{a}", {}).get(f"GPU{b}")


def describe_link(code: str | None) -> str:
    if not code:
        return "unknown"
    for prefix, words in LINKS.items():
        if code.startswith(prefix):
            return f"{words} ({code})"
    return code


def _gpus() -> dict:
    import torch

    out: dict = {"available": torch.cuda.is_available(), "cuda": torch.version.cuda, "gpus": []}
    if not out["available"]:
        return out
    for i in range(torch.cuda.device_count()):
        p = torch.cuda.get_device_properties(i)
        out["gpus"].append({
            "name": p.name,
            "memory_gib": round(p.total_memory / 2**30, 1),
            "capability": f"{p.major}.{p.minor}",
            "bf16": p.major >= 8,  # Ampere and newer compute bf16 natively
            "multiprocessors": p.multi_processor_count,
        })  # fmt: skip
    out["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
    return out


def _topology() -> dict:
    if shutil.which("nvidia-smi") is None:
        return {"nvidia_smi": False, "topo": "", "gpu0_gpu1": None}
    try:
        topo = subprocess.run(["nvidia-smi", "topo", "-m"], capture_output=True, text=True,
                              timeout=30).stdout  # fmt: skip
    except (OSError, subprocess.SubprocessError) as e:
        topo = f"nvidia-smi topo -m failed: {e}"
    return {"nvidia_smi": True, "topo": topo, "gpu0_gpu1": link_between(topo)}


def _attention(gpus: dict) -> dict:
    """kit.recipe.attention.usable for what `training.device: auto` and the advised dtype pick here."""
    from kit.recipe import attention

    where = "cuda" if gpus["available"] else "cpu"
    dtype = "bfloat16" if all(g["bf16"] for g in gpus["gpus"]) else "float16"
    return {"device": where, "dtype": dtype, "usable": attention.usable(where, dtype)}


def _bitsandbytes(cuda: bool) -> dict:
    """Which devices can run a 4-bit quantize -> dequantize round trip."""
    if importlib.util.find_spec("bitsandbytes") is None:
        return {"installed": False, "devices": {}}
    import torch

    try:
        import bitsandbytes as bnb
        import bitsandbytes.functional as F
    except Exception as e:  # a broken native library raises at import
        return {"installed": True, "error": f"{type(e).__name__}: {e}", "devices": {}}
    out = {"installed": True, "native_backend": getattr(bnb.cextension, "BNB_BACKEND", None),
           "devices": {}}  # fmt: skip
    for device in ["cpu"] + (["cuda"] if cuda else []):
        try:
            w = torch.randn(64, 64, device=device, dtype=torch.bfloat16)
            packed, state = F.quantize_4bit(w, quant_type="nf4", quant_storage=torch.bfloat16)
            err = (F.dequantize_4bit(packed, state) - w).float().norm() / w.float().norm()
            out["devices"][device] = (True, f"NF4 round trip, relative error {err.item():.3f}")
        except Exception as e:
            out["devices"][device] = (False, f"{type(e).__name__}: {str(e)[:200]}")
    return out


def collect() -> dict:
    """Probe this process's view of the machine (imports torch; may initialise CUDA)."""
    gpus = _gpus()
    return {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "packages": {p: _version(p) for p in PACKAGES},
        "cpu": _cpu(),
        "cuda": gpus,
        "topology": _topology(),
        "attention": _attention(gpus),
        "bitsandbytes": _bitsandbytes(gpus["available"]),
    }


def report(timeout: int = 300) -> dict:
    """collect() in a child process (the caller never touches CUDA); JSON round trip, so the
    (ok, why) pairs arrive as lists."""
    from kit.run import child

    return child.call("kit.lab.hardware:collect", timeout=timeout)


def device(info: dict) -> str:
    """What `training.device: auto` picks here."""
    return "cuda" if info["cuda"]["available"] else "cpu"


def usable_attention(info: dict) -> list[str]:
    """The implementations that ran here (kit.recipe.attention.usable), in the config's order."""
    return [name for name, ok in info["attention"]["usable"].items() if ok is True]


def processes(info: dict, nproc: int) -> str:
    """What `torchrun --nproc_per_node=NPROC` would get on this machine."""
    gpus, cores = len(info["cuda"]["gpus"]), info["cpu"]["cores"]
    if gpus:
        if nproc > gpus:
            return f"nproc={nproc} but {gpus} GPU(s): two ranks would share a GPU; use nproc <= {gpus}"
        return f"nproc={nproc}: one rank per GPU (cuda:0..cuda:{nproc - 1}), NCCL between them"
    share = "one core each" if nproc <= cores else f"{nproc} ranks share {cores} cores: slow"
    return f"nproc={nproc}: CPU ranks talking over gloo, OMP_NUM_THREADS=1, {share}"


def summary(info: dict) -> list[tuple[str, str]]:
    """(item, value) rows for a table."""
    cpu, cuda = info["cpu"], info["cuda"]
    rows = [
        ("CPU", f"{cpu['model']}, {cpu['cores']} cores, {cpu['ram_gib']} GiB RAM"),
        ("CPU bf16 instructions", "yes" if cpu["bf16_instructions"] else "no (bf16 is emulated)"),
        ("CUDA", f"{cuda['cuda']} ({len(cuda['gpus'])} GPUs)" if cuda["available"] else "none"),
    ]
    for i, g in enumerate(cuda["gpus"]):
        rows.append((f"GPU {i}", f"{g['name']}, {g['memory_gib']} GiB, sm {g['capability']}, "
                                 f"bf16 {'yes' if g['bf16'] else 'no'}"))  # fmt: skip
    if len(cuda["gpus"]) > 1:
        rows.append(("GPU0 <-> GPU1", describe_link(info["topology"]["gpu0_gpu1"])))
    attn = info["attention"]
    rows.append((f"attention ({attn['device']}, {attn['dtype']})",
                 ", ".join(usable_attention(info))))  # fmt: skip
    bnb = info["bitsandbytes"]
    ok = [d for d, (good, _) in bnb.get("devices", {}).items() if good]
    rows.append(("bitsandbytes 4-bit", ", ".join(ok) if ok else "not usable"))
    rows += [(name, v or "not installed") for name, v in info["packages"].items()]
    return rows


def advice(info: dict) -> list[str]:
    """What the facts mean for a QLoRA config on this machine, one sentence each."""
    cpu, cuda, gpus = info["cpu"], info["cuda"], info["cuda"]["gpus"]
    lines = []
    if not cuda["available"]:
        lines.append(
            "No CUDA GPU: ranks are CPU processes talking over gloo; use the kit's tiny models "
            "(kit:tiny-llama) to learn the mechanics, then the same config on GPUs."
        )
        if not cpu["bf16_instructions"]:
            lines.append(
                "This CPU has no bf16 instructions: bf16 matmuls are emulated (~4x slower than "
                "fp32); fine for tiny models, use model.dtype=float32 above ~40M parameters."
            )
        lines.append(f"Processes: up to {cpu['cores']} (one per core) with --nproc_per_node.")
    else:
        lines.append(f"{len(gpus)} GPU(s): one torchrun process per GPU, NCCL between them.")
        if all(g["bf16"] for g in gpus):
            lines.append("Every GPU computes bf16: model.dtype=bfloat16 (and bf16 quant storage).")
        else:
            lines.append("A GPU without bf16 (before Ampere): use model.dtype=float16.")
        smallest = min(g["memory_gib"] for g in gpus)
        lines.append(
            f"Smallest GPU: {smallest} GiB; check a model against it with "
            "kit.budget.estimate.estimate(...).fits(gib) before launching (notebook 01)."
        )
        link = info["topology"]["gpu0_gpu1"]
        if len(gpus) > 1 and link and not link.startswith("NV"):
            lines.append(
                f"GPUs talk over {describe_link(link)}, not NVLink: FSDP's all-gathers cost more; "
                "larger batches (more compute per gather) hide them better."
            )
        elif len(gpus) > 1 and link:
            lines.append(f"GPUs are linked by NVLink ({link}): FSDP's all-gathers are cheap.")
    if info["attention"]["usable"]["flash_attention_2"] is not True:
        lines.append(
            "flash_attention_2 is not usable here; attention.implementation=sdpa runs the same "
            "algorithm through PyTorch's own kernels (the kit falls back to it with a warning)."
        )
    bnb = info["bitsandbytes"]
    if not bnb["installed"]:
        lines.append("bitsandbytes is not installed: only quantization.method=none can run.")
    else:
        for dev, (good, why) in bnb["devices"].items():
            if not good:
                lines.append(f"bitsandbytes 4-bit does not run on {dev}: {why}")
    return lines


if __name__ == "__main__":  # python -m kit.lab.hardware: the same report, in a terminal
    info = collect()
    for item, value in summary(info):
        print(f"{item:<24} {value}")
    print()
    print("\n".join(advice(info)))
