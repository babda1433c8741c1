"""The long-context levers of a recomputed layer. training.recompute.attention_tile_tokens
(kit.recipe.levers.attention_tiles): each layer's attention block a tile of queries at a time gives the
loss and gradients of the block run whole, with the forward's dropout masks in backward, keeping
only its input. training.recompute.lean_norms (kit.recipe.levers.norms): the RMSNorms' own forward, op
for op, keeping no fp32 copy."""

import pytest
import torch
from levers import kept_by
from test_recompute import _nf4_layer_model
from transformers import AutoModelForCausalLM

from kit.config import ConfigError, load_config
from kit.inputs import builtin
from kit.recipe.levers import norms
from kit.recipe.levers.attention_tiles import tile_attention
from kit.recipe.recompute import enable_activation_checkpointing

IDS = torch.randint(3, 1000, (2, 48), generator=torch.Generator().manual_seed(3))


def _run(model, tile: int, dropout: float = 0.0, recompute: bool = False, lean: bool = False):
    for m in model.modules():
        if isinstance(m, torch.nn.Dropout):
            m.p = dropout
    if tile:
        assert tile_attention(model, tile) == 2
    if lean:
        assert norms.lean_norms(model) > 0
    if recompute:
        enable_activation_checkpointing(model)
    torch.manual_seed(7)
    ids = IDS % model.config.vocab_size
    loss = model(input_ids=ids, attention_mask=torch.ones_like(ids), labels=ids,
                 use_cache=False).loss
    loss.backward()
    return loss.item(), {n: p.grad for n, p in model.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("recompute", [False, True], ids=["alone", "inside-layer-recompute"])
def test_tiled_attention_gives_the_same_loss_and_gradients(recompute):
    """NF4 + LoRA (the 8B shape's ratios), dropout off: tiles of 16 queries out of 48 (the second
    and third causal at their lower right) give the loss and every adapter gradient of the
    attention run whole, alone and inside whole-layer recompute."""
    loss0, grads0 = _run(_nf4_layer_model()[0], 0)
    loss, grads = _run(_nf4_layer_model()[0], 16, recompute=recompute)
    assert loss == pytest.approx(loss0, abs=1e-6)
    assert sum("self_attn" in n and g.abs().sum() > 0 for n, g in grads.items()) == 16
    for name, g in grads.items():
        assert torch.allclose(g, grads0[name], atol=1e-6), name


@pytest.mark.parametrize("start, heads, key_heads", [(0, 4, 2), (12, 4, 2), (24, 8, 2), (12, 4, 4)])
def test_a_tiles_kernels_give_what_sdpa_gives_with_a_lower_right_mask(start, heads, key_heads):
    """kit.recipe.levers.tile_kernels: a tile of 8 queries at `start` over keys 0 .. start + 8, run as
    the unmasked keys (grouped query heads folded into rows) and the causal diagonal block, merged
    by log-sum-exp; backward from the merged output and log-sum-exp alone. Output and gradients
    are SDPA's with torch's causal_lower_right mask (fp32, CPU)."""
    from torch.nn.attention.bias import causal_lower_right

    from kit.recipe.levers import tile_kernels

    g = torch.Generator().manual_seed(start)
    q = torch.randn(2, heads, 8, 16, generator=g, requires_grad=True)
    k, v = (torch.randn(2, key_heads, start + 8, 16, generator=g, requires_grad=True)
            for _ in range(2))
    mask = causal_lower_right(8, start + 8) if start else None
    ref = torch.nn.functional.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, is_causal=start == 0, scale=0.25, enable_gqa=True)
    dout = torch.randn(ref.shape, generator=g)
    ref.backward(dout)
    out, lse, aux = tile_kernels.forward(q.detach(), k.detach(), v.detach(), start, 0.25)
    dk, dv = torch.zeros_like(k), torch.zeros_like(v)
    dq = tile_kernels.backward(dout, q.detach(), k.detach(), v.detach(), out, lse, aux, start,
                               0.25, dk, dv)
    for got, want in ((out, ref), (dq, q.grad), (dk, k.grad), (dv, v.grad)):
        assert torch.allclose(got, want, atol=1e-5), (got - want).abs().max()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("kernel", ["flash", "cudnn"])
