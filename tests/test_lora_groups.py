"""lora.group_inputs (kit.recipe.levers.lora_groups): q/k/v and gate/up drop their shared input once and run
their down-projections as one matmul; without dropout the result is the adapters' own, eager,
recomputed and compiled; with dropout the members share one mask."""

import shutil

import pytest
import torch
from conftest import TINY
from levers import tiny_model
from torch.utils._python_dispatch import TorchDispatchMode

from kit.budget import shapes
from kit.config import ConfigError, load_config
from kit.inputs import builtin
from kit.recipe import lora, lora_down
from kit.recipe.levers import lora_groups


class _CountMatmuls(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default,
                    torch.ops.aten.bmm.default, lora_down.up_add_ref._opoverload):
            self.count += 1
        return func(*args, **(kwargs or {}))


def _build(overrides, group: bool, recompute: bool = False):
    cfg = load_config(None, ["quantization.method=none", *overrides])
    torch.manual_seed(0)
    model = lora.apply_lora(tiny_model(), cfg)
    for n, p in model.named_parameters():  # non-zero B, so every branch matters
        if "lora_B" in n:
            torch.nn.init.normal_(p, std=0.02, generator=torch.Generator().manual_seed(len(n)))
    if recompute:
        lora.recompute_adapters(model)
    if group:
        assert lora_groups.enable(model, recompute=recompute) == 4  # (q/k/v, gate/up) x 2 layers
    return model.train()


def _step(model, ids):
    torch.manual_seed(7)
    with _CountMatmuls() as counted:
        loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    return loss.item(), grads, counted.count


@pytest.mark.parametrize("recompute", [False, True], ids=["plain", "lora.recompute"])
def test_groups_give_the_adapters_own_result_with_fewer_matmuls(recompute):
    """Dropout off: the same loss and gradients as each adapter on its own; per decoder layer
    three down-projections fewer in forward (q/k/v: 3 -> 1, gate/up: 2 -> 1)."""
    ids = torch.randint(3, 1024, (2, 32), generator=torch.Generator().manual_seed(3))
    loss_a, grads_a, mm_a = _step(_build(["lora.dropout=0"], False, recompute), ids)
    loss_b, grads_b, mm_b = _step(_build(["lora.dropout=0"], True, recompute), ids)
    assert loss_b == pytest.approx(loss_a, abs=1e-6)
    assert grads_a.keys() == grads_b.keys()
    for name in grads_a:
        assert torch.allclose(grads_a[name], grads_b[name], atol=1e-6), name
    assert mm_a - mm_b == 3 * 2, (mm_a, mm_b)


def test_members_share_one_dropout_mask():
    """Two members with the same weights get the same down-projection from one call (one mask);
    two separate calls, as PEFT makes them, draw two masks and differ."""
    g = torch.Generator().manual_seed(0)
    x, a = torch.randn(4, 64, generator=g), torch.randn(8, 64, generator=g)
    torch.manual_seed(1)
    (one, two), factor = lora_groups.group_lows(x, [a, a], 0.5, True)
    assert torch.equal(one, two) and factor == 1.0  # F.dropout rescales the input itself
    torch.manual_seed(1)
    ((sep1,), _), ((sep2,), _) = (lora_groups.group_lows(x, [a], 0.5, True) for _ in range(2))
    assert not torch.equal(sep1, sep2)
    assert torch.allclose(sep1, one, rtol=1e-5)  # the first draw is the group's mask


def test_grouped_training_changes_the_loss_only_through_shared_masks():
    """Dropout on: the grouped model trains (finite loss, every adapter gets a gradient) and its
    loss differs from the ungrouped one only because masks are shared."""
    ids = torch.randint(3, 1024, (2, 32), generator=torch.Generator().manual_seed(3))
    loss_a, _, _ = _step(_build(["lora.dropout=0.3"], False), ids)
    loss_b, grads_b, _ = _step(_build(["lora.dropout=0.3"], True), ids)
    assert loss_a != loss_b and abs(loss_a - loss_b) < 0.05
    assert all(g.abs().sum() > 0 for g in grads_b.values())


def test_a_model_without_groups_is_refused_in_one_line():
    cfg = load_config(None, ["quantization.method=none", "lora.target_modules=[o_proj,down_proj]"])
    model = lora.apply_lora(tiny_model(), cfg)
    with pytest.raises(ConfigError, match=r"^lora.group_inputs: True is not allowed for this "
                                          r"model; .* allowed: false$"):
        lora_groups.enable(model)


def test_the_doctor_refuses_a_model_without_groups_before_any_process_starts():
    """The same line, from the model's modules on the meta device: before torchrun."""
    from kit import doctor

    def codes(*overrides):
        found = doctor.preflight(TINY, overrides=["lora.group_inputs=true", *overrides])
        return [(f.code, f.message) for f in found if f.level == "error"]

    assert codes() == []  # all-linear: q/k/v and gate/up in every layer
    assert codes("lora.target_modules=[q_proj,k_proj,v_proj]") == []
    assert codes("lora.target_modules=[o_proj,down_proj]") == [
        ("group_inputs_no_group", shapes.NO_SHARED_INPUT)]
    assert codes("lora.target_modules=[q_proj,v_proj,up_proj]")[0][0] == "group_inputs_no_group"


