"""Grouped experts (kit.recipe.grouped_experts): the forward every MoE layer runs equals the
per-expert loop it replaced (kit.recipe.experts.loop_forward), outputs and gradients, for every
MoE family the kit builds; on a Hopper GPU `torch._grouped_mm` equals the portable fallback."""

from __future__ import annotations

import pytest
import torch
from test_moe import FAMILIES, built, outermost_wrapper


def chain_of(wrapper):
    from kit.recipe import experts

    return experts._chain(wrapper)


def routed(tokens: int, experts: int, k: int, unused: int, generator=None, device="cpu"):
    """Top-k expert ids (distinct per token, as a router's top-k) that never pick expert
    `unused` (an empty group), and routing weights."""
    scores = torch.rand(tokens, experts, generator=generator, device=device)
    scores[:, unused] = -1
    return scores.topk(k).indices, torch.rand(tokens, k, generator=generator, device=device)


def run(forward, ex, x, index, weights, lora, seed):
    torch.manual_seed(seed)  # the same dropout masks for both forwards (drawn in token order)
    return forward(ex, x, index, weights, lora=lora)


@pytest.mark.parametrize("dropout", [0.0, 0.3])
@pytest.mark.parametrize("quantization", ["nf4", "none"])
@pytest.mark.parametrize("name", FAMILIES)
def test_grouped_forward_and_backward_equal_the_per_expert_loop(name, quantization, dropout):
    from kit.recipe import experts

    model = built(name, "model.dtype=float32", f"quantization.method={quantization}",
                  f"lora.dropout={dropout}")  # fmt: skip
    wrapper = outermost_wrapper(model).train()
    chain = chain_of(wrapper)
    ex = chain[-1]
    # what runs: the wrapper's forward calls experts.forward (the grouped one), as does the
    # experts module itself once its stacks are NF4
    assert wrapper.forward.__func__ is experts.adapted_forward and experts.forward.__module__ \
        == "kit.recipe.grouped_experts"
    assert quantization == "none" or ex.forward.__func__ is experts.forward
    torch.manual_seed(0)
    for w in chain[:-1]:  # a trained-looking adapter: B no longer zero
        torch.nn.init.normal_(w.lora_B["default"].weight, std=0.5)
    lora = experts.lora_factors(wrapper)
    assert sorted(lora) == sorted(w.parameter_name for w in chain[:-1])
    assert all(branch[3] == dropout for branches in lora.values() for branch in branches)
    index, weights = routed(24, ex.num_experts, model.config.num_experts_per_tok, unused=1)
    x = torch.randn(24, model.config.hidden_size, requires_grad=True)
    weights.requires_grad_()
    factors = [t for branches in lora.values() for a, b, _, _ in branches for t in (a, b)]
    got = run(experts.forward, ex, x, index, weights, lora, seed=7)
    want = run(experts.loop_forward, ex, x, index, weights, lora, seed=7)
    scale = want.abs().max()
    assert scale > 0 and (got - want).abs().max() < 1e-5 * scale
    cotangent = torch.randn_like(want)
    g = torch.autograd.grad(got, (x, weights, *factors), cotangent)
    r = torch.autograd.grad(want, (x, weights, *factors), cotangent)
    for mine, ref in zip(g, r, strict=True):  # input, routing weights, every A and B
        assert ref.abs().max() > 0 and (mine - ref).abs().max() < 1e-5 * ref.abs().max()
    if dropout:  # the masks matter: another seed gives another output
        other = run(experts.forward, ex, x, index, weights, lora, seed=8)
        assert (other - got).abs().max() > 1e-3 * scale


