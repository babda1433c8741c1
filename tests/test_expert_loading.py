"""kit.recipe.expert_source: a mixture of experts' checkpoint read into the model's NF4 expert
stacks a chunk of experts at a time (model.loading = stream, rank0), per-expert and fused layouts
alike.

The per-expert layout is what transformers' own save_pretrained writes in this version (it reverts
its conversion mapping: Qwen3-MoE's `mlp.experts.<e>.gate_proj.weight`, Mixtral's
`block_sparse_moe.experts.<e>.w1.weight`), as the kit's tiny MoE folders are written; the fused
one (the model's own `gate_up_proj` (E, 2I, H)) is written here from the loaded model's state
dict with safetensors. gpt-oss has no conversion in transformers: its checkpoint is fused.
"""

from __future__ import annotations

import shutil

import pytest
import torch
from conftest import ROOT

from kit.config import ConfigError, load_config
from kit.inputs import builtin
from kit.lab import loading_rank, loading_report
from kit.recipe import expert_source, experts, loading

TINY = ROOT / "kit/configs/tiny-cpu.yaml"


def fused_folder(name: str, out) -> str:
    """A copy of kit model `name` whose experts are stored fused, under the model's own names."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    folder = builtin.resolve(name)
    shutil.copytree(folder, out)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16)
    state = {k: v.contiguous() for k, v in model.state_dict().items()
             if k != "lm_head.weight" or not model.config.tie_word_embeddings}  # fmt: skip
    save_file(state, out / "model.safetensors", metadata={"format": "pt"})
    return str(out)


def expert_keys(folder: str) -> list[str]:
    return sorted(k for k in builtin.checkpoint_files(folder) if ".experts." in k)


@pytest.mark.parametrize("name,layout", [
    ("kit:tiny-qwen3-moe", "per-expert"), ("kit:tiny-qwen3-moe", "fused"),
    ("kit:tiny-mixtral", "per-expert"), ("kit:tiny-mixtral", "fused"),
    ("kit:tiny-olmoe", "per-expert"),
    ("kit:tiny-gpt-oss", "fused")])  # fmt: skip
def test_stream_reads_each_layout_bit_for_bit_as_a_full_load(tmp_path, monkeypatch, group_of_one,
                                                             name, layout):  # fmt: skip
    """Filled by the stream Source one expert per chunk, every tensor (packed NF4 bytes, their
    double-quantized scales) equals what from_pretrained + the kit's quantization hold."""
    folder = builtin.resolve(name) if layout == "per-expert" else fused_folder(name, tmp_path / "f")
    keys = expert_keys(folder)
    if layout == "per-expert":  # written so by save_pretrained: one tensor per expert
        assert any(".experts.3." in k for k in keys) and not any("gate_up_proj" in k for k in keys)
    else:
        assert any(k.endswith("experts.gate_up_proj") for k in keys), keys
    monkeypatch.setattr(expert_source, "CHUNK_BYTES", 1)  # one expert at a time
    cfg = {m: load_config(TINY, [f"model.name={folder}", f"model.loading={m}"])
           for m in ("full", "stream")}  # fmt: skip
    model, _ = loading.load(cfg["stream"], torch.device("cpu"))
    source = loading.streamer_of(model)
    assert loading.loaded_as(model) == "stream" and source.missing() == []
    stacks = [(m, n, tuple(m._parameters[n].shape)) for _, m in experts.find(model)
              for n in experts.weight_names(m)]  # fmt: skip
    key = f"{source.names[id(stacks[0][0])]}.{stacks[0][1]}"
    chunks = [c.shape[0] for c in expert_source.stack_chunks(
        source, source.made[key], key, stacks[0][2], torch.bfloat16)]
    assert chunks == [1] * stacks[0][2][0]  # the host holds one expert of the stack at a time
    source.fill(model)
    full, _ = loading.load(cfg["full"], torch.device("cpu"))
    assert loading.loaded_as(full) == "full"
    assert loading_rank.state_digest(model) == loading_rank.state_digest(full)
    for (_, want), (_, got) in zip(experts.find(full), experts.find(model), strict=True):
        # what experts.quantize_weight records, recorded alike (the forward reads it)
        assert {k: v.keys() for k, v in got._kit_nf4.items()} == {
            k: v.keys() for k, v in want._kit_nf4.items()}
        assert [v["shape"] for v in got._kit_nf4.values()] == [
            v["shape"] for v in want._kit_nf4.values()]
        assert got.forward.__func__ is want.forward.__func__
    ids = (torch.arange(32).reshape(2, 16) * 7) % 100 + 3
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, full(input_ids=ids).logits)


