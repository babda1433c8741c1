"""kit.recipe.loading: model.loading = full | rank0 | stream.

Where the two modes run for real on 2 processes (each its own check, not repeated here):
- tests/test_train.py's fsdp2-nf4 and fsdp1-nf4 cases train with model.loading=rank0 (rank 1
  receives every tensor, the 4-bit ones with their quantization state) and reload the adapter;
- notebook 10's section 3 (run once, in tests/test_jobs.py) loads kit:llama-135m in the three modes
  from its checkpoint: the same shards and logits, and what each rank mapped of the file.
"""

from __future__ import annotations

import pytest
import torch

from kit.config import ConfigError, load_config
from kit.inputs import builtin
from kit.lab import loading_rank, loading_report
from kit.recipe import loading


def test_an_unknown_mode_is_one_line():
    with pytest.raises(ConfigError) as err:
        load_config(None, ["model.loading=shard"])
    assert str(err.value) == ("model.loading: 'shard' is not allowed; expected one of 'auto', 'full', "
                              "'rank0', 'stream'")
    with pytest.raises(ConfigError, match="only with sharding.engine=fsdp2 or fsdp1"):
        load_config(None, ["model.loading=stream", "sharding.engine=ddp"])


def test_a_group_of_one_loads_fully_and_the_digest_sees_every_byte():
    """Without a process group there is no rank 0 to receive from: rank0 loads as full does, the
    same bytes (digest); and one flipped bit of a 4-bit constant changes the digest."""
    cfg = {mode: load_config(None, [f"model.loading={mode}"]) for mode in ("full", "rank0")}
    models = {mode: loading.load(c, torch.device("cpu"))[0] for mode, c in cfg.items()}
    digests = {mode: loading_rank.state_digest(m) for mode, m in models.items()}
    assert digests["full"] == digests["rank0"]
    absmax = models["full"].model.layers[0].self_attn.q_proj.weight.quant_state.absmax
    absmax[0] ^= 1
    assert loading_rank.state_digest(models["full"]) != digests["rank0"]


def test_report_rows_read_in_rank_order(tmp_path):
    import json

    for rank in (10, 2, 0):
        row = {"mode": "rank0", "rank": rank, "read_checkpoint": rank == 0, "seconds": 1.0,
               "rss_before_mib": 100.0, "peak_rss_mib": 150.5, "digest": "ab" * 32}
        (tmp_path / f"rank{rank}.json").write_text(json.dumps(row))
    rows = loading_report.table(loading_report.read(tmp_path))
    assert [r["rank"] for r in rows] == [0, 2, 10]
    assert rows[0]["load's MiB"] == 50.5 and rows[0]["digest"] == "ab" * 6


def test_a_model_without_weights_on_disk_is_initialised_at_load():
    """kit.inputs.builtin.AT_LOAD (kit:llama-70b; its tiny twin here): the folder holds no weights; the
    model is built on meta and filled tensor by tensor, 4-bit weights quantized as they are made,
    and it runs: a loss near log(vocabulary) for random weights."""
    cfg = load_config(None, ["model.name=kit:tiny-llama-at-load"])
    folder = builtin.resolve(cfg.model.name)
    assert not [p.name for p in builtin.Path(folder).glob("*.safetensors")]
    model, tokenizer = loading.load(cfg, torch.device("cpu"))
    q_proj = model.model.layers[0].self_attn.q_proj.weight
    assert tuple(q_proj.shape) == (128 * 128 // 2 // 2, 1) and q_proj.quant_state.quant_type == "nf4"
    assert not any(t.is_meta for t in model.state_dict().values())
    ids = tokenizer("the model learns", return_tensors="pt").input_ids
    with torch.no_grad():
        loss = model(input_ids=ids, labels=ids).loss.item()
    assert abs(loss - torch.log(torch.tensor(1024.0)).item()) < 0.5, loss


@pytest.mark.slow
@pytest.mark.parametrize("engine", ["fsdp2", "fsdp1"])
def test_every_mode_gives_every_rank_the_same_shards_and_logits(tmp_path, engine):
    """One torchrun of 2 processes loading the model initialised at load (no checkpoint) in each
    mode in turn, adding LoRA and sharding with `engine`: full (each rank makes it), rank0 (rank 1
    receives every tensor) and stream (each unit made and sharded in turn; FSDP1 through its
    param_init_fn) leave each rank the same bytes and give the same logits. Notebook 10 does the
    same from a checkpoint."""
    rows = loading_report.measure("tiny-cpu", ["model.name=kit:tiny-llama-at-load",
                                               f"sharding.engine={engine}"],
                                  out=tmp_path, together=True)
    assert [(r["mode"], r["rank"], r["engine"]) for r in rows] == [
        (m, r, engine) for m in ("full", "rank0", "stream") for r in (0, 1)]
    assert [r["read_checkpoint"] for r in rows] == [True, True, True, False, True, True]
    for rank in (0, 1):
        assert len({r["digest"] for r in rows if r["rank"] == rank}) == 1, rows
    assert rows[0]["digest"] != rows[1]["digest"]  # each rank holds its own shards
    assert len({r["logits_digest"] for r in rows}) == 1
    # stream never held the whole model: its shards plus one unit, against the whole model
    # before sharding under full. The largest unit is the root: under FSDP2 the head (the
    # embeddings are a unit of their own), under FSDP1 both tables.
    full, stream = rows[0], rows[4]
    bound = {"fsdp2": 0.8, "fsdp1": 0.9}[engine]
    assert stream["model_most_mib"] < bound * full["model_most_mib"], (full, stream)
    assert stream["model_sharded_mib"] == full["model_sharded_mib"]


def test_auto_streams_in_a_group_and_falls_back_when_names_differ(tmp_path, capsys):
    """model.loading=auto: outside a process group (a notebook) it loads fully; in a group it
    streams, unless the checkpoint holds a weight under another name than the model's (what
    transformers renames while loading), which stream cannot find: then it loads as full/rank0
    and says so in one line."""
    import shutil

    import torch.distributed as dist
    from safetensors.torch import load_file, save_file

    folder = tmp_path / "renamed"
    shutil.copytree(builtin.resolve("kit:tiny-llama"), folder)
    tensors = load_file(folder / "model.safetensors")
    tensors["model.final_norm.weight"] = tensors.pop("model.norm.weight")
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    plain = load_config(None, [])
    renamed = load_config(None, [f"model.name={folder}"])
    assert loading.loaded_as(loading.load(plain, torch.device("cpu"))[0]) == "full"
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        model, _ = loading.load(plain, torch.device("cpu"))
        assert loading.loaded_as(model) == "stream" and loading.streamer_of(model) is not None
        assert loading.streamer_of(model).missing() == []
        model, _ = loading.load(renamed, torch.device("cpu"))
    finally:
        dist.destroy_process_group()
    assert loading.loaded_as(model) == "full" and not any(p.is_meta for p in model.parameters())
    assert capsys.readouterr().out.strip() == (
        f"model.loading=auto: 1 weight(s) of {folder} are stored under other names in its "
        "checkpoint (e.g. model.norm.weight); loading with full instead of stream")
