"""Notebook 02's instruments: one weight quantized to NF4 and restored (bytes, bits per weight,
error), the 16 levels, and a trained model's weights read one tensor at a time from its
safetensors file against normal ones; a model loaded on this CPU for the kernel's own
measurements. The recipe's loading is kit/recipe/quantize.py."""

from __future__ import annotations

import contextlib
from pathlib import Path

import torch

from kit.inputs import builtin
from kit.recipe.quantize import load_model


def linear4bit_layout(module) -> dict:
    """How a bitsandbytes Linear4bit in a loaded model holds its weight."""
    w = module.weight
    state = w.quant_state
    return {
        "logical_shape": tuple(state.shape),
        "stored_shape": tuple(w.shape),
        "stored_dtype": str(w.dtype).removeprefix("torch."),
        "stored_bytes": w.numel() * w.element_size(),
        "constant_bytes": state_bytes(state),
        "quant_type": state.quant_type,
        "double_quant": bool(state.nested),
        "compute_dtype": str(module.compute_dtype).removeprefix("torch."),
    }


def quantized_bytes(model) -> dict[str, int]:
    """Bytes held by 4-bit packed weights vs everything else (parameters and buffers)."""
    import bitsandbytes as bnb

    packed = sum(
        m.weight.numel() * m.weight.element_size()
        for m in model.modules()
        if isinstance(m, bnb.nn.Linear4bit)
    )
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    return {"packed_4bit": packed, "other": total - packed, "total": total}


def quantize_weight(weight: torch.Tensor, method: str = "nf4", double_quant: bool = True,
                    storage: torch.dtype = torch.uint8):  # fmt: skip
    """(packed, quant_state) for one weight, exactly as bitsandbytes' Linear4bit stores it."""
    import bitsandbytes.functional as F

    return F.quantize_4bit(weight, blocksize=64, compress_statistics=double_quant,
                           quant_type=method, quant_storage=storage)  # fmt: skip


def state_bytes(state, tables: bool = True) -> int:
    """Bytes of a QuantState's constants: per-block scales (absmax; with double quantization the
    8-bit scales, their fp32 scales and offset) and, if `tables`, the fixed lookup tables (16
    values of the 4-bit code; 256 of the 8-bit code for the scales) that cost the same per layer."""
    tensors = [state.absmax] + ([state.code] if tables else [])
    if state.nested:
        tensors += [state.state2.absmax, state.offset] + ([state.state2.code] if tables else [])
    return sum(t.numel() * t.element_size() for t in tensors)


def quantization_report(weight: torch.Tensor, method: str = "nf4", double_quant: bool = True,
                        storage: torch.dtype = torch.uint8) -> dict:  # fmt: skip
    """What quantizing `weight` costs and keeps: storage layout, bytes, bits/param, error."""
    import bitsandbytes.functional as F

    packed, state = quantize_weight(weight, method, double_quant, storage)
    restored = F.dequantize_4bit(packed, state)
    w, r = weight.float(), restored.float()
    scales = state_bytes(state, tables=False)
    packed_bytes = packed.numel() * packed.element_size()
    return {
        "method": method,
        "double_quant": double_quant,
        "storage": str(storage).removeprefix("torch."),
        "packed_shape": tuple(packed.shape),
        "packed_bytes": packed_bytes,
        "scale_bytes": scales,
        "table_bytes": state_bytes(state) - scales,
        "original_bytes": weight.numel() * weight.element_size(),
        # Packed 4 bits + scales; the fixed tables are left out (a few bytes per layer).
        "bits_per_param": 8 * (packed_bytes + scales) / weight.numel(),
        "relative_error": ((r - w).norm() / w.norm()).item(),
        "max_abs_error": (r - w).abs().max().item(),
        "dequantized_dtype": str(restored.dtype).removeprefix("torch."),
    }


def load_on_cpu(name: str = "kit:tiny-llama", method: str = "nf4", storage: str = "auto",
                dtype: str = "bfloat16"):  # fmt: skip
    """A model loaded the recipe's way (from_pretrained + BitsAndBytesConfig), to look at: on the
    CPU even where there is a GPU (a notebook kernel never touches CUDA)."""
    from kit.config import load_config

    cfg = load_config(None, [f"model.name={name}", f"model.dtype={dtype}",
                             f"quantization.method={method}", f"quantization.storage={storage}",
                             "sharding.engine=fsdp2"])  # fmt: skip
    return load_model(cfg, torch.device("cpu"))[0]


def code_values(method: str = "nf4") -> list[float]:
    """The 16 values a 4-bit code can take, as fractions of the block's absmax, sorted."""
    _, state = quantize_weight(torch.zeros(64, dtype=torch.float32) + 1, method, False)
    return sorted(state.code.tolist())


def plot_levels(weight: torch.Tensor, blocksize: int = 64, ax=None):
    """Histogram of the weights divided by their block's absmax, with the NF4 (solid) and FP4
    (dotted) levels they are rounded to."""
    import matplotlib.pyplot as plt

    ax = ax or plt.subplots(figsize=(8, 3))[1]
    blocks = weight.detach().float().reshape(-1, blocksize)
    normalized = (blocks / blocks.abs().amax(dim=1, keepdim=True)).flatten()
    ax.hist(normalized.numpy(), bins=120, density=True, color="0.7")
    for method, style, color in (("nf4", "-", "C0"), ("fp4", ":", "C3")):
        for i, v in enumerate(code_values(method)):
            ax.axvline(v, ls=style, color=color, lw=1, label=method.upper() if i == 0 else None)
    ax.set_xlabel(f"weight / absmax of its block of {blocksize}")
    ax.legend()
    return ax


