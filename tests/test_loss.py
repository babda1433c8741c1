"""training.loss: the chunked and the fused loss give transformers' loss and gradients (kit.recipe.levers.loss)."""

import pytest
import torch
from levers import tiny_model
from transformers.loss.loss_utils import ForCausalLMLoss

from kit.recipe.levers.loss import chunked_causal_lm_loss, install


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_items", [None, 37])
def test_chunked_loss_equals_transformers_loss(dtype, num_items):
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 50, 97, generator=g).to(dtype)
    labels = torch.randint(0, 97, (3, 50), generator=g)
    labels[0, :7] = -100
    labels[2, 40:] = -100
    a = logits.clone().requires_grad_()
    b = logits.clone().requires_grad_()
    n = None if num_items is None else torch.tensor(num_items)
    ref = ForCausalLMLoss(a, labels, 97, num_items_in_batch=n)
    got = chunked_causal_lm_loss(b, labels, 97, num_items_in_batch=n, chunk_tokens=16)
    ref.backward()
    got.backward()
    assert got.dtype == torch.float32
    assert torch.allclose(got, ref, rtol=1e-6, atol=1e-6)
    assert torch.allclose(b.grad.float(), a.grad.float(), rtol=1e-3, atol=1e-6)


def test_chunked_loss_in_the_model_gives_the_same_loss():
    model = tiny_model()
    ids = torch.randint(3, 1024, (2, 24), generator=torch.Generator().manual_seed(1))
    ref = model(input_ids=ids, labels=ids).loss
    install(model, "chunked")
    assert model.loss_function is chunked_causal_lm_loss
    got = model(input_ids=ids, labels=ids).loss
    assert torch.allclose(got, ref, rtol=1e-6)


def _frozentiny_model():
    model = tiny_model()
    for p in model.parameters():  # only the layers train, as under LoRA: the head is frozen
        p.requires_grad_(False)
    for p in model.model.layers.parameters():
        p.requires_grad_(True)
    return model.train()


def test_fused_loss_equals_transformers_loss_and_gradients(monkeypatch):
    import kit.recipe.levers.loss

    monkeypatch.setattr(kit.recipe.levers.loss, "FUSED_CHUNK_LOGITS", 7 * 1024)  # several chunks of 7 tokens
    ids = torch.randint(3, 1024, (2, 24), generator=torch.Generator().manual_seed(1))
    labels = ids.clone()
    labels[0, :5] = -100
    ref, fused = _frozentiny_model(), _frozentiny_model()
    install(fused, "fused")
    for n in (None, torch.tensor(30)):
        extra = {} if n is None else {"num_items_in_batch": n}
        want = ref(input_ids=ids, labels=labels, **extra)
        got = fused(input_ids=ids, labels=labels, **extra)
        assert got.logits.numel() == 0  # training: no logits for the whole batch exist
        assert torch.allclose(got.loss, want.loss, rtol=1e-6), (got.loss, want.loss)
        want.loss.backward()
        got.loss.backward()
        for (name, a), (_, b) in zip(ref.named_parameters(), fused.named_parameters(), strict=True):
            if a.grad is not None:
                assert torch.allclose(b.grad, a.grad, rtol=1e-4, atol=1e-7), name
                a.grad = b.grad = None
    fused.eval()
    with torch.no_grad():  # evaluation: the plain head, real logits, the same loss
        out = fused(input_ids=ids, labels=labels)
        assert out.logits.shape == (2, 24, 1024)
        assert out.loss.item() == pytest.approx(ref(input_ids=ids, labels=labels).loss.item(), rel=1e-6)


def test_fused_loss_refuses_heads_it_cannot_fuse():
    from kit.config import ConfigError

    trainable = tiny_model()  # from_pretrained leaves the head trainable
    with pytest.raises(ConfigError, match="training.loss: 'fused' is not allowed for this model; "
                                          "it needs a frozen output head"):
        install(trainable, "fused")
    capped = _frozentiny_model()
    capped.config.final_logit_softcapping = 30.0
    with pytest.raises(ConfigError, match="its logits pass through final_logit_softcapping"):
        install(capped, "fused")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_loss_kernel_computes_what_the_eager_chunks_do_at_a_real_vocabulary(monkeypatch, dtype):
    """The fused loss on a GPU: the Triton pass (kit.recipe.levers.loss_kernel, its larger chunks,
    the last one shorter) against the eager chunks, at Llama-3's vocabulary with ignored rows:
    the same loss and hidden-state gradient (fp32: to fp32's rounding; bf16: to bf16's), and the
    loss alone where no gradient is asked."""
    from kit.recipe.levers import loss as kloss

    assert kloss._kernel(torch.device("cuda"))  # the path training takes on this GPU
    g = torch.Generator(device="cuda").manual_seed(0)
    hidden = torch.randn(1100, 1024, device="cuda", dtype=dtype, generator=g)
    weight = torch.randn(128256, 1024, device="cuda", dtype=dtype, generator=g) * 0.05
    target = torch.randint(0, 128256, (1100,), device="cuda", generator=g)
    target[:50] = -100
    denominator = (target != -100).sum().float()
    chunk = kloss.FUSED_CHUNK_LOGITS // 128256 // 2  # several chunks on either path
    got = {}
    for kernel in (False, True):
        monkeypatch.setattr(kloss, "_kernel", lambda device, k=kernel: k)
        h = hidden.clone().requires_grad_()
        loss = kloss._HeadAndLoss.apply(h, weight, target, -100, denominator, chunk)
        loss.backward()
        with torch.no_grad():
            alone = kloss._HeadAndLoss.apply(hidden, weight, target, -100, denominator, chunk)
        got[kernel] = (loss.item(), alone.item(), h.grad.float())
    (le, _, ge), (lk, ak, gk) = got[False], got[True]
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    assert lk == pytest.approx(le, rel=tol) and ak == pytest.approx(lk, rel=1e-6)
    assert gk[:50].abs().max() == 0 and gk.abs().sum() > 0  # ignored rows: no gradient
    assert (ge - gk).abs().max() <= (1e-4 if dtype == torch.float32 else 2e-2) * ge.abs().max()
