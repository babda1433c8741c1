"""`kit merge RUN OUT --gguf [--type f16|bf16|q8_0]` (kit.inference.gguf_export): the file holds
every tensor under llama.cpp's names, shapes and types, the tokenizer and chat template; the
`gguf` reader and transformers' GGUF loader read it back, and the loaded model's logits match the
merged folder's within the type's tolerance; the capstone's SmolLM2 replies the same; a family
the kit cannot export is one line before anything is written.

The runs are freshly initialised adapters (random A and B, B scaled down so the model stays close
to its base), merged through `kit merge`'s own function: a trained run costs a torchrun of its
own (the capstone's: over 60 s here) and adds nothing to what the export is tested on."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
import yaml
from conftest import ROOT

from kit.inference import gguf_export, merge

# Max |logit difference| against the merged folder, logits of magnitude ~1 (measured on these
# tiny models: f16 3e-4, bf16 3e-3, q8_0 1.3e-2): about 5x headroom. A missed q/k permutation or
# a wrong tensor moves logits by ~1.
TOLERANCE = {"f16": 2e-3, "bf16": 1.5e-2, "q8_0": 6e-2}
FAMILIES = {"llama": "kit:tiny-llama", "mistral": "kit:tiny-mistral", "qwen2": "kit:tiny-qwen2",
            "qwen3": "kit:tiny-qwen3"}
PROMPT = "The quick brown fox jumps over 12 lazy dogs."
# GGUF name in a block -> the transformers module it comes from (written out here, not taken from
# the gguf package, so that a wrong name map fails).
BLOCK = {"attn_norm": "input_layernorm", "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
         "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
         "ffn_norm": "post_attention_layernorm", "ffn_gate": "mlp.gate_proj",
         "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
         "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"}
TOP = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}


def make_run(run, model: str, config: str = "tiny-cpu", **fields):
    """A run folder: the bundled config with model.name (and `section__key` fields) changed, and
    a freshly initialised LoRA adapter on every linear layer, saved with the base's tokenizer."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from kit.inputs import builtin

    tree = yaml.safe_load((ROOT / "kit" / "configs" / f"{config}.yaml").read_text())
    tree["model"]["name"] = model
    for key, value in fields.items():
        section, name = key.split("__")
        tree[section][name] = value
    run.mkdir(parents=True)
    (run / "config.yaml").write_text(yaml.safe_dump(tree))
    base = builtin.resolve(model)
    torch.manual_seed(0)
    peft = get_peft_model(AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32),
                          LoraConfig(r=8, lora_alpha=16, target_modules="all-linear",
                                     init_lora_weights=False))  # fmt: skip
    with torch.no_grad():
        for name, p in peft.named_parameters():
            if "lora_B" in name:
                p.mul_(0.1)
    peft.save_pretrained(run / "adapter")
    AutoTokenizer.from_pretrained(base).save_pretrained(run / "adapter")
    return run


def kit_merge(capsys, *args) -> list[str]:
    """`kit merge ...` through its own main; its printed lines (the merged folder, the GGUF)."""
    code = merge.main(["merge", *map(str, args)])
    out, err = capsys.readouterr()
    assert code == 0, err
    return out.split()


def expected_tensors(merged, config) -> dict[str, tuple]:
    """GGUF name -> transformers shape, from the merged folder's own tensors."""
    from safetensors import safe_open

    with safe_open(str(merged / "model.safetensors"), "pt") as f:
        shapes = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    out = {}
    for gguf_name, hf in TOP.items():
        for suffix in (".weight", ".bias"):
            if hf + suffix in shapes and not (hf == "lm_head" and config.tie_word_embeddings):
                out[gguf_name + suffix] = shapes[hf + suffix]
    for i in range(config.num_hidden_layers):
        for gguf_name, hf in BLOCK.items():
            for suffix in (".weight", ".bias"):
                if f"model.layers.{i}.{hf}{suffix}" in shapes:
                    out[f"blk.{i}.{gguf_name}{suffix}"] = shapes[f"model.layers.{i}.{hf}{suffix}"]
    assert len(out) == len(shapes) - (config.tie_word_embeddings and "lm_head.weight" in shapes)
    return out


def read_back(path, merged, kind: str) -> dict:
    """The file through the gguf reader: every tensor named, shaped and typed as llama.cpp's
    converter writes it (1-D in F32); its metadata as {key: value}."""
    import gguf
    from transformers import AutoConfig, AutoTokenizer

    config, tokenizer = AutoConfig.from_pretrained(merged), AutoTokenizer.from_pretrained(merged)
    reader = gguf.GGUFReader(path)
    want = expected_tensors(merged, config)
    found = {t.name: t for t in reader.tensors}
    assert sorted(found) == sorted(want)
    matrix = {"f16": "F16", "bf16": "BF16", "q8_0": "Q8_0"}[kind]
    for name, t in found.items():
        assert tuple(reversed([int(n) for n in t.shape])) == want[name], name  # GGUF: fastest first
        assert t.tensor_type.name == ("F32" if len(want[name]) == 1 else matrix), name
    meta = {k: f.contents() for k, f in reader.fields.items()}
    arch = gguf_export.ARCH[config.model_type]
    assert meta["general.architecture"] == arch
    assert meta[f"{arch}.block_count"] == config.num_hidden_layers
    assert meta[f"{arch}.attention.head_count_kv"] == config.num_key_value_heads
    assert meta["tokenizer.ggml.model"] == "gpt2"
    assert len(meta["tokenizer.ggml.tokens"]) == config.vocab_size
    merges = meta["tokenizer.ggml.merges"]
    assert merges[0].count(" ") == 1 and len(merges) > 100
    for key in ("bos", "eos", "padding"):
        assert meta[f"tokenizer.ggml.{key}_token_id"] == getattr(tokenizer, f"{key[:3]}_token_id")
    assert meta["tokenizer.chat_template"] == tokenizer.chat_template
    return meta


