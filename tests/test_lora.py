"""LoRA adapters (kit.lora): lora.recompute gives the same result and keeps less for backward."""

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