@pytest.mark.parametrize("start", [0, 384])
def test_on_a_gpu_each_tile_kernel_gives_what_sdpa_gives_in_fp32(kernel, start, monkeypatch):
    """The GPU kernels (KIT_TILE_KERNEL: PyTorch's flash, cuDNN's) on bf16 tiles of the 8B
    shape's heads (32 query heads on 8 key heads, head_dim 128): output and gradients within bf16's
    rounding of SDPA's math path in fp32 with the lower-right causal mask."""
    from torch.nn.attention.bias import causal_lower_right

    from kit.recipe.levers import tile_kernels

    if kernel == "cudnn" and torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("cuDNN's tile kernel is the kit's choice on Hopper GPUs only")
    monkeypatch.setenv("KIT_TILE_KERNEL", kernel)
    g = torch.Generator("cuda").manual_seed(start)
    q, k, v = (torch.randn(1, h, t, 128, generator=g, device="cuda", dtype=torch.bfloat16)
               for h, t in ((32, 128), (8, start + 128), (8, start + 128)))
    dout = torch.randn(q.shape, generator=g, device="cuda", dtype=torch.bfloat16)
    ref = [x.float().requires_grad_() for x in (q, k, v)]
    mask = causal_lower_right(128, start + 128) if start else None
    with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.MATH):
        want = torch.nn.functional.scaled_dot_product_attention(
            *ref, attn_mask=mask, is_causal=start == 0, scale=128 ** -0.5, enable_gqa=True)
    want.backward(dout.float())
    out, lse, aux = tile_kernels.forward(q, k, v, start, 128 ** -0.5)
    dk, dv = torch.zeros_like(k), torch.zeros_like(v)
    dq = tile_kernels.backward(dout, q, k, v, out, lse, aux, start, 128 ** -0.5, dk, dv)
    for got, exp, name in ((out, want, "out"), (dq, ref[0].grad, "dq"), (dk, ref[1].grad, "dk"),
                           (dv, ref[2].grad, "dv")):
        err = (got.float() - exp).abs().max().item()
        assert err < 0.02 * max(1.0, exp.abs().max().item()), (name, err)


def test_tiled_attention_runs_its_forward_twice_a_step_inside_layer_recompute(monkeypatch):
    """Inside whole-layer recompute, the recompute's tiles keep their output and log-sum-exp for
    the backward that follows: attention's forward runs twice per tile and step (forward,
    recompute), not three times (round 5's SDPA path ran it again in backward)."""
    from kit.recipe.levers import tile_kernels

    starts, forward = [], tile_kernels.forward

    def counted(q, k, v, start, scale):
        starts.append(start)
        return forward(q, k, v, start, scale)

    monkeypatch.setattr(tile_kernels, "forward", counted)
    _run(_nf4_layer_model()[0], 16, recompute=True)
    assert sorted(starts) == [0] * 4 + [16] * 4 + [32] * 4  # 2 layers x 3 tiles x 2


def test_tiled_attention_with_query_and_key_norms():
    """Qwen3's attention (an RMSNorm on each head of q and k, bias-free): every weight's gradient,
    the norms' included, through tiles of 20 (uneven: 20, 20, 8)."""
    def model():
        torch.manual_seed(0)
        return AutoModelForCausalLM.from_pretrained(builtin.resolve("kit:tiny-qwen3"),
                                                    dtype=torch.float32).train()

    loss0, grads0 = _run(model(), 0)
    loss, grads = _run(model(), 20)
    assert loss == pytest.approx(loss0, abs=1e-5)
    assert any("q_norm" in n for n in grads)
    for name, g in grads.items():
        assert torch.allclose(g, grads0[name], atol=1e-5), name


def test_tiled_attention_backward_uses_the_forwards_dropout_masks():
    """Dropout 0.3 on q/k/v/o's adapters: backward restores each projection's RNG state, so the
    gradient is that of the loss forward computed. A small step against it (same seed, same
    masks) lowers the loss by step x |g|^2."""
    model = _nf4_layer_model()[0]
    loss0, grads = _run(model, 16, dropout=0.3)
    params = dict(model.named_parameters())
    eps, names = 1e-2, [n for n in grads if "self_attn" in n]
    with torch.no_grad():
        for n in names:
            params[n] -= eps * grads[n]
    torch.manual_seed(7)
    ids = IDS
    loss1 = model(input_ids=ids, attention_mask=torch.ones_like(ids), labels=ids,
                  use_cache=False).loss.item()
    predicted = eps * sum(grads[n].pow(2).sum().item() for n in names)
    assert predicted > 1e-4 and loss0 - loss1 == pytest.approx(predicted, rel=0.05)


