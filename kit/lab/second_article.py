"""The second article (FSDP + LoRA fine-tuning on Kubernetes, accelerate + TRL), as data: its
settings set beside what kit.run.jobs writes, and its numbers recomputed with the kit's shape and
memory math. Notebook 10 shows each table; nothing here is quoted, every value is restated.

    accelerate_table({"kit": yaml.safe_load(open(DIR / "accelerate.yaml"))})
    launch_table(RunFolder(DIR).run_sh.read_text())
    weight_claims(), budget_table(), env_search("NCCL_TIMEOUT"), gather_traffic(100, 450, 400)

Kernel side: no torch. The torch files are searched as files (found without importing torch).
"""

from __future__ import annotations

import importlib.util
import mmap
import re
from pathlib import Path

from kit.budget.estimate import DTYPE_BYTES, Setup, estimate, quantized_bytes_per_param
from kit.budget.shapes import flops_per_token, lora_params, shape_of
from kit.folder.layout import RunFolder

# --------------------------------------------------------------------------- accelerate

# The article's accelerate config, key by key (fsdp_config's keys flattened). It names no
# fsdp_version: accelerate then runs FSDP1.
ACCELERATE = {
    "distributed_type": "FSDP", "fsdp_version": None, "mixed_precision": "bf16",
    "num_machines": 2, "num_processes": 2, "machine_rank": 0, "main_training_function": "main",
    "fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP", "fsdp_sharding_strategy": "FULL_SHARD",
    "fsdp_backward_prefetch": "BACKWARD_PRE", "fsdp_forward_prefetch": False,
    "fsdp_offload_params": False, "fsdp_use_orig_params": True,
    "fsdp_cpu_ram_efficient_loading": True, "fsdp_sync_module_states": True,
    "fsdp_state_dict_type": "FULL_STATE_DICT",
}
# What each key does, and why the kit's value differs where it does.
ACCELERATE_NOTES = {
    "fsdp_version": "absent means FSDP1; the kit writes 2 for sharding.engine=fsdp2 (per-parameter "
                    "sharding: frozen and trainable weights may share a layer), 1 for fsdp1",
    "num_processes": "processes over all machines: 2 on 2 machines is one GPU each, so the two "
                     "GPUs never share NVLink",
    "machine_rank": "each node passes its own: --machine_rank",
    "main_training_function": "read by accelerate's TPU launchers only",
    "fsdp_auto_wrap_policy": "one FSDP unit per decoder layer, the class the model names in "
                             "_no_split_modules",
    "fsdp_sharding_strategy": "FSDP1's name; under FSDP2 it is fsdp_reshard_after_forward",
    "fsdp_backward_prefetch": "FSDP1: gather the next layer during backward; FSDP2 prefetches "
                              "by itself",
    "fsdp_use_orig_params": "FSDP1 needs it to train part of a layer; FSDP2 always keeps the "
                            "original parameters",
    "fsdp_cpu_ram_efficient_loading": "meant to load on one process: transformers tests "
                                      "LOCAL_RANK == 0, so on 2 machines x 1 GPU both load; the "
                                      "kit's model.loading=rank0 (section 3)",
    "fsdp_sync_module_states": "FSDP1 broadcasts rank 0's weights at wrapping; 4-bit weights "
                               "would travel without their quantization state",
    "fsdp_state_dict_type": "checkpoints: the kit writes sharded ones (every rank its part); "
                            "the adapter is gathered whole and read back at every save",
    "fsdp_activation_checkpointing": "not in the article: each layer recomputed in backward",
    "fsdp_reshard_after_forward": "FSDP2: free each gathered layer after forward, gather it "
                                  "again in backward (FSDP1's FULL_SHARD)",
}


def _flat(tree: dict) -> dict:
    return {**{k: v for k, v in tree.items() if k != "fsdp_config"}, **tree.get("fsdp_config", {})}


