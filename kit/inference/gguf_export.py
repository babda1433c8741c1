"""A merged model folder (kit.inference.merge.merge_adapter's) -> one GGUF file that
llama.cpp-family runtimes (llama.cpp, Ollama, LM Studio) and transformers' GGUF loader read.

    refusal(merged_config)                       # one line when the family cannot be exported
    export(merged_folder, out_file, "f16")       # f16 | bf16 | q8_0; returns out_file

The gap it fills: the `gguf` package writes the container (GGUFWriter), knows each architecture's
tensor names (TensorNameMap), the special tokens, merges and chat template (SpecialVocab) and
Q8_0/BF16 (gguf.quants), but ships no converter; llama.cpp's convert_hf_to_gguf.py is a script of
that repository, not an installable library. What it does for these families is written here:
the metadata keys it sets, the permutation of q/k in the `llama` architecture (transformers'
reader undoes it: LlamaTensorProcessor), 1-D tensors kept in F32, a byte-level BPE vocabulary as
`gpt2` with token types and merges. Mistral is written as llama.cpp writes it: architecture
`llama`. Only what these families need; others are refused before anything is written.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import numpy as np

from kit.folder.manifest import CheckpointError

# model_type -> GGUF architecture (llama.cpp's converter writes Mistral as `llama`).
ARCH = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}
TYPES = ("f16", "bf16", "q8_0")
# The architectures whose q/k weights llama.cpp stores interleaved (its non-NEOX rope).
PERMUTED = {"llama"}


def refusal(config) -> str | None:
    """One line when `config` (a transformers config) cannot be exported, else None."""
    family = config.model_type
    if family not in ARCH:
        return (f"model_type: {family!r} cannot be exported to GGUF; supported: "
                f"{', '.join(sorted(ARCH))}")
    rope_type = _rope(config)[1]
    if rope_type != "default":  # llama3/yarn scaling: llama.cpp writes extra keys and tensors
        return (f"rope scaling: {rope_type!r} ({family}) cannot be exported to GGUF; supported: "
                "models without rope scaling")
    return None


def _rope(config) -> tuple[float, str]:
    """(rope theta, rope type) under transformers 5 (rope_parameters) or 4 (rope_theta)."""
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    theta = params.get("rope_theta", getattr(config, "rope_theta", 10000.0))
    return float(theta), params.get("rope_type", params.get("type", "default"))


def _head_dim(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def _metadata(writer, config, name: str, file_type: int) -> None:
    """The hyperparameters as llama.cpp's TextModel.set_gguf_parameters writes them."""
    theta, _ = _rope(config)
    head_dim = _head_dim(config)
    writer.add_name(name)
    writer.add_type("model")
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_rope_freq_base(theta)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    if getattr(config, "head_dim", None):  # as the converter does when a config states it;
        writer.add_key_length(head_dim)    # transformers' reader takes Qwen3's head_dim from it
        writer.add_value_length(head_dim)
    if ARCH[config.model_type] == "llama":  # LlamaModel adds these two
        writer.add_vocab_size(config.vocab_size)
        writer.add_rope_dimension_count(head_dim)
    writer.add_file_type(file_type)


