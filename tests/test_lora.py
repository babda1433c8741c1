"""LoRA adapters (kit.lora): lora.recompute gives the same result and keeps less for backward;
what the model cannot fit (a target name that matches nothing, sequences longer than its
positions) is refused by kit.model.build with one line."""

import pytest
import torch
from levers import saved_bytes, tiny_model


def test_recomputed_adapters_give_the_same_result_and_keep_less():
    from kit import lora
    from kit.config import load_config

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
    from kit import model
    from kit.config import ConfigError, load_config

    cfg = load_config(None, ["quantization.method=none", "model.dtype=float32", override])
    with pytest.raises(ConfigError) as raised:
        model.build(cfg, torch.device("cpu"))
    assert str(raised.value) == line