@contextlib.contextmanager
def one_thread():
    """Run a block on one CPU thread, then restore the count. For the kernel's small tensors a
    second thread buys nothing, and where other processes share the cores OpenMP's waiting
    threads cost much: on a 2-core CPU shared with other processes, one 4-bit training step of the
    tiny model took 2.5 s on two threads and 0.15 s on one."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def tensor_files(model: str) -> dict[str, Path]:
    """Tensor name -> the safetensors file of a model's checkpoint that holds it."""
    files = builtin.checkpoint_files(builtin.resolve(model))
    return {name: Path(file) for name, file in files.items()}


def read_weight(model: str, name: str) -> torch.Tensor:
    """One tensor of a model's safetensors checkpoint, read alone: no model is built."""
    from safetensors import safe_open

    with safe_open(str(tensor_files(model)[name]), "pt") as f:
        return f.get_tensor(name)


def normal_twin(weight: torch.Tensor, seed: int = 0) -> torch.Tensor:
    """Normally distributed weights of the same shape, dtype and standard deviation (seeded)."""
    g = torch.Generator().manual_seed(seed)
    std = weight.float().std()
    return (torch.randn(weight.shape, generator=g) * std).to(weight.dtype)


def excess_kurtosis(x: torch.Tensor, dim=None) -> torch.Tensor:
    """m4 / m2^2 - 3 (central moments, over `dim` or all): 0 for a normal distribution, above 0
    when more of the weight sits in the tails (and near the centre) than a normal puts there."""
    d = x.float() - x.float().mean(dim, keepdim=dim is not None)
    d2 = d.square_()
    return d2.square().mean(dim) / d2.mean(dim) ** 2 - 3


def normality(weight: torch.Tensor, blocksize: int = 64) -> dict:
    """How normal a weight matrix is, as a whole and as NF4 sees it (block by block), and what
    NF4 and FP4 (double quantization) lose on it."""
    blocks = weight.float().reshape(-1, blocksize)
    z = weight.float().flatten()
    z = (z - z.mean()) / z.std()
    return {
        "excess_kurtosis": excess_kurtosis(weight).item(),
        "beyond_3_std_%": 100 * (z.abs() > 3).float().mean().item(),
        f"kurtosis_in_blocks_of_{blocksize}": excess_kurtosis(blocks, dim=1).mean().item(),
        "block_absmax_in_stds": (blocks.abs().amax(1) / blocks.std(1)).mean().item(),
        "nf4_error": quantization_report(weight, "nf4")["relative_error"],
        "fp4_error": quantization_report(weight, "fp4")["relative_error"],
    }


def values_per_block(weight: torch.Tensor, blocksize: int) -> tuple[int, float]:
    """(most, mean) distinct values in a block of `blocksize` consecutive weights: at most 16
    when the weights went through a 4-bit format with that block size."""
    counts = [len(set(b.tolist())) for b in weight.float().reshape(-1, blocksize)]
    return max(counts), sum(counts) / len(counts)


def linear_kurtosis(model: str) -> list[float]:
    """Excess kurtosis of every 2-D weight in the decoder layers of a model's checkpoint, read one
    tensor at a time (embeddings, head and norms left out: bitsandbytes quantizes none of them)."""
    from safetensors import safe_open

    found = []
    with one_thread():
        for name, file in tensor_files(model).items():
            with safe_open(str(file), "pt") as f:
                if ".layers." in name and len(f.get_slice(name).get_shape()) == 2:
                    found.append(excess_kurtosis(f.get_tensor(name)).item())
    return found


def plot_normality(weights: dict[str, torch.Tensor], points: int = 4000):
    """Left: histograms of the standardized weights (log scale) against the normal density;
    right: quantile-quantile plot against the normal (a normal sample lies on the diagonal)."""
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 3.6))
    grid = torch.linspace(-8, 8, 400)
    left.plot(grid, torch.exp(-grid**2 / 2) / (2 * torch.pi) ** 0.5, "k--", lw=1, label="normal")
    probs = (torch.arange(points) + 0.5) / points
    normal_q = torch.distributions.Normal(0, 1).icdf(probs)
    for i, (label, w) in enumerate(weights.items()):
        z = w.float().flatten()
        z = (z - z.mean()) / z.std()
        left.hist(z.numpy(), bins=200, range=(-8, 8), density=True, histtype="step", color=f"C{i}",
                  label=label)  # fmt: skip
        sample = z[:: -(-z.numel() // 2**24)]  # torch.quantile takes at most 2**24 values
        right.plot(normal_q, torch.quantile(sample, probs), ".", ms=2, color=f"C{i}", label=label)
    left.set_yscale("log")
    left.set_ylim(1e-6, 1)
    left.set_xlabel("weight in standard deviations")
    right.plot([-4, 4], [-4, 4], "k--", lw=1)
    right.set_xlabel("normal quantile")
    right.set_ylabel("weight quantile (in stds)")
    for ax in (left, right):
        ax.legend(fontsize=8)
    fig.tight_layout()
    return fig
