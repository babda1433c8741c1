"""LoRA adapters (kit.recipe.lora): lora.recompute gives the same result and keeps less for backward;
what the model cannot fit (a target name that matches nothing, sequences longer than its
positions) is refused by kit.recipe.model.build with one line."""

import pytest
import torch
from levers import saved_bytes, tiny_model


def test_recomputed_adapters_give_the_same_result_and_keep_less():
    from kit.config import load_config
    from kit.recipe import lora

    cfg = load_config(None, ["lora.dropout=0.3", "quantization.method=none"])

    def build():
        torch.manual_seed(0)
        model = lora.apply_lora(tiny_model(), cfg)
        for n, p in model.named_parameters():  # non-zero B, so the branch matters
            if "lora_B" in n:
                torch.nn.init.normal_(p, std=0.02)
        return model.train()

    ids = torch.randint(3, 1024, (2, 32), generator=torch.Generator().manual_seed(3))
    plain, recomputed = build(), build()
    assert lora.recompute_adapters(recomputed) == 14  # 7 linear layers x 2 decoder layers
    results = []
    for model in (plain, recomputed):
        torch.manual_seed(7)  # the same dropout masks in both
        out, kept = saved_bytes(lambda m=model: m(input_ids=ids, labels=ids).loss)
        out.backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
        results.append((out.item(), grads, kept))
    (loss_a, grads_a, kept_a), (loss_b, grads_b, kept_b) = results
    assert loss_a == pytest.approx(loss_b, abs=1e-6)
    assert grads_a.keys() == grads_b.keys()
    for name in grads_a:
        assert torch.allclose(grads_a[name], grads_b[name], atol=1e-6), name
    assert kept_b < 0.85 * kept_a, (kept_a, kept_b)


LINEARS = "down_proj, gate_proj, k_proj, lm_head, o_proj, q_proj, up_proj, v_proj"


@pytest.mark.parametrize("override, line", [
    ("lora.target_modules=[q_proj,q_prj,v_proj]",  # PEFT alone would train q and v, silently
     f"lora.target_modules: 'q_prj' matches no module of kit:tiny-llama; its linear layers: {LINEARS}"),
    ("lora.target_modules=[q_prj,v_proj,vproj]",
     f"lora.target_modules: 'q_prj', 'vproj' match no module of kit:tiny-llama; its linear layers: "
     f"{LINEARS}"),
    ("lora.target_modules=[query_key_value]",  # Falcon's names: PEFT's own error, in one line
     f"lora.target_modules: 'query_key_value' matches no module of kit:tiny-llama; its linear "
     f"layers: {LINEARS}"),
    ("data.max_seq_len=4096",  # accepted before: 30x slower on this CPU
     "data.max_seq_len: 4096 is not allowed; kit:tiny-llama has max_position_embeddings=512"),
], ids=["one-typo", "two-typos", "falcon-names", "max_seq_len"])  # fmt: skip
def test_build_refuses_what_the_model_cannot_fit(override, line):
    from kit.config import ConfigError, load_config
    from kit.recipe import model

    cfg = load_config(None, ["quantization.method=none", "model.dtype=float32", override])
    with pytest.raises(ConfigError) as raised:
        model.build(cfg, torch.device("cpu"))
    assert str(raised.value) == line


# ------------------------------------------------------------------- training in process (03)


def test_training_moves_b_first_then_a_and_leaves_the_callers_state():
    from kit.config import load_config
    from kit.lab import lora_adapters, quantize_nf4
    from kit.recipe import lora

    cfg = load_config(None, ["model.name=kit:tiny-llama"])
    model = lora.apply_lora(quantize_nf4.load_on_cpu("kit:tiny-llama"), cfg)  # NF4, as notebook 03
    rows, _ = lora.sample_rows("kit:tiny-llama")
    assert lora_adapters.adapter_norms(model)["B"] == 0.0 and lora_adapters.adapter_norms(model)["A"] > 0
    model.eval()
    threads, rng = torch.get_num_threads(), torch.random.get_rng_state()
    history = lora_adapters.train_adapters(model, rows, steps=3, lr=1e-3)
    assert [h["step"] for h in history] == [1, 2, 3]
    # A's gradient is s·Bᵀ·(output gradient): zero while B is, so only B moves at step 1.
    assert history[0]["|B|"] > 0 and history[0]["|A - A0|"] == 0.0
    assert 0 < history[1]["|A - A0|"] < history[2]["|A - A0|"]
    assert history[-1]["|s·BA|"] == pytest.approx(lora_adapters.adapter_norms(model)["update"])
    ids = torch.arange(3, 35).reshape(2, 16)
    assert lora_adapters.adapter_changes_nothing_at_start(model, ids) > 0  # the adapter now changes logits
    assert not model.training and torch.get_num_threads() == threads
    assert torch.equal(torch.random.get_rng_state(), rng)