def permute(w: np.ndarray, n_head: int, n_head_kv: int) -> np.ndarray:
    """HF's rotate-half q/k rows -> llama.cpp's interleaved pairs (convert_hf_to_gguf's
    LlamaModel.permute; transformers' LlamaTensorProcessor._reverse_permute_weights inverts it)."""
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return (w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


def _stored(shape: tuple, kind: str):
    """The type llama.cpp stores a tensor of a `kind` file in: 1-D tensors (norms, biases) F32;
    matrices F16, BF16 or Q8_0 (F16 where a row is not whole Q8_0 blocks, as the converter does)."""
    import gguf

    q = gguf.GGMLQuantizationType
    if len(shape) <= 1:
        return q.F32
    if kind == "bf16":
        return q.BF16
    return q.Q8_0 if kind == "q8_0" and shape[-1] % gguf.GGML_QUANT_SIZES[q.Q8_0][0] == 0 else q.F16


def _encode(data: np.ndarray, qtype) -> np.ndarray:
    import gguf

    q = gguf.GGMLQuantizationType
    data = data.astype(np.float32)
    if qtype in (q.F32, q.F16):
        return data.astype(np.float16 if qtype == q.F16 else np.float32)
    return gguf.quants.quantize(data, qtype)  # BF16, Q8_0: bytes


def _entries(folder: Path, config) -> list[tuple[Path, str, str, tuple]]:
    """(file, transformers name, GGUF name, shape) of every tensor the merged folder holds."""
    import gguf
    from safetensors import safe_open

    arch = ARCH[config.model_type]
    names = gguf.get_tensor_name_map(
        next(a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == arch), config.num_hidden_layers)
    tied = getattr(config, "tie_word_embeddings", False)
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{folder}: holds no *.safetensors (not a merged model folder)")
    out = []
    for file in files:
        with safe_open(str(file), "pt") as f:
            for key in f.keys():
                if tied and key == "lm_head.weight":  # llama.cpp writes no output.weight when tied
                    continue
                name = names.get_name(key, try_suffixes=(".weight", ".bias"))
                if name is None:
                    raise CheckpointError(f"{file}: tensor {key} has no GGUF name for {arch}")
                out.append((file, key, name, tuple(f.get_slice(key).get_shape())))
    return out


def _read(f, key: str, name: str, config) -> np.ndarray:
    """One tensor in float32, q/k permuted where the architecture stores them interleaved."""
    data = f.get_tensor(key).float().numpy()
    if ARCH[config.model_type] in PERMUTED and name.endswith(("attn_q.weight", "attn_k.weight")):
        kv = config.num_key_value_heads if "attn_k" in name else None
        data = permute(data, config.num_attention_heads, kv)
    return data


def _write_tensors(writer, folder: Path, config, kind: str) -> None:
    """Tensor infos first, then the data one tensor at a time (a merged 8B model is 16 GB in f16:
    GGUFWriter.add_tensor would hold every array until the file is written)."""
    import gguf
    from safetensors import safe_open

    entries = _entries(folder, config)
    for _, _, name, shape in entries:
        qtype = _stored(shape, kind)
        block, size = gguf.GGML_QUANT_SIZES[qtype]
        writer.add_tensor_info(name, shape, np.float32, int(np.prod(shape)) // block * size,
                               raw_dtype=qtype)  # fmt: skip
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    handles = {}
    for file, key, name, shape in entries:
        if file not in handles:
            handles[file] = safe_open(str(file), "pt")
        data = _read(handles[file], key, name, config)
        writer.write_tensor_data(_encode(data, _stored(shape, kind)))


def _pre_tokenizer(spec: dict, where: Path) -> str:
    """llama.cpp's name (`tokenizer.ggml.pre`) for how this tokenizer.json splits text before BPE.
    llama.cpp recognises a tokenizer by hashing its output on a fixed text; here the split itself
    is read: GPT-2's (ByteLevel's own regex), SmolLM's (digits one by one, then GPT-2's), or a
    Split regex that transformers' GGUF reader lists under a llama.cpp name (qwen2, llama-bpe)."""
    from transformers.integrations.gguf.gguf_tokenizer_mapping import GGUF_PRE_TOKENIZER_SPLITS

    steps = spec.get("pretokenizers", [spec])
    kinds = [s.get("type") for s in steps]
    if kinds == ["ByteLevel"] and steps[0].get("use_regex", True):
        return "gpt2"
    if kinds == ["Digits", "ByteLevel"] and steps[0].get("individual_digits"):
        return "smollm"
    for step in steps:
        regex = (step.get("pattern") or {}).get("Regex") if step.get("type") == "Split" else None
        for name, known in GGUF_PRE_TOKENIZER_SPLITS.items():
            if regex == known:
                return name
    raise CheckpointError(f"{where}: its pre-tokenizer ({'+'.join(map(str, kinds))}) has no "
                          "llama.cpp name; supported: GPT-2's, SmolLM's, Qwen2's, Llama-3's splits")


def _vocab(writer, folder: Path, config) -> None:
    """The tokenizer as llama.cpp's TextModel._set_vocab_gpt2 writes it: every id up to the model's
    vocabulary size (unused ids as [PADn]), token types (control for special tokens), merges, the
    special token ids, whether BOS/EOS are added, and the chat template (SpecialVocab)."""
    import gguf
    from transformers import AutoTokenizer

    where = folder / "tokenizer.json"
    spec = json.loads(where.read_text()) if where.is_file() else {}
    model, decoder = spec.get("model") or {}, spec.get("decoder") or {}
    if model.get("type") != "BPE" or decoder.get("type") != "ByteLevel":
        raise CheckpointError(f"{where}: a {model.get('type', 'missing')} tokenizer; GGUF export "
                              "writes byte-level BPE vocabularies only (tokenizer.ggml.model gpt2)")
    tokenizer = AutoTokenizer.from_pretrained(folder)
    by_id = {i: t for t, i in tokenizer.get_vocab().items()}
    added = tokenizer.added_tokens_decoder
    tokens, types = [], []
    for i in range(max(config.vocab_size, len(by_id))):
        if i not in by_id:
            tokens.append(f"[PAD{i}]"), types.append(gguf.TokenType.UNUSED)
        else:
            tokens.append(by_id[i])
            types.append(gguf.TokenType.NORMAL if i not in added else gguf.TokenType.CONTROL
                         if added[i].special else gguf.TokenType.USER_DEFINED)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(_pre_tokenizer(spec.get("pre_tokenizer") or {}, where))
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    special = gguf.SpecialVocab(folder, load_merges=True, n_vocab=len(tokens))
    # What the tokenizer does, not a default: llama.cpp adds BOS to a gpt2 vocabulary unless told.
    ids = tokenizer("a")["input_ids"]
    bos, eos = tokenizer.bos_token_id, tokenizer.eos_token_id
    special.add_special_token["bos"] = bos is not None and ids[0] == bos
    special.add_special_token["eos"] = eos is not None and ids[-1] == eos
    special.add_to_gguf(writer, quiet=True)
    writer.add_add_space_prefix(False)


def export(folder, out_file, kind: str = "f16") -> Path:
    """Write `out_file` (a path that must not exist) from the merged model `folder`; atomic: a
    temporary file next to it, renamed when complete."""
    import gguf
    from transformers import AutoConfig

    folder, out_file = Path(folder), Path(out_file)
    if kind not in TYPES:
        raise CheckpointError(f"--type: {kind!r} is not a GGUF type the kit writes; "
                              f"allowed: {', '.join(TYPES)}")
    if out_file.exists():
        raise CheckpointError(f"gguf: '{out_file}' exists; choose a new name")
    config = AutoConfig.from_pretrained(folder)
    if why := refusal(config):
        raise CheckpointError(why)
    file_type = {"f16": gguf.LlamaFileType.MOSTLY_F16, "bf16": gguf.LlamaFileType.MOSTLY_BF16,
                 "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0}[kind]
    fd, tmp = tempfile.mkstemp(prefix=f".{out_file.name}.", suffix=".tmp", dir=out_file.parent)
    os.close(fd)
    try:
        writer = gguf.GGUFWriter(tmp, ARCH[config.model_type])
        _metadata(writer, config, folder.name, file_type)
        _vocab(writer, folder, config)
        writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
        _write_tensors(writer, folder, config, kind)
        writer.close()
        if out_file.exists():  # appeared while writing
            raise CheckpointError(f"gguf: '{out_file}' exists; choose a new name")
        mask = os.umask(0)
        os.umask(mask)
        os.chmod(tmp, 0o666 & ~mask)  # mkstemp's 0600 otherwise (as manifest.ordinary_modes)
        os.replace(tmp, out_file)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)  # the temporary file made above, nothing else
    return out_file


def gguf_path(merged: Path, kind: str) -> Path:
    """Where `kit merge --gguf` writes: next to the merged folder, e.g. merged-f16.gguf."""
    return Path(merged).with_name(f"{Path(merged).name}-{kind}.gguf")


def check_run(run: Path, target: Path, kind: str) -> None:
    """Before a merge that exports `target`: one-line CheckpointError when the type is not one
    the kit writes, the file exists, or the run's base model is of a family it cannot export."""
    from transformers import AutoConfig

    from kit.config import load_config
    from kit.folder.layout import RunFolder
    from kit.inputs import builtin

    if kind not in TYPES:
        raise CheckpointError(f"--type: {kind!r} is not a GGUF type the kit writes; "
                              f"allowed: {', '.join(TYPES)}")
    if target.exists():
        raise CheckpointError(f"gguf: '{target}' exists; choose a new folder to merge into")
    name = load_config(RunFolder(run).config).model.name
    if why := refusal(AutoConfig.from_pretrained(builtin.resolve(name))):
        raise CheckpointError(f"{name}: {why}")