def test_the_doctor_refuses_groups_on_fused_projections(tmp_path):
    """Phi-3 computes q, k and v in one qkv_proj (and gate/up in one gate_up_proj): nothing to
    group, known from its config alone (the model is built on the meta device)."""
    from transformers import Phi3Config

    from kit import doctor

    Phi3Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=4, vocab_size=256, max_position_embeddings=128,
               bos_token_id=1, eos_token_id=1, pad_token_id=0).save_pretrained(tmp_path)
    found = doctor.preflight(TINY, overrides=[f"model.name={tmp_path}", "lora.group_inputs=true"])
    assert [(f.code, f.message) for f in found if f.level == "error"] == [
        ("group_inputs_no_group", shapes.NO_SHARED_INPUT)]


@pytest.mark.full  # CI time: grouped adapters match ungrouped ones in one process in this module's other tests
def test_grouped_compiled_layers_under_fsdp2_match_the_ungrouped_ones(tmp_path, monkeypatch):
    """The kit's recipe as the benchmarks run it (training.compile=true, a selective recompute
    policy), FSDP2 and NF4 (a world of one), dropout off: the grouped layers compile without a
    graph break, their compiled graphs stack the members' down-projections (a cat of r-row
    weights into 3r and 2r rows), and they train to the losses of the ungrouped eager recipe."""
    import torch._dynamo.utils as dynamo_utils
    import torch._inductor.config as inductor_config

    from kit.train import Recipe

    shutil.copytree(builtin.resolve("kit:tiny-llama"), tmp_path / "model")
    for var in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(var, raising=False)
    stacked = []  # shapes of the concatenations in every graph the compiler lowers

    def cats(graph):
        stacked.extend(tuple(n.meta["val"].shape) for n in graph.nodes
                       if n.target is torch.ops.aten.cat.default and "val" in n.meta)

    # torch's own config.patch, not monkeypatch: pytest 9 reads the old value from the config
    # module's __dict__, finds none, and on teardown deletes the attribute, which hides it from
    # every later compile in the session (issue 28).
    losses = {}
    with inductor_config.patch(fx_graph_cache=False, post_grad_custom_post_pass=cats):
        for group in (False, True):
            cfg = load_config(None, [
                f"model.name={tmp_path / 'model'}", "training.device=cpu", "sharding.engine=fsdp2",
                "quantization.method=nf4", f"training.compile={group}", f"lora.group_inputs={group}",
                "lora.dropout=0", "training.recompute.keeps=attention_matmuls",
                "training.batch_size=2", "data.max_seq_len=32", f"run.output_dir={tmp_path / f'run{group}'}",
            ])
            torch._dynamo.reset()
            dynamo_utils.counters.clear()
            recipe = Recipe(cfg)
            try:
                recipe.setup()
                losses[group] = [recipe.train_step()["loss"] for _ in range(3)]
            finally:
                recipe.cleanup()
            assert sum(dynamo_utils.counters["graph_break"].values()) == 0, dict(
                dynamo_utils.counters["graph_break"])
    torch._dynamo.reset()
    r, hidden = cfg.lora.r, 128
    assert (3 * r, hidden) in stacked and (2 * r, hidden) in stacked, stacked
    assert losses[True] == pytest.approx(losses[False], abs=2e-3), losses
    assert losses[True][-1] < losses[True][0]


def test_grouped_adapters_keep_one_dropped_input_per_group_as_the_estimate_counts():
    """Eager, dropout on, nothing recomputed: grouping keeps fewer bytes for backward, at least
    what kit.budget.estimate credits it with (one dropped input and mask per group, kit.budget.shapes.
    dropped_inputs; on CPU the masks are fp32, not the GPU's bytes, so the measured saving is
    larger)."""
    from levers import saved_bytes

    from kit.budget.estimate import Setup, activation_bytes_per_token_layer
    from kit.budget.shapes import shape_of

    ids = torch.randint(3, 1024, (2, 32), generator=torch.Generator().manual_seed(3))
    kept = {}
    for group in (False, True):
        model = _build(["lora.dropout=0.3"], group)
        params = {p.untyped_storage().data_ptr() for p in model.parameters()}
        torch.manual_seed(7)
        _, kept[group] = saved_bytes(lambda m=model: m(input_ids=ids, labels=ids).loss, params)
    shape = shape_of(builtin.resolve("kit:tiny-llama"))
    per_token = {g: activation_bytes_per_token_layer(shape, Setup(dtype="float32", lora_groups=g))
                 for g in (False, True)}
    credited = (per_token[False] - per_token[True]) * ids.numel() * shape.layers
    assert credited > 0 and credited <= kept[False] - kept[True] <= 1.5 * credited, (credited, kept)
