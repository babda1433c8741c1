"""Loading the base model: 4-bit NF4 through bitsandbytes, or unquantized for comparison.

The packed 4-bit weights are stored in a float dtype equal to the model's dtype
(`bnb_4bit_quant_storage`): FSDP flattens and shards all parameters of a unit together and cannot
do that with integer storage or mixed dtypes.

Notebook 02 looks inside: one weight quantized and restored (bytes, bits per weight, error), and a
trained model's weights, read one tensor at a time from its safetensors file, against normal ones.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import torch

from kit.config import Config
from kit.inputs import builtin

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def storage_dtype(cfg: Config) -> torch.dtype:
    q = cfg.quantization
    return (
        torch.uint8
        if q.storage == "uint8"
        else DTYPES[cfg.model.dtype if q.storage == "auto" else q.storage]
    )


def bnb_config(cfg: Config):
    """The BitsAndBytesConfig for cfg, or None when quantization.method is none."""
    from transformers import BitsAndBytesConfig

    q = cfg.quantization
    if q.method == "none":
        return None
    return BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type=q.method,
        bnb_4bit_use_double_quant=q.double_quant,
        bnb_4bit_compute_dtype=DTYPES[cfg.model.dtype],
        bnb_4bit_quant_storage=storage_dtype(cfg),
    )


def params4bit_kwargs(cfg: Config) -> dict:
    """How bitsandbytes' Params4bit quantizes a weight for cfg (what BitsAndBytesConfig sets)."""
    q = cfg.quantization
    return dict(blocksize=64, compress_statistics=q.double_quant, quant_type=q.method,
                quant_storage=storage_dtype(cfg))


def attention_implementation(requested: str) -> tuple[str, str | None]:
    """(implementation to use, warning or None), through kit.recipe.attention.resolve: flash_attention_2
    falls back to sdpa without the flash-attn package (sdpa carries a FlashAttention-2 kernel of
    its own); sdpa_<backend> is registered with transformers under its kit_sdpa_* name."""
    from kit.recipe import attention

    return attention.resolve(requested)


def load_model(cfg: Config, device: torch.device, attn: str | None = None,
               weights: bool = True):  # fmt: skip
    """from_pretrained the base model onto `device`, quantized per cfg; returns (model, tokenizer).
    weights=False: the same model on the meta device from the folder's config alone (a folder
    without weights: kit.inputs.builtin.AT_LOAD), for kit.recipe.loading to fill."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    path = builtin.resolve(cfg.model.name)
    kwargs = dict(
        dtype=DTYPES[cfg.model.dtype],
        attn_implementation=attn or attention_implementation(cfg.attention.implementation)[0],
        trust_remote_code=cfg.model.trust_remote_code,
        quantization_config=bnb_config(cfg),
    )
    # Each rank loads (and quantizes) onto its own device; never device_map="auto" under FSDP.
    # Named on CPU too: without a device_map, transformers puts a 4-bit model on the current GPU
    # whenever there is one, even for a CPU run (or a notebook kernel looking at a layer).
    # On "meta" (kit.recipe.loading: rank0's other ranks, stream): the same modules, nothing read.
    cuda = device.index if device.index is not None else torch.cuda.current_device() \
        if device.type == "cuda" else None  # fmt: skip
    kwargs["device_map"] = {"": cuda if device.type == "cuda" else device.type}
    if weights:
        model = AutoModelForCausalLM.from_pretrained(path, **kwargs)
    else:  # the model class's from_pretrained with an empty state dict: every weight on meta
        from transformers.utils import logging

        config = AutoConfig.from_pretrained(path, trust_remote_code=cfg.model.trust_remote_code)
        kwargs.update(config=config, state_dict={}, device_map={"": "meta"})
        kwargs.pop("trust_remote_code")
        before = logging.get_verbosity()
        logging.set_verbosity_error()  # its report lists every weight as missing: all are
        try:
            cls = AutoModelForCausalLM._model_mapping[type(config)]
            model = cls.from_pretrained(None, **kwargs)
        finally:
            logging.set_verbosity(before)
        if cfg.quantization.method != "none":  # 4-bit weights as from_pretrained leaves them
            import bitsandbytes as bnb  # on meta: Params4bit, not yet quantized (PEFT reads it)

            for m in model.modules():
                if isinstance(m, bnb.nn.Linear4bit) and not isinstance(m.weight, bnb.nn.Params4bit):
                    m.weight = bnb.nn.Params4bit(m.weight.data, requires_grad=False, module=m,
                                                 **params4bit_kwargs(cfg))
    keep_packing(model)
    tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=cfg.model.trust_remote_code)
    return model, tokenizer


def keep_packing(model) -> int:
    """Switch off bitsandbytes' CPU inference repacking; returns the 4-bit layers it covered.

    On a CPU with AVX512-BF16, an eval-mode forward without gradients rewrites each 4-bit weight
    in place into a CPU-only layout (`packing_format_for_cpu`). Under FSDP1 those weights are views
    into a flat parameter in the model dtype, and saving then fails in bitsandbytes
    (`assert packed_weight.dtype == torch.uint8`); under any engine the weights would no longer be
    what the GPUs hold. The layout is only an inference speed-up: training keeps the plain one."""
    import bitsandbytes as bnb

    layers = [m for m in model.modules() if isinstance(m, bnb.nn.Linear4bit)]
    for m in layers:
        m.support_avx512bf16_for_cpu = False
    return len(layers)


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


# --------------------------------------------------------------------------- looking inside (02)


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


# --------------------------------------------------------------------------- real weights (02)


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
