"""Where a model's weights are in its checkpoint, how a tensor is read from it, and expert stacks
read a chunk of experts at a time (kit.recipe.loading's Source: model.loading = stream, rank0;
rank side).

Published mixture-of-experts checkpoints (Qwen3-MoE, Mixtral, OLMoE, DeepSeek-style, ...) store
one tensor per expert (`mlp.experts.3.gate_proj.weight`, Mixtral's
`block_sparse_moe.experts.3.w1.weight`), and transformers' own `save_pretrained` writes them so;
the model keeps each layer's experts fused (`gate_up_proj` (E, 2I, H), `down_proj` (E, H, I)) and
transformers converts while loading, by its conversion mapping (transformers.conversion_mapping:
WeightRenaming, WeightConverter with MergeModulelist, Concatenate, Transpose). Here:

- `placement`: for every parameter and buffer of the model, what makes it: one checkpoint tensor (under
  its own name or renamed), or a WeightConverter over several (each expert's gate_proj and up_proj
  -> gate_up_proj). transformers' own `rename_source_key` decides, with the mapping transformers
  applies to this model (`get_model_conversion_mapping`), so every family it converts is read as
  from_pretrained reads it (the same order of experts, of gate and up, the same transposes).
- `stack_chunks`: an expert stack as chunks of experts (E0:E1, a, b) on the host: read from a
  fused tensor by byte range, or per expert, converted by the converter's own operations run on
  the chunk's tensors where those operations act on each expert alone (stacking along experts,
  concatenating or transposing within one); other converters run once on the whole stack.
- `quantize_chunks`: each chunk moved to the device and quantized there; the packed bytes and the
  per-block scales joined, then the scales double-quantized over the whole stack as bitsandbytes
  does: bit for bit Params4bit's quantization of the whole (E*out, in) stack (kit.recipe.experts),
  with at most one chunk of experts in full precision on the device.

Host peak, per stack: one chunk (CHUNK_BYTES of the stack in model dtype) and its converted copy,
for fused tensors and converters that act per expert (every MoE family the kit trains: Mixtral,
Qwen3-MoE, OLMoE per expert, gpt-oss fused); a converter that does not (Qwen3-VL-MoE's
Transpose(check_dims), Inkling's Interleave) runs on the whole stack: up to twice the stack.

Gaps filled by hand: transformers converts a whole checkpoint into a whole model (its
`convert_and_load_state_dict_in_model`), with no "this parameter, a chunk of experts at a time";
bitsandbytes quantizes a whole tensor, its double quantization needing every block's scale.
"""

from __future__ import annotations

import types
from dataclasses import dataclass, field

import torch

from kit.config import ConfigError

CHUNK_BYTES = 256 * 2**20  # an expert stack's full-precision bytes on the device at a time


@dataclass
class Made:
    """What makes one tensor of the model: `key`, one checkpoint tensor; or `converter` (a
    transformers WeightConverter) over `sources`: {its source pattern: checkpoint keys, in the
    order transformers collects them (natural order: expert 0, 1, ...)}."""

    key: str = ""
    converter: object = None
    sources: dict[str, list[str]] = field(default_factory=dict)


