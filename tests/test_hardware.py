"""kit.lab.hardware: the probe (run for real in a child process) and how its facts are read."""

from __future__ import annotations

import importlib.util
import subprocess
import sys

import pytest
from conftest import ROOT

from kit.lab import hardware

TOPO_NVLINK = """\
\tGPU0\tGPU1\tCPU Affinity\tNUMA Affinity\tGPU NUMA ID
GPU0\t X \tNV18\t0-63\t0\t\tN/A
GPU1\tNV18\t X \t0-63\t0\t\tN/A

Legend:
  X    = Self
  NV#  = Connection traversing a bonded set of # NVLinks
"""
TOPO_PCIE = """\
        GPU0    GPU1    GPU2    GPU3    CPU Affinity
GPU0     X      PIX     SYS     SYS     0-15
GPU1    PIX      X      SYS     SYS     0-15
GPU2    SYS     SYS      X      PHB     16-31
GPU3    SYS     SYS     PHB      X      16-31
"""


def gpu_info(link: str | None, gpus: int = 2, bf16: bool = True) -> dict:
    """What collect() returns on a GPU machine (shape of the real data, values chosen)."""
    return {
        "cpu": {"model": "x", "cores": 64, "ram_gib": 512.0, "bf16_instructions": True},
        "cuda": {"available": True, "cuda": "13.0", "nccl": "2.27.3", "gpus": [
            {"name": "NVIDIA H100", "memory_gib": 79.2, "capability": "9.0" if bf16 else "7.0",
             "bf16": bf16, "multiprocessors": 132}] * gpus},
        "topology": {"nvidia_smi": True, "topo": "", "gpu0_gpu1": link},
        "attention": {"device": "cuda", "dtype": "bfloat16" if bf16 else "float16", "usable": {
            "eager": True, "sdpa": True, "sdpa_flash": True, "flex_attention": True,
            "flash_attention_2": "the flash-attn package is not installed"}},
        "bitsandbytes": {"installed": True, "devices": {"cpu": (True, ""), "cuda": (True, "")}},
        "packages": {},
    }  # fmt: skip


@pytest.fixture(scope="module")
def info():
    return hardware.report()


def test_probe_on_this_machine(info):
    import torch

    assert info["cuda"]["available"] == torch.cuda.is_available()
    assert hardware.device(info) == ("cuda" if torch.cuda.is_available() else "cpu")
    assert info["cpu"]["cores"] >= 1 and info["cpu"]["ram_gib"] > 0
    assert info["packages"]["torch"] == torch.__version__
    usable = hardware.usable_attention(info)
    assert usable[:2] == ["eager", "sdpa"]
    flash = importlib.util.find_spec("flash_attn") is not None
    assert ("flash_attention_2" in usable) == (flash and torch.cuda.is_available())


def test_attention_is_kit_attention_usable_for_the_device_a_run_gets(info):
    """One probe of what runs here: the report holds kit.recipe.attention.usable's answer (every name
    the config allows, each pinned SDPA kernel tried), for the device and dtype it names."""
    from kit.recipe import attention

    attn = info["attention"]
    assert attn["device"] == hardware.device(info) and attn["dtype"] in ("bfloat16", "float16")
    assert attn["usable"] == attention.usable(attn["device"], attn["dtype"])
    assert list(attn["usable"]) == list(attention.NAMES)
    row = dict(hardware.summary(info))[f"attention ({attn['device']}, {attn['dtype']})"]
    assert row.split(", ") == hardware.usable_attention(info)


def test_bitsandbytes_round_trip_really_ran(info):
    bnb = info["bitsandbytes"]
    assert bnb["installed"] == (importlib.util.find_spec("bitsandbytes") is not None)
    if bnb["installed"]:
        ok, why = bnb["devices"]["cpu"]
        assert ok, why
        error = float(why.rsplit(" ", 1)[-1])
        assert 0.05 < error < 0.15  # NF4 on normal data: ~0.09; 0 would mean nothing was quantized


def test_report_leaves_the_caller_without_torch():
    code = ("import sys, kit.lab.hardware as h; info = h.report(); "
            "print('torch' in sys.modules, info['cpu']['cores'] > 0)")  # fmt: skip
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                         timeout=300, check=True)  # fmt: skip
    assert out.stdout.split() == ["False", "True"]


def test_command_line_prints_summary_and_advice():
    out = subprocess.run([sys.executable, "-m", "kit.lab.hardware"], cwd=ROOT, capture_output=True,
                         text=True, timeout=300, check=True)  # fmt: skip
    assert "attention" in out.stdout and "bitsandbytes 4-bit" in out.stdout
    assert "flash_attention_2" in out.stdout or "GPU" in out.stdout


def test_link_between_reads_nvidia_smi_topo():
    assert hardware.link_between(TOPO_NVLINK) == "NV18"
    assert hardware.link_between(TOPO_PCIE) == "PIX"
    assert hardware.link_between(TOPO_PCIE, 0, 2) == "SYS"
    assert hardware.link_between(TOPO_PCIE, 2, 3) == "PHB"
    assert hardware.link_between("") is None
    underlined = TOPO_NVLINK.replace("\tGPU0\tGPU1", "\t\x1b[4mGPU0\tGPU1", 1).replace(
        "GPU NUMA ID", "GPU NUMA ID\x1b[0m")
    assert hardware.link_between(underlined) == "NV18"
    assert hardware.describe_link("NV18").startswith("NVLink")
    assert hardware.describe_link("SYS").startswith("PCIe across CPU sockets")


def test_advice_follows_the_facts(info):
    nvlink = " ".join(hardware.advice(gpu_info("NV18")))
    assert "NVLink" in nvlink and "bfloat16" in nvlink and "not NVLink" not in nvlink
    pcie = " ".join(hardware.advice(gpu_info("PHB")))
    assert "not NVLink" in pcie and "host bridge" in pcie
    assert "float16" in " ".join(hardware.advice(gpu_info("NV4", bf16=False)))
    assert "flash_attention_2 is not usable" in nvlink
    no_bnb = gpu_info("NV18")
    no_bnb["bitsandbytes"] = {"installed": False, "devices": {}}
    assert "quantization.method=none" in " ".join(hardware.advice(no_bnb))
    if not info["cuda"]["available"]:
        here = " ".join(hardware.advice(info))
        assert "gloo" in here and "kit:tiny-llama" in here


def test_plan_for_nproc():
    assert "two ranks would share a GPU" in hardware.processes(gpu_info("NV18", gpus=2), 4)
    assert "cuda:0..cuda:1" in hardware.processes(gpu_info("NV18", gpus=2), 2)
    cpu = gpu_info(None, gpus=0)
    cpu["cuda"] = {"available": False, "cuda": None, "gpus": []}
    cpu["cpu"]["cores"] = 2
    assert "gloo" in hardware.processes(cpu, 2) and "slow" in hardware.processes(cpu, 4)