def test_tiled_attention_keeps_only_its_input():
    """With nothing else recomputed, the tiled block keeps its input (and the tokens' RoPE
    angles) instead of q, k, v, attention's output and the adapters' dropped inputs."""
    ids = torch.randint(3, 1000, (1, 128), generator=torch.Generator().manual_seed(4))
    kept = {}
    for tile in (0, 32):
        model = _nf4_layer_model()[0]
        if tile:
            tile_attention(model, tile)
        kept[tile] = kept_by(model, ids)
    # Byte counts follow from the shapes alone: measured 3,795,980 against 4,881,420 (the MLP,
    # norms and loss keep the rest); the block kept whole would put them level.
    assert kept[32] < 0.8 * kept[0], kept


def test_attention_tiles_are_refused_where_they_cannot_run():
    """One line each: compiled layers, a selective policy, grouped adapters (config), and a
    family with sliding-window attention (the model)."""
    for extra, words in ((["training.compile=true"], "training.compile=true"),
                         (["training.recompute.keeps=matmuls"], "selective"),
                         (["lora.group_inputs=true"], "lora.group_inputs=true")):
        with pytest.raises(ConfigError) as e:
            load_config(None, ["training.recompute.attention_tile_tokens=16", *extra])
        line = str(e.value)
        assert "\n" not in line and "attention_tile_tokens" in line and words in line, line
    torch.manual_seed(0)
    gemma2 = AutoModelForCausalLM.from_pretrained(builtin.resolve("kit:tiny-gemma2"))
    with pytest.raises(ConfigError, match="sliding-window"):
        tile_attention(gemma2, 16)


def _qwen3():
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_pretrained(builtin.resolve("kit:tiny-qwen3"),
                                                dtype=torch.float32).train()


def test_lean_norms_compute_what_the_models_norms_compute(monkeypatch):
    """One Llama RMSNorm in bf16, 15 tokens in chunks of 4: the same output bit for bit and the
    same input and weight gradients; then Qwen3 whole (its layer norms and the per-head q/k norms)
    with attention tiles: the loss and every gradient of the plain model."""
    import types

    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    monkeypatch.setattr(norms, "ROWS", 4)
    torch.manual_seed(0)
    norm = LlamaRMSNorm(64, eps=1e-5).to(torch.bfloat16)
    norm.weight.data.normal_(1, 0.1)
    x = torch.randn(3, 5, 64, dtype=torch.bfloat16, requires_grad=True)
    outs = []
    for lean in (False, True):
        if lean:
            norm.forward = types.MethodType(norms._forward, norm)
        x.grad = norm.weight.grad = None
        y = norm(x)
        y.backward(torch.ones_like(y).normal_(generator=torch.Generator().manual_seed(1)))
        outs.append((y.detach(), x.grad, norm.weight.grad))
    for a, b in zip(*outs, strict=True):
        assert torch.equal(a, b)
    loss0, grads0 = _run(_qwen3(), 0)
    loss, grads = _run(_qwen3(), 20, lean=True)
    assert loss == pytest.approx(loss0, abs=1e-5)
    assert any("norm" in n for n in grads)
    for name, g in grads.items():
        assert torch.allclose(g, grads0[name], atol=1e-5), name


def test_lean_norms_keep_less():
    """A bf16 model's autograd keeps less with lean norms: per norm the fp32 copy of its input
    (4 bytes a value) gives way to 4 bytes a token (and the second norm's bf16 input)."""
    ids = torch.randint(3, 1000, (1, 128), generator=torch.Generator().manual_seed(4))
    kept = {}
    for lean in (False, True):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_pretrained(builtin.resolve("kit:tiny-llama"),
                                                     dtype=torch.bfloat16).train()
        if lean:
            assert norms.lean_norms(model) == 2 * model.config.num_hidden_layers
        kept[lean] = kept_by(model, ids)
    h, layers = model.config.hidden_size, model.config.num_hidden_layers
    fp32_copies = layers * 2 * 128 * h * 4
    # Measured: exactly the fp32 copies (the second norm's input is kept by its residual anyway).
    assert kept[False] - kept[True] >= 0.9 * fp32_copies, (kept, fp32_copies)


def test_lean_norms_are_refused_where_they_cannot_run():
    with pytest.raises(ConfigError) as e:
        load_config(None, ["training.recompute.lean_norms=true", "training.compile=true"])
    assert "\n" not in str(e.value) and "lean_norms" in str(e.value)
    torch.manual_seed(0)
    gemma2 = AutoModelForCausalLM.from_pretrained(builtin.resolve("kit:tiny-gemma2"))
    with pytest.raises(ConfigError, match="Gemma2RMSNorm"):
        norms.lean_norms(gemma2)