def placement(model: torch.nn.Module, names) -> dict[str, Made]:
    """Model state-dict key -> Made, for the checkpoint tensor `names`: what transformers'
    from_pretrained would put in each (its renamings, then at most one converter per key, and its
    base_model_prefix added or dropped). A converter with several targets (one tensor split into
    q, k, v) is left out: its parameters count as missing (kit.recipe.loading loads in full)."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import (
        WeightConverter,
        WeightRenaming,
        dot_natural_key,
        rename_source_key,
    )

    mapping = get_model_conversion_mapping(model)
    renamings = [m for m in mapping if isinstance(m, WeightRenaming)]
    converters = [m for m in mapping if isinstance(m, WeightConverter)]
    by_pattern = {p: c for c in converters for p in c.source_patterns}
    meta = model.state_dict()
    made: dict[str, Made] = {}
    for key in sorted(names, key=dot_natural_key):
        renamed, pattern = rename_source_key(key, renamings, converters, model.base_model_prefix,
                                             meta)  # fmt: skip
        if renamed not in meta and key in meta:  # as transformers: kept under its own name
            renamed, pattern = key, None
        if renamed not in meta:
            continue
        if pattern is None:
            made[renamed] = Made(key=key)
        elif len(by_pattern[pattern].target_patterns) == 1:
            entry = made.setdefault(renamed, Made(converter=by_pattern[pattern]))
            entry.sources.setdefault(pattern, []).append(key)
    return made


def per_expert_ops(converter) -> bool:
    """Whether every operation of `converter` acts on each expert alone (dim 0: the experts), so
    that running it on a chunk of experts gives that chunk of the result."""
    from transformers.core_model_loading import Concatenate, MergeModulelist, Transpose

    def alone(op) -> bool:
        if isinstance(op, MergeModulelist):
            return op.dim == 0
        if isinstance(op, Concatenate):
            return op.dim >= 1
        if isinstance(op, Transpose):
            return min(op.dim0, op.dim1) >= 1 and not op.check_dims
        return False

    return all(alone(op) for op in converter.operations)


def convert(made: Made, tensors: dict[str, list[torch.Tensor]], target: str, shape,
            config) -> torch.Tensor:  # fmt: skip
    """The converter's own operations, in turn, on {source pattern: tensors}: the one target,
    whose shape in the model is `shape` (what Transpose(check_dims) compares against)."""
    conv = made.converter
    for op in conv.operations:
        tensors = op.convert(tensors, source_patterns=conv.source_patterns,
                             target_patterns=conv.target_patterns, full_layer_name=target,
                             model=_Target(shape), config=config)  # fmt: skip
    (value,) = tensors.values()
    return value[0] if isinstance(value, list) else value


class _Target:
    """What transformers' operations read of the model: the target parameter (its shape). Gap
    filled: they take the whole model, which here may already be wrapped by PEFT (other names)."""

    def __init__(self, shape):
        self.shape = torch.Size(shape)

    def get_parameter(self, name: str) -> torch.Tensor:
        return torch.empty(self.shape, device="meta")


def stack_chunks(source, made: Made, target: str, shape, dtype):
    """The expert stack `target` (logical `shape`, (E, a, b)) as host tensors of consecutive
    experts in `dtype`, each at most CHUNK_BYTES (one expert at least). `source`: the Source
    whose plain reads (`_read`) fetch the checkpoint's bytes."""
    experts = shape[0]
    per_expert = max(1, torch.Size(shape[1:]).numel() * torch.empty((), dtype=dtype).element_size())
    step = max(1, CHUNK_BYTES // per_expert)
    cpu = torch.device("cpu")
    if made.converter is None:  # fused in the checkpoint: a byte range per chunk
        for first in range(0, experts, step):
            last = min(first + step, experts)
            yield source._read(made.key, dtype, device=cpu, rows=(first, last))
        return
    whole = all(len(keys) == experts for keys in made.sources.values())
    if whole and per_expert_ops(made.converter):
        for first in range(0, experts, step):
            last = min(first + step, experts)
            part = {p: [source._read(k, dtype, device=cpu) for k in keys[first:last]]
                    for p, keys in made.sources.items()}  # fmt: skip
            yield convert(made, part, target, (last - first, *shape[1:]), source.config)
        return
    every = {p: [source._read(k, dtype, device=cpu) for k in keys]
             for p, keys in made.sources.items()}  # fmt: skip
    value = convert(made, every, target, shape, source.config)
    del every
    if tuple(value.shape) != tuple(shape):
        raise RuntimeError(f"model.loading: {target} converts to {tuple(value.shape)}, the model "
                           f"holds {tuple(shape)}; use model.loading=full")
    for first in range(0, experts, step):
        yield value[first:first + step]


def quantize_chunks(module: torch.nn.Module, name: str, chunks, shape, dtype, kwargs: dict,
                    device: torch.device) -> None:  # fmt: skip
    """Replace module.<name> by its NF4 stack laid out (E*out, in), as
    kit.recipe.experts.quantize_weight does with the whole stack, from `chunks` of its logical
    `shape` (host tensors, consecutive experts), each quantized on `device`."""
    import bitsandbytes as bnb
    import bitsandbytes.functional as F

    from kit.recipe import experts

    count, a, b = shape
    out, inn = (b, a) if module.is_transposed else (a, b)
    block, storage = kwargs["blocksize"], torch.empty((), dtype=kwargs["quant_storage"])
    if (out * inn) % block or (out * inn) % (2 * storage.element_size()):  # as quantize_weight
        raise ConfigError(f"quantization: the experts' {name} ({out} x {inn} per expert) does not "
                          f"split into {block}-value blocks; allowed: quantization.method=none")
    packed, scales, code = [], [], None
    seen = 0
    for chunk in chunks:
        if tuple(chunk.shape[1:]) != (a, b):
            raise RuntimeError(f"model.loading: the checkpoint's {name} experts are "
                               f"{tuple(chunk.shape[1:])}, the model's {(a, b)}; use "
                               "model.loading=full")
        seen += chunk.shape[0]
        chunk = chunk.to(device=device, dtype=dtype)
        flat = (chunk.transpose(1, 2) if module.is_transposed else chunk).reshape(-1, inn)
        q, state = F.quantize_4bit(flat.contiguous(), blocksize=kwargs["blocksize"],
                                   compress_statistics=False, quant_type=kwargs["quant_type"],
                                   quant_storage=kwargs["quant_storage"])  # fmt: skip
        packed.append(q)
        scales.append(state.absmax)
        code = state.code
        del chunk, flat
    if seen != count:
        raise RuntimeError(f"model.loading: the checkpoint holds {seen} experts' {name}, the model "
                           f"{count}; use model.loading=full")
    absmax = torch.cat(scales)
    common = dict(shape=torch.Size((count * out, inn)), dtype=dtype, blocksize=kwargs["blocksize"],
                  code=code, quant_type=kwargs["quant_type"])  # fmt: skip
    if kwargs["compress_statistics"]:  # bitsandbytes' quantize_4bit, over the whole stack's scales
        offset = absmax.mean()
        nested, state2 = F.quantize_blockwise(absmax - offset, blocksize=256)
        state = F.QuantState(absmax=nested, offset=offset, state2=state2, **common)
    else:
        state = F.QuantState(absmax=absmax, **common)
    param = bnb.nn.Params4bit(torch.cat(packed), requires_grad=False, quant_state=state,
                              blocksize=kwargs["blocksize"], bnb_quantized=True,
                              compress_statistics=kwargs["compress_statistics"],
                              quant_type=kwargs["quant_type"],
                              quant_storage=kwargs["quant_storage"])
    # What experts.quantize_weight records once it has packed a stack (kept in step with it).
    if not hasattr(module, "_kit_nf4"):
        module._kit_nf4 = {}
    module._kit_nf4[name] = dict(state=state, shape=tuple(shape), out=out)
    module._parameters[name] = param
    module.forward = types.MethodType(experts.forward, module)


def logical_shapes(model: torch.nn.Module) -> list[tuple[torch.nn.Module, str, tuple]]:
    """(experts module, weight name, the stack's logical shape) of every stack not yet packed,
    read while the model is still on the meta device: what `adopt` needs once packed stacks have
    arrived (then 2-D, kit.recipe.experts.find no longer sees their modules)."""
    from kit.recipe import experts

    return [(m, n, tuple(m._parameters[n].shape)) for _, m in experts.find(model)
            for n in experts.weight_names(m) if n not in getattr(m, "_kit_nf4", {})]  # fmt: skip


def adopt(stacks: list[tuple[torch.nn.Module, str, tuple]]) -> int:
    """Record, on each experts module of `stacks` (logical_shapes), the stacks that arrived packed
    (model.loading=rank0: rank 0 quantized them as it read them; kit.recipe.loading's
    receive_from_rank0 sent them with their quantization state), as quantize_chunks records its
    own; returns how many."""
    import bitsandbytes as bnb

    from kit.recipe import experts

    count = 0
    for module, name, shape in stacks:
        p = module._parameters[name]
        if isinstance(p, bnb.nn.Params4bit) and name not in getattr(module, "_kit_nf4", {}):
            if not hasattr(module, "_kit_nf4"):
                module._kit_nf4 = {}
            out = shape[2] if module.is_transposed else shape[1]
            module._kit_nf4[name] = dict(state=p.quant_state, shape=shape, out=out)
            module.forward = types.MethodType(experts.forward, module)
            count += 1
    return count


def read(path: str, start: int, entry: dict, key: str, dtype: torch.dtype, device: torch.device,
         rows: tuple[int, int] | None = None) -> torch.Tensor:
    """Tensor `key` of safetensors file `path` (`entry`: its header's entry; `start`: where the
    tensor bytes begin; with `rows`, only its rows first:last along its first dimension), made in
    `dtype` on `device` and filled in pieces of at most CHUNK bytes, each read with a plain read.
    Gaps filled: safetensors' safe_open memory-maps the whole file, and every page a rank touches
    then counts in its resident memory (a read leaves them in the kernel's page cache: shared,
    reclaimable); and a whole read before the cast holds the file's copy beside the cast one (an
    fp32 embedding table read for bf16: three times its bf16 bytes). The format: an 8-byte header
    length, a JSON header (dtype, shape, byte range of each tensor), the bytes."""
    begin, end = entry["data_offsets"]
    stored = SAFETENSORS_DTYPES[entry["dtype"]]
    shape, size = list(entry["shape"]), torch.empty((), dtype=stored).element_size()
    if rows is not None:  # a row is the product of the other dimensions
        row = (end - begin) // shape[0]
        begin, end = begin + rows[0] * row, begin + rows[1] * row
        shape[0] = rows[1] - rows[0]
    tensor = torch.empty(shape, dtype=dtype, device=device)
    flat = tensor.view(-1)
    step = max(1, CHUNK // size)
    with open(path, "rb") as f:
        f.seek(start + begin)
        for first in range(0, (end - begin) // size, step):
            data = bytearray(f.read(min(step, flat.numel() - first) * size))
            if not data or len(data) % size:
                raise RuntimeError(f"model.loading: {path} ends inside {key} (a damaged "
                                   "or partly copied file)")
            flat[first:first + len(data) // size].copy_(torch.frombuffer(data, dtype=stored))
    return tensor


CHUNK = 16 * 2**20  # bytes read at a time: a 70B model's largest tensor is 1 GiB in bf16

SAFETENSORS_DTYPES = {k: getattr(torch, v) for k, v in dict(
    BF16="bfloat16", F16="float16", F32="float32", F64="float64", I64="int64", I32="int32",
    I16="int16", I8="int8", U8="uint8", BOOL="bool").items()}
