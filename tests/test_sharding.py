"""What each rank holds (kit.lab.sharding, notebook 04): the rank-side report of one engine, and the
kernel side's tables over it (kit.lab.sharding_report). Two ranks for real: notebook 04's test."""

import json

import torch

from kit.config import load_config
from kit.lab import sharding_report


def test_fsdp2_report_of_one_rank(group_of_one, tmp_path):
    """The report's bookkeeping on one rank, FSDP2 as torch wraps it (every parameter its own:
    kit.lab.sharding.shard_every; the kit's engine leaves the frozen weights alone on one rank,
    so its root and embeddings hold nothing to gather there)."""
    from kit.lab.sharding import report_rank, shard_every

    cfg = load_config(None, ["sharding.engine=fsdp2", "training.device=cpu"])
    torch.manual_seed(cfg.training.seed)
    row = report_rank(cfg, group_of_one, tmp_path, shard_every, "fsdp2")
    # Units: each decoder layer, the input embeddings (a unit of their own), the root ('').
    assert row["units"] == ["", "base_model.model.model.embed_tokens",
                            "base_model.model.model.layers.0", "base_model.model.model.layers.1"]
    assert row["decoder_layer_classes"] == ["LlamaDecoderLayer"]
    lora = [p for n, p in row["params"].items() if "lora_A" in n]
    assert lora and all(p["trainable"] and p["grad_shape"] == p["shape"] for p in lora)
    # Mixed precision: LoRA's fp32 weights are gathered and run in the model dtype.
    assert row["seen_in_forward"]["LoRA A weight"] == "bfloat16"
    (tmp_path / "fsdp2").mkdir()
    (tmp_path / "fsdp2" / "rank0.json").write_text(json.dumps(row))
    found = sharding_report.read_report(tmp_path)
    table = sharding_report.shard_table(found["fsdp2"], "layers.0.self_attn.q_proj.lora_A")
    assert table == [{"param": "model.layers.0.self_attn.q_proj.lora_A.default.weight",
                      "dtype": "float32", "full": (8, 128), "rank 0": (8, 128)}]
    held = sharding_report.bytes_per_rank(found["fsdp2"])[0]
    assert held["trainable"] == sum(p["bytes"] for p in row["params"].values() if p["trainable"])
    assert held["frozen"] + held["trainable"] == held["full model"]  # one rank holds it all
    # The memory timeline: a layer computes only while gathered; forward holds one layer at a
    # time; the root stays gathered, the embeddings not. (In a group of one, backward holds one
    # layer at a time too; notebook 04's checked output shows two on two ranks: the prefetch.)
    tl = row["timeline"]
    for i, unit in enumerate(tl["units"]):
        assert tl["computing"][i], unit
        assert all(any(a <= s and e <= b for a, b in tl["gathered"][i]) for s, e in tl["computing"][i])
    assert [len(tl["gathered"][i]) for i in range(4)] == [1, 1, 2, 2]  # layers: forward, backward
    assert sharding_report.layers_at_once(found) == [{
        "engine": "fsdp2", "layers at once, forward": 1, "layers at once, backward": 1,
        "root held": "100% of the step", "embed_tokens held": "0% of the step"}]


def test_one_unit_for_the_whole_model_holds_it_gathered_the_whole_step(group_of_one, tmp_path):
    """The first article's FSDP(model) (claim A06, notebook 04 section 10): one unit, the root,
    gathered from the first operation to the end of backward; the kit's wrap never holds every
    unit at once."""
    from kit.lab.sharding import report_rank, shard_whole

    cfg = load_config(None, ["sharding.engine=fsdp2", "training.device=cpu"])
    rows = {}
    for label, wrap in (("fsdp2", None), ("fsdp2-whole", shard_whole)):
        torch.manual_seed(cfg.training.seed)
        extra = (wrap, label) if wrap else ()
        rows[label] = [report_rank(cfg, group_of_one, tmp_path, *extra)]
    assert rows["fsdp2-whole"][0]["engine"] == "fsdp2-whole" and rows["fsdp2-whole"][0]["units"] == [""]
    table = {r["wrap"]: r for r in sharding_report.one_unit(rows)}
    assert table["fsdp2"]["units"] == 4 and table["fsdp2"]["whole model gathered"] == "0% of the step"
    assert table["fsdp2-whole"]["units"] == 1
    assert int(table["fsdp2-whole"]["whole model gathered"].split("%")[0]) >= 90
    assert table["fsdp2-whole"]["most bytes gathered"] > table["fsdp2"]["most bytes gathered"]