def test_scaling_runs_scale_by_each_convention_from_the_same_start():
    import math

    from kit.lab import lora_adapters

    runs = lora_adapters.scaling_runs("kit:tiny-llama", ranks=[4, 64], lrs=[1e-3], steps=3, alpha=16)
    by = {(run["scaling"], run["r"]): run for run in runs}
    paper, rs, ratio = lora_adapters.SCALINGS
    assert [by[(paper, r)]["scale"] for r in (4, 64)] == [4.0, 0.25]
    assert [by[(rs, r)]["scale"] for r in (4, 64)] == [8.0, 2.0]
    assert [by[(ratio, r)]["scale"] for r in (4, 64)] == [2.0, 2.0]
    # At r=64 with alpha 16, alpha/sqrt(r) = 2 = the alpha = 2r scale: the same run, to the bit.
    assert by[(rs, 64)]["losses"] == by[(ratio, 64)]["losses"]
    # Every run starts from the same base on the same batch: the same first loss (B = 0).
    assert len({run["losses"][0] for run in runs}) == 1
    assert all(math.isfinite(run["val_loss"]) and run["|s·BA|"] > 0 for run in runs)
    summary = lora_adapters.scaling_summary(runs)
    assert [row["scaling"] for row in summary] == list(lora_adapters.SCALINGS)
    shrink = by[(paper, 64)]["|s·BA|"] / by[(paper, 4)]["|s·BA|"]
    assert summary[0]["|s·BA| r=64 / r=4"] == round(shrink, 1)
    findings = lora_adapters.scaling_findings(runs)
    assert [(row["lr"], row["scaling"]) for row in findings] == [(1e-3, s) for s in lora_adapters.SCALINGS]
    assert findings[0]["|s·BA| as r grows"] == "shrinks" and shrink < 0.8
    # The rounding probe is the same run (rsLoRA, r=4 here), then the run on nudged weights.
    once, nudged = lora_adapters.run_twice_one_ulp_apart("kit:tiny-llama", 4, 1e-3, 3)
    assert once == by[(rs, 4)]["val_loss"] and abs(once - nudged) < 1e-4


def test_scaling_findings_name_where_the_highest_rank_ends():
    """The words section 6 checks on every CPU, from made-up runs: the update's ratio classes
    (0.8 and 1.25 apart from 'about the same') and the highest rank's place among the losses."""
    from kit.lab import lora_adapters

    paper, rs, ratio = lora_adapters.SCALINGS
    def runs(label, updates, losses):
        return [{"lr": 0.01, "scaling": label, "r": r, "|s·BA|": u, "val_loss": v}
                for r, u, v in zip((4, 16, 64), updates, losses, strict=True)]

    made = (runs(paper, (1, 0.7, 0.5), (6.23, 6.24, 6.14)) + runs(rs, (1, 1.1, 1.2), (6.42, 6.34, 6.51))
            + runs(ratio, (1, 3, 8), (6.40, 6.42, 6.43)))
    found = {row["scaling"]: (row["|s·BA| as r grows"], row["held-out loss"])
             for row in lora_adapters.scaling_findings(made)}
    assert found == {paper: ("shrinks", "r=64 lowest"), rs: ("about the same", "r=64 highest"),
                     ratio: ("grows", "all ranks within 0.05")}


def test_adapter_state_against_the_base_counts_what_loading_holds():
    from kit.budget import shapes
    from kit.lab import lora_adapters, quantize_nf4

    found = lora_adapters.state_against_base("kit:tiny-llama", ranks=(8,))
    assert found["state"]["all-linear (QLoRA paper)"] == [16 * shapes.lora_params(
        shapes.shape_of("kit:tiny-llama"), 8, "all-linear")]  # fmt: skip
    # The NF4 base as bitsandbytes holds it: packed weights and the rest (the scales, which are
    # not parameters, are the small difference).
    loaded = quantize_nf4.quantized_bytes(quantize_nf4.load_on_cpu("kit:tiny-llama"))["total"]
    assert loaded < found["base_nf4"] < 1.02 * loaded