def accelerate_table(generated: dict[str, dict]) -> list[dict]:
    """One row per key of the article's config or of a generated one (label -> accelerate.yaml
    as a dict): the article's value, each generated value ('-': not set) and what it means."""
    flat = {label: _flat(tree) for label, tree in generated.items()}
    keys = list(dict.fromkeys([*ACCELERATE, *(k for t in flat.values() for k in t)]))
    skip = {"compute_environment", "use_cpu", "debug", "main_process_ip", "main_process_port"}
    rows = []
    for key in (k for k in keys if k not in skip):
        row = {"key": key, "article": _show(ACCELERATE.get(key, "-"))}
        row.update({label: _show(t.get(key, "-")) for label, t in flat.items()})
        row["what it does"] = ACCELERATE_NOTES.get(key, "")
        rows.append(row)
    return rows


def _show(value) -> str:
    if value is None:
        return "(not set)"
    return str(value).lower() if isinstance(value, bool) else str(value)


# --------------------------------------------------------------------------- the launch script

# (what, the article's launch script, a pattern finding the line of the kit's run.sh that does it)
LAUNCH = [
    ("node rank", "RANK (a PyTorchJob's pod index), default 0, as --machine_rank; torchrun's "
     "RANK is a process's",
     r"^NODE_RANK=.*"),
    ("node 0's address", "MASTER_ADDR, default localhost", r"^MASTER_ADDR=.*"),
    ("port", "MASTER_PORT, default 29500", r"^MASTER_PORT=.*"),
    ("nodes x processes", "fixed on the command line: 2 machines, 2 processes", r"^NNODES=.*"),
    ("rendezvous", "accelerate's, at the master address", r"--rdzv-backend=c10d.*"),
    ("collective timeout", "raise NCCL_TIMEOUT", r"^DIST_TIMEOUT_MIN=.*"),
    ("tokenizers", "TOKENIZERS_PARALLELISM=false", r"^export TOKENIZERS_PARALLELISM.*"),
    ("allocator", "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True",
     r"^export PYTORCH_CUDA_ALLOC_CONF.*"),
    ("software", "pip install (unpinned, torchao -U) at every start", r"^PYTHON=.*"),
    ("GPU check", "nvidia-smi inventory and NVLink status", r"nvidia-smi --query-gpu.*"),
    ("before any rank", "nothing", r"-m kit\.run\.check .*"),
]


def launch_table(run_sh: str, width: int = 80) -> list[dict]:
    """The article's launch script beside the line of a generated run.sh doing the same."""
    rows = []
    for what, article, pattern in LAUNCH:
        m = re.search(pattern, run_sh, re.M)
        line = m.group(0).split("  #")[0].strip() if m else "-"
        line = re.sub(r"(\$\{PYTHON:-)[^}]*\}", r"\1<this python>}", line)  # no machine's path
        rows.append({"what": what, "article": article,
                     RunFolder.RUN_SH: line if len(line) <= width else line[:width - 3] + "..."})
    return rows


# --------------------------------------------------------------------------- its numbers

# An 11B decoder with Mistral's layout (the article gives no config): Mistral-NeMo's layer shape
# with Mistral's 32k vocabulary, 11.2B parameters.
MODEL = dict(model_type="mistral", vocab_size=32768, hidden_size=5120, intermediate_size=14336,
             num_hidden_layers=40, num_attention_heads=32, num_key_value_heads=8, head_dim=128)
# Its training setup: bf16 weights (no quantization), LoRA r=8 on the attention projections,
# FSDP1 on 2 GPUs, per-device batch 4 x 4096 tokens, flash attention, no checkpointing.
SETUP = Setup(world_size=2, engine="fsdp1", quantization="none", dtype="bfloat16", lora_r=8,
              lora_targets=("q_proj", "k_proj", "v_proj", "o_proj"), batch_size=4,
              seq_len=4096, recompute=False, attention="sdpa")
# Its per-GPU budget, GB, item by item (its total: ~36).
BUDGET = {"model shard": 22, "LoRA adapters": 0.052, "optimizer states": 0.208,
          "activations": 8, "NCCL buffers": 2, "KV cache": 4}