def test_the_fallback_is_chosen_off_hopper_and_keeps_no_dequantized_stack():
    """On the CPU the loop over sorted groups runs; backward dequantizes again: the graph holds
    the packed stack and its stored state, no (E, out, in) tensor in the compute dtype."""
    from kit.recipe import experts, grouped_experts

    assert not grouped_experts.grouped_kernel(torch.device("cpu"), torch.bfloat16)
    model = built("kit:tiny-qwen3-moe", "model.dtype=float32")
    wrapper = outermost_wrapper(model).train()
    ex = chain_of(wrapper)[-1]
    index, weights = routed(16, ex.num_experts, 2, unused=0)
    x = torch.randn(16, model.config.hidden_size, requires_grad=True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        out = experts.forward(ex, x, index, weights, lora=experts.lora_factors(wrapper))
    stacks = {tuple(s["shape"]) for s in ex._kit_nf4.values()} | {
        (s["shape"][0], s["out"], s["shape"][1] * s["shape"][2] // s["out"])
        for s in ex._kit_nf4.values()}  # fmt: skip
    assert saved and not any(tuple(t.shape) in stacks for t in saved)
    out.sum().backward()
    assert x.grad is not None and x.grad.abs().max() > 0


def _experts_on_gpu(family: str, hidden: int, inner: int, count: int, k: int):
    """One transformers experts module of `family`'s class, bf16 on the GPU, stacks in NF4 as
    the kit stores them, and LoRA factors (r 16 and r 4: the padded rank) in fp32."""
    import importlib

    from transformers import AutoConfig

    from kit.recipe import experts

    extra = {"gpt_oss": dict(num_local_experts=count), "qwen3_moe": dict(
        num_experts=count, moe_intermediate_size=inner)}[family]  # fmt: skip
    cfg = AutoConfig.for_model(family, hidden_size=hidden, intermediate_size=inner,
                               num_experts_per_tok=k, **extra)  # fmt: skip
    modeling = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
    cls = next(getattr(modeling, n) for n in dir(modeling) if n.endswith("Experts"))
    torch.manual_seed(0)
    ex = cls(cfg).to("cuda", torch.bfloat16)
    for p in ex.parameters():
        torch.nn.init.normal_(p, std=0.05)
        p.requires_grad_(False)
    kwargs = dict(blocksize=64, compress_statistics=True, quant_type="nf4",
                  quant_storage=torch.bfloat16)  # fmt: skip
    lora = {}
    for name in experts.weight_names(ex):
        experts.quantize_weight(ex, name, ex._parameters[name].data, kwargs)
        out = ex._kit_nf4[name]["out"]
        inn = ex._kit_nf4[name]["shape"][1] * ex._kit_nf4[name]["shape"][2] // out
        lora[name] = [(torch.randn(count * r, inn, device="cuda") * 0.05,
                       torch.randn(out, r * count, device="cuda") * 0.05, 2.0, 0.1)
                      for r in (16, 4)]  # fmt: skip
    for branches in lora.values():
        for a, b, _, _ in branches:
            a.requires_grad_(), b.requires_grad_()
    return ex, lora


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0),
                    reason="needs a CUDA GPU of compute capability 9.0+ (torch._grouped_mm)")
@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
def test_grouped_mm_equals_the_fallback_on_the_gpu(family, monkeypatch):
    """bf16 on Hopper: `torch._grouped_mm` against the loop over groups (same dequantized
    stack, same masks), forward and backward, within bf16's rounding of the largest value."""
    from kit.recipe import experts, grouped_experts

    ex, lora = _experts_on_gpu(family, hidden=512, inner=256, count=16, k=4)
    assert grouped_experts.grouped_kernel(torch.device("cuda"), torch.bfloat16)
    index, weights = routed(1000, 16, 4, unused=3, device="cuda")
    weights = weights.to(torch.bfloat16).requires_grad_()
    x = torch.randn(1000, 512, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    factors = [t for branches in lora.values() for a, b, _, _ in branches for t in (a, b)]
    results = []
    for fast in (True, False):
        monkeypatch.setattr(grouped_experts, "grouped_kernel", lambda *_, fast=fast: fast)
        out = run(experts.forward, ex, x, index, weights, lora, seed=3)
        seeded = torch.Generator("cuda").manual_seed(1)  # the same cotangent for both
        cot = torch.randn(out.shape, device="cuda", generator=seeded, dtype=out.dtype)
        results.append((out, *torch.autograd.grad(out, (x, weights, *factors), cot)))
    for mine, ref in zip(*results, strict=True):  # output, input, routing weights, As and Bs
        top = ref.float().abs().max()
        assert top > 0 and (mine.float() - ref.float()).abs().max() < 0.02 * top