def test_a_weight_no_mapping_places_still_refuses_stream_in_one_line(tmp_path, group_of_one):
    """A checkpoint weight under a name transformers' conversion mapping does not know (here the
    final norm renamed): model.loading=stream says so in one line (auto loads it in full:
    tests/test_loading.py)."""
    from safetensors.torch import load_file, save_file

    folder = tmp_path / "renamed"
    shutil.copytree(builtin.resolve("kit:tiny-qwen3-moe"), folder)
    tensors = load_file(folder / "model.safetensors")
    tensors["model.final_norm.weight"] = tensors.pop("model.norm.weight")
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ConfigError) as err:
        loading.load(load_config(TINY, [f"model.name={folder}", "model.loading=stream"]),
                     torch.device("cpu"))
    assert str(err.value) == (
        f"model.loading: stream is not allowed for {folder}: 1 weight(s) are stored under other "
        "names in its checkpoint (e.g. model.norm.weight); allowed: auto, full, rank0")


@pytest.mark.slow
@pytest.mark.parametrize("name,engine", [("kit:tiny-qwen3-moe", "fsdp2"),
                                         ("kit:tiny-mixtral", "fsdp1")])
def test_a_per_expert_checkpoint_streams_and_every_mode_holds_the_same(tmp_path, name, engine):
    """One torchrun of 2 processes loading a per-expert checkpoint (save_pretrained's) in each mode
    in turn, adding LoRA and sharding: stream runs as asked (no fallback: an unplaced weight would
    refuse it), rank 0 reads it expert by expert under rank0 and rank 1 receives the packed stacks,
    and every rank holds the same bytes and gives the same logits in every mode."""
    rows = loading_report.measure("tiny-cpu", [f"model.name={name}", f"sharding.engine={engine}"],
                                  out=tmp_path, together=True)
    assert [(r["mode"], r["rank"]) for r in rows] == [
        (m, r) for m in ("full", "rank0", "stream") for r in (0, 1)]
    assert [r["read_checkpoint"] for r in rows] == [True, True, True, False, True, True]
    for rank in (0, 1):
        assert len({r["digest"] for r in rows if r["rank"] == rank}) == 1, rows
    assert len({r["logits_digest"] for r in rows}) == 1
    full, stream = rows[0], rows[4]
    assert stream["model_most_mib"] < full["model_most_mib"], (full, stream)


def test_the_estimate_counts_what_loading_a_moe_checkpoint_puts_on_a_gpu():
    """Qwen3-30B-A3B's shape read from a checkpoint (its Shape: not the kit model initialised at
    load): full holds every expert stack in bf16 until the kit quantizes them, out of a 24 GiB
    GPU; stream and rank0 one chunk of experts beyond the 4-bit model, within it."""
    from kit.budget.estimate import EXPERT_CHUNK_BYTES, Setup, estimate, quantized_bytes_per_param
    from kit.budget.shapes import shape_of

    assert EXPERT_CHUNK_BYTES == expert_source.CHUNK_BYTES  # the kernel side's copy
    shape = shape_of("kit:qwen3-30b-a3b")
    est = {m: estimate(shape, Setup(world_size=2, loading=m)) for m in ("full", "rank0", "stream")}
    per = quantized_bytes_per_param("nf4", True)
    dense = 48 * 128 * (2048 * 2 * 768 + 768 * 2048) * (2 - per)
    chunk = EXPERT_CHUNK_BYTES // 2 * (2 + per)
    assert est["full"].load_bytes - est["rank0"].load_bytes == pytest.approx(dense - chunk)
    assert "expert stacks in the model dtype" in est["full"].load_note
    alone = {m: estimate(shape, Setup(world_size=1, loading=m)) for m in ("full", "stream")}
    assert alone["stream"].load_gib < 24 < alone["full"].load_gib, alone