def load_gguf(path, meta: dict):
    """transformers' GGUF loader on the file: (model, tokenizer). Its Qwen3 mapping reads no head
    size (it takes Qwen3Config's 128); the file states it (qwen3.attention.key_length, which
    llama.cpp reads), so it is passed on from there."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    key = "qwen3.attention.key_length"
    extra = {"head_dim": meta[key]} if key in meta else {}
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name,
                                                 dtype=torch.float32, **extra).eval()
    return model, AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)


@pytest.mark.parametrize("family", FAMILIES)
def test_each_family_exports_a_gguf_that_loads_with_the_merged_logits(family, tmp_path, capsys):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    run = make_run(tmp_path / "run", FAMILIES[family], quantization__method="none",
                   model__dtype="float32")
    merged_folder, path = map(Path,
                              kit_merge(capsys, run, tmp_path / "merged", "--gguf"))
    assert path == tmp_path / "merged-f16.gguf"  # f16 by default, next to the merged folder
    paths = {"f16": path, **{k: gguf_export.export(merged_folder, gguf_export.gguf_path(
        merged_folder, k), k) for k in ("bf16", "q8_0")}}
    merged = AutoModelForCausalLM.from_pretrained(merged_folder, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(merged_folder)
    ids = tokenizer(PROMPT, return_tensors="pt")["input_ids"]
    with torch.no_grad():
        want = merged(ids).logits
    for kind, path in paths.items():
        meta = read_back(path, merged_folder, kind)
        model, gguf_tokenizer = load_gguf(path, meta)
        assert gguf_tokenizer(PROMPT)["input_ids"] == ids[0].tolist()
        with torch.no_grad():
            diff = (model(ids).logits - want).abs().max().item()
        print(f"{family} {kind}: max |logit diff| {diff:.2e} of {want.abs().max().item():.2f}")
        assert diff <= TOLERANCE[kind], (family, kind, diff)


def test_other_families_and_types_are_refused_in_one_line_before_anything_is_written(
        tmp_path, capsys):
    run = tmp_path / "run"
    run.mkdir()
    tree = yaml.safe_load((ROOT / "kit" / "configs" / "tiny-cpu.yaml").read_text())
    tree["model"]["name"] = "kit:tiny-gemma2"
    (run / "config.yaml").write_text(yaml.safe_dump(tree))  # no adapter: refused before it is read
    cases = {("--gguf",): "kit checkpoints merge: kit:tiny-gemma2: model_type: 'gemma2' cannot be "
             "exported to GGUF; supported: llama, mistral, qwen2, qwen3",
             ("--gguf", "--type", "q4_k"): "kit checkpoints merge: --type: 'q4_k' is not a GGUF "
             "type the kit writes; allowed: f16, bf16, q8_0",
             ("--type", "q8_0"): "kit checkpoints merge: --type: q8_0 given without --gguf (it is "
             "the GGUF's type)"}
    for args, line in cases.items():
        assert merge.main(["merge", str(run), str(tmp_path / "merged"), *args]) == 2
        out, err = capsys.readouterr()
        assert (out, err) == ("", line + "\n")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]


def test_capstone_smollm2_exported_at_f16_replies_as_the_merged_model(tmp_path, capsys):
    """The capstone's config on SmolLM2-135M-Instruct (float32; tied embeddings, so the file holds
    no output.weight and the loader ties them again): its merged model and the f16 GGUF, read with
    the file's own tokenizer and chat template, give the same greedy reply to a held-out question.
    A freshly initialised adapter, not the capstone's 8 trained steps (over 60 s on 2 cores: see
    the module's docstring), and quantization.method=none: merging onto the NF4 base costs ~30 s
    of CPU more and is merge's own path (tests/test_checkpoint.py), not the export's."""
    import json

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from kit.recipe import data

    run = make_run(tmp_path / "run", "kit:smollm2-135m-instruct", config="smollm2-answer-cpu",
                   quantization__method="none")
    merged_folder, path = map(Path, kit_merge(capsys, run, tmp_path / "merged", "--gguf",
                                              "--type", "f16"))  # fmt: skip
    held_out = ROOT / "kit" / "data" / "answer-format-heldout.jsonl"
    question = json.loads(held_out.read_text().splitlines()[0])["messages"][0]["content"]
    merged = AutoModelForCausalLM.from_pretrained(merged_folder, dtype=torch.float32).eval()
    want = data.chat_replies(merged, AutoTokenizer.from_pretrained(merged_folder), [question])
    model, tokenizer = load_gguf(path, {})
    assert model.config.tie_word_embeddings  # the loader's reading of "no output.weight"
    got = data.chat_replies(model, tokenizer, [question])
    print(f"smollm2 f16: {question!r} -> {got[0]!r}")
    assert got == want and re.search(r"\w", got[0]), (got, want)