# Which estimator term each item is (None: not a term of a training step's allocated memory).
TERMS = {"model shard": "base weights", "LoRA adapters": "LoRA weights",
         "optimizer states": "optimizer (AdamW m, v)", "activations": "activations",
         "NCCL buffers": None, "KV cache": None}
GB = 1e9  # the article counts in GB


def weight_claims(model=MODEL, world: int = 2) -> list[dict]:
    """The article's weight sizes against parameters x bytes."""
    n = shape_of(model).params
    return [
        {"what": "parameters", "article": "11B", "computed": f"{n / 1e9:.2f}B"},
        {"what": "weights in fp16 (2 bytes each)", "article": "~44 GB",
         "computed": f"{2 * n / GB:.1f} GB"},
        {"what": "44 GB would be", "article": "",
         "computed": f"{44e9 / n:.1f} bytes per parameter"},
        {"what": f"one GPU's shard of {world}", "article": "~22 GB",
         "computed": f"{2 * n / world / GB:.1f} GB"},
        {"what": "the checkpoint rank 0 reads", "article": "238 GB",
         "computed": f"238 GB is {238e9 / 2 / 1e9:.0f}B bf16 parameters"},
    ]


def budget_table(model=MODEL, setup: Setup = SETUP) -> list[dict]:
    """The article's per-GPU items (GB) beside the kit's estimate of the same setup without and
    with activation checkpointing (TRL's SFTConfig turns it on unless told otherwise)."""
    runs = {"kit, no checkpointing": estimate(model, setup),
            "kit, checkpointing": estimate(model, setup, recompute=True)}
    rows, used = [], set()
    for item, gb in BUDGET.items():
        term = TERMS[item]
        used.add(term)
        rows.append({"item": item, "article GB": gb,
                     **{k: round(e.parts[term] / GB, 2) if term else "-" for k, e in runs.items()}})
    for term in [t for t in next(iter(runs.values())).parts if t not in used]:
        rows.append({"item": term, "article GB": "-",
                     **{k: round(e.parts.get(term, 0) / GB, 2) for k, e in runs.items()}})
    rows.append({"item": "total", "article GB": round(sum(BUDGET.values()), 1),
                 **{k: round(e.total / GB, 1) for k, e in runs.items()}})
    return rows


# --------------------------------------------------------------------------- NCCL_TIMEOUT


def torch_dir() -> Path:
    """The installed torch package's folder, found without importing it."""
    return Path(importlib.util.find_spec("torch").submodule_search_locations[0])


HEADER = "include/torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp"


def env_search(name: str, where: Path | None = None) -> dict[str, int]:
    """Whole-word occurrences of `name` in torch's Python files, its shared libraries and
    ProcessGroupNCCL's header (where its environment variables are declared), and the count of
    files searched."""
    where = where or torch_dir()
    python = list(where.rglob("*.py"))
    libraries = [p for p in where.rglob("*.so*") if p.is_file()]
    return {"python files searched": len(python), "libraries searched": len(libraries),
            "in python files": sum(_count_word(p, name) for p in python),
            "in libraries": sum(_count_word(p, name) for p in libraries),
            "in ProcessGroupNCCL.hpp": _count_word(where / HEADER, name)}


def _count_word(path: Path, name: str) -> int:
    """Occurrences of `name` in the file not inside a longer identifier (A-Z, a-z, 0-9, _)."""
    needle, count = name.encode(), 0
    with open(path, "rb") as f:
        if not path.stat().st_size:
            return 0
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
            at = m.find(needle)
            while at != -1:
                end = at + len(needle)
                before, after = m[at - 1:at] if at else b"", m[end:end + 1]
                count += not (re.match(rb"\w", before) or re.match(rb"\w", after))
                at = m.find(needle, at + 1)
    return count


def nccl_variables(word: str = "", where: Path | None = None) -> list[tuple[str, str]]:
    """(variable, what the header's comment says) for every environment variable
    ProcessGroupNCCL declares (name and its deprecated aliases), keeping those containing `word`."""
    text = ((where or torch_dir()) / HEADER).read_text()
    found = []
    declared = r"((?://[^\n]*\n)*)static std::vector<std::string>\s*\w+\s*=\s*\{([^}]*)\}"
    for m in re.finditer(declared, text):
        comment = " ".join(line.strip()[2:].strip() for line in m.group(1).splitlines())
        for name in re.findall(r'"(\w+)"', m.group(2)):
            if word in name:
                found.append((name, comment))
    return found


def default_timeouts(where: Path | None = None) -> dict[str, float]:
    """Minutes of the collective timeout a process group gets when init_process_group is given
    none, as torch's C++ headers define them: NCCL's, and every other backend's (gloo)."""
    c10d = (where or torch_dir()) / "include/torch/csrc/distributed/c10d"
    out = {}
    for backend, file, const in (
            ("nccl", "ProcessGroupNCCL.hpp", "kProcessGroupNCCLDefaultTimeout"),
            ("gloo and others", "Backend.hpp", "kBackendDefaultTimeout")):
        m = re.search(const + r"\s*=\s*std::chrono::milliseconds\(([\d\s*]+)\)",
                      (c10d / file).read_text())
        ms = 1
        for factor in m.group(1).split("*"):
            ms *= int(factor)
        out[backend] = ms / 60_000
    return out


# --------------------------------------------------------------------------- the network


def gathered_bytes(model, quantized: bool, world: int, setup: Setup = SETUP) -> float:
    """Bytes one rank receives in one forward + backward under full sharding: every decoder
    layer all-gathered twice (forward, then again in backward after resharding), the root unit
    (embeddings, head, final norm) once; of each it already holds 1/world."""
    shape = shape_of(model)
    a = DTYPE_BYTES[setup.dtype]
    per = quantized_bytes_per_param("nf4", True) if quantized else a
    lora = lora_params(shape, setup.lora_r, setup.lora_targets) / shape.layers * setup.adapter_bytes
    layer = shape.layer_linear_params * per + 2 * shape.hidden * a + lora
    root = (shape.embedding_params + shape.hidden) * a
    return (world - 1) / world * (2 * shape.layers * layer + root)


def gather_traffic(network_gbit: float, nvlink_gbyte: float, gpu_tflops: float, model=MODEL,
                   setup: Setup = SETUP) -> list[dict]:
    """Per micro-step (one forward + backward of batch x seq tokens) on 2 GPUs: GB each rank
    receives, and seconds at the network's and at NVLink's bandwidth, beside the step's model
    FLOPs at gpu_tflops; and the whole model sent once from rank 0 (rank-0 loading)."""
    shape = shape_of(model)
    compute = flops_per_token(shape, setup.seq_len) * setup.batch_size * setup.seq_len
    seconds = compute / (gpu_tflops * 1e12)
    network, nvlink = network_gbit / 8 * GB, nvlink_gbyte * GB
    rows = []
    for what, size in (
            ("all-gathers, bf16 weights (the article)", gathered_bytes(model, False, 2, setup)),
            ("all-gathers, NF4 weights (the kit)", gathered_bytes(model, True, 2, setup)),
            ("rank 0 sends the bf16 model once (load)", shape.params * DTYPE_BYTES[setup.dtype])):
        rows.append({"traffic": what, "GB per rank": round(size / GB, 1),
                     "s over the network": round(size / network, 2),
                     "s over NVLink": round(size / nvlink, 3),
                     "s of compute per micro-step": round(seconds, 2) if "all" in what else "-"})
    return rows


def who_loads(nnodes: int, nproc: int) -> list[dict]:
    """Per process: whether it reads the checkpoint under accelerate's cpu_ram_efficient_loading
    (transformers' test is LOCAL_RANK == 0: one process per node) and under the kit's
    model.loading=rank0 (global rank 0; the others receive every tensor from it)."""
    return [{"rank": node * nproc + local, "node": node, "local rank": local,
             "accelerate's flag": "reads" if local == 0 else "meant to skip",
             "kit rank0": "reads" if node + local == 0 else "receives from rank 0"}
            for node in range(nnodes) for local in range(nproc)]
