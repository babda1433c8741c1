"""Grouped experts (kit.recipe.grouped_experts): the forward every MoE layer runs equals the
per-expert loop it replaced (kit.recipe.experts.loop_forward), outputs and gradients, for every
MoE family the kit builds; on a Hopper GPU `torch._grouped_mm` equals the portable fallback."""

from __future__ import annotations

import collections

import pytest
import torch
from conftest import ROOT
from test_moe import FAMILIES, built, outermost_wrapper
from torch.utils._python_dispatch import TorchDispatchMode


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
    torch.manual_seed(seed)  # the same dropout seeds for both forwards
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
    # what runs: the wrapper's forward calls experts.forward (the grouped one: model.experts'
    # default), as does the experts module itself once its stacks are NF4
    assert wrapper.forward.__func__ is experts.adapted_forward and not ex._kit_loop
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


class _Ops(TorchDispatchMode):
    """Counts the calls of each op that reach the kernels (a result a recompute policy kept is
    handed back by torch's checkpoint above this mode, and never reaches it)."""

    def __init__(self):
        super().__init__()
        self.calls = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.calls[func] += 1
        return func(*args, **(kwargs or {}))


def test_model_experts_loop_runs_the_per_expert_loop_and_gives_the_grouped_loss():
    """model.experts=loop (kit.recipe.experts.choose): every experts module runs transformers'
    loop, one hit expert at a time (adding each expert's rows into the output: `index_add_`,
    which the grouped forward never calls), and the model's loss is the grouped forward's."""
    from kit.recipe import experts

    model = built("kit:tiny-qwen3-moe", "model.dtype=float32", "model.experts=loop")
    found = experts.find(model)
    assert found and all(m._kit_loop for _, m in found)
    ids = torch.randint(0, model.config.vocab_size, (2, 16),
                        generator=torch.Generator().manual_seed(0))
    losses = {}
    for how in ("loop", "grouped"):
        assert experts.choose(model, how) == len(found)
        with torch.no_grad(), _Ops() as ops:
            losses[how] = model(input_ids=ids, labels=ids).loss
        assert (ops.calls[torch.ops.aten.index_add_.default] > 0) == (how == "loop")
    assert abs(losses["loop"] - losses["grouped"]) < 1e-5 * losses["grouped"]


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


def _experts_on(device: str, family: str, hidden: int, inner: int, count: int, k: int,
                ranks=(16, 4)):
    """One transformers experts module of `family`'s class, bf16 on `device`, stacks in NF4 as
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
    ex = cls(cfg).to(device, torch.bfloat16)
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
        lora[name] = [(torch.randn(count * r, inn, device=device) * 0.05,
                       torch.randn(out, r * count, device=device) * 0.05, 2.0, 0.1)
                      for r in ranks]  # fmt: skip
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

    ex, lora = _experts_on("cuda", family, hidden=512, inner=256, count=16, k=4)
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


def test_recompute_keeps_the_grouped_gemms(monkeypatch):
    """Under training.recompute.keeps=matmuls a MoE layer's grouped GEMMs are kept like any
    matmul: backward runs the grouped GEMMs of a layer run once (its input's gradient and the
    adapters') and again only the adapters' up-projections (r-wide inputs, as for linear
    layers); attention_matmuls also recomputes gate_up's base GEMM.
    Gradients equal those of the layer run once (the same dropout masks: the RNG state is
    restored). `torch._grouped_mm` runs on the CPU in bf16 (torch >= 2.9), so the grouped path
    is forced here."""
    import functools

    from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts

    from kit.recipe import experts, grouped_experts
    from kit.recipe.recompute import save_policy

    monkeypatch.setattr(grouped_experts, "grouped_kernel", lambda *_: True)
    ex, lora = _experts_on("cpu", "qwen3_moe", hidden=64, inner=48, count=8, k=2, ranks=(16,))
    index, weights = routed(40, 8, 2, unused=3)
    weights = weights.to(torch.bfloat16)
    x0 = torch.randn(40, 64, dtype=torch.bfloat16)
    factors = [t for branches in lora.values() for a, b, _, _ in branches for t in (a, b)]
    cot = torch.randn(40, 64, dtype=torch.bfloat16)

    def layer(x, w):
        return experts.forward(ex, x, index, w, lora=lora)

    results, counts = {}, {}
    for keeps in ("none", "matmuls", "attention_matmuls"):
        x, w = x0.clone().requires_grad_(), weights.clone().requires_grad_()
        torch.manual_seed(5)
        forward, backward = _Ops(), _Ops()
        with forward:
            if keeps == "none":
                out = layer(x, w)
            else:
                context = functools.partial(create_selective_checkpoint_contexts,
                                            save_policy(keeps, rank=16, mlp_width=48))
                out = checkpoint(layer, x, w, use_reentrant=False, context_fn=context)
        with backward:
            grads = torch.autograd.grad(out, (x, w, *factors), cot)
        gemm = torch.ops.aten._grouped_mm.default
        results[keeps], counts[keeps] = (out, *grads), (forward.calls[gemm], backward.calls[gemm])
    assert counts["none"][0] == 2 * 3  # gate_up and down: base, LoRA A, LoRA B
    forward, backward = counts["none"]
    assert counts["matmuls"] == (forward, backward + 2), counts  # the two LoRA B GEMMs
    assert counts["attention_matmuls"] == (forward, backward + 3), counts  # and gate_up's base
    for keeps in ("matmuls", "attention_matmuls"):
        for mine, ref in zip(results[keeps], results["none"], strict=True):
            assert torch.equal(mine, ref), keeps


def _model_gradients(device: str, keeps: str, fused: bool = False):
    """kit:tiny-qwen3-moe as the recipe builds it (NF4, LoRA on attention and every expert,
    dropout 0.05), bf16 on `device`, adapters made non-zero; one forward and backward under
    `keeps` ("none": no recompute, "inputs": whole layers): (loss, {name: gradient}). fused:
    lora.fused_down (kit.recipe.lora_down) on every adapter."""
    from kit.config import load_config
    from kit.recipe import model as kmodel
    from kit.recipe.recompute import enable_activation_checkpointing, selective_checkpointing

    cfg = load_config(ROOT / "kit/configs/tiny-cpu.yaml",
                      ["model.name=kit:tiny-qwen3-moe", "model.loading=full", "model.dtype=bfloat16",
                       "lora.dropout=0.05", "training.seed=0"])  # fmt: skip
    peft_model = kmodel.build(cfg, torch.device(device), train=False).model
    torch.manual_seed(0)
    for name, p in peft_model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.05)
    if fused:
        from kit.recipe import lora_down

        lora_down.enable(peft_model)
    if keeps == "inputs":
        enable_activation_checkpointing(peft_model)
    elif keeps != "none":
        selective_checkpointing(peft_model, keeps, cfg.lora.r)
    peft_model.train()
    ids = torch.randint(3, 1000, (2, 64), generator=torch.Generator().manual_seed(1)).to(device)
    torch.manual_seed(7)
    loss = peft_model(input_ids=ids, labels=ids, use_cache=False).loss
    loss.backward()
    return loss.item(), {n: p.grad.float() for n, p in peft_model.named_parameters()
                         if p.requires_grad}  # fmt: skip


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0),
                    reason="needs a CUDA GPU of compute capability 9.0+ (torch._grouped_mm)")
@pytest.mark.parametrize("fused", [False, True], ids=["unfused", "lora.fused_down"])
def test_every_recompute_policy_gives_the_gradients_of_no_recompute_on_the_gpu(fused):
    """A whole MoE model on `torch._grouped_mm`: each recompute policy (the grouped GEMMs kept,
    or run again) gives the loss of the model run once, and its gradients within bf16's
    rounding (attention's backward may add in another order); with the adapters' dropout inside
    the Triton kernels too (the recompute draws the same seeds)."""
    _policies_match("cuda", fused)


def test_every_recompute_policy_gives_the_gradients_of_no_recompute_with_fused_dropout():
    """The same on the CPU with lora.fused_down (its torch reference): a recomputed layer
    draws the same seeds, so the masks in backward are forward's."""
    _policies_match("cpu", True)


def _policies_match(device: str, fused: bool):
    loss0, grads0 = _model_gradients(device, "none", fused)
    for keeps in ("matmuls", "mlp_matmuls", "attention_matmuls", "inputs"):
        loss, grads = _model_gradients(device, keeps, fused)
        assert loss == pytest.approx(loss0, abs=1e-6), keeps
        for name, g in grads.items():
            top = grads0[name].abs().max()
            assert top > 0 and (g - grads0[name]).abs().max() <= 0.01 * top, (keeps, name)


def test_a_compiled_layer_runs_the_grouped_gemms_and_equals_eager(monkeypatch):
    """training.compile on a MoE layer: inductor lays out the LoRA factor B (a permuted view,
    scaled and cast) with the permutation's strides, which `torch._grouped_mm` refuses; the
    factors go through kit::dense_copy, whose output is row-major. Compiled, the grouped path
    gives eager's output and gradients (the same dropout masks: one seed; inductor draws its
    random numbers from another stream than eager's, so here its random ops, the masks' seeds,
    fall back to eager's)."""
    import torch._inductor.config as inductor_config

    from kit.recipe import experts, grouped_experts

    monkeypatch.setattr(grouped_experts, "grouped_kernel", lambda *_: True)
    ex, lora = _experts_on("cpu", "qwen3_moe", hidden=64, inner=48, count=8, k=2, ranks=(16,))
    index, weights = routed(40, 8, 2, unused=3)
    x0 = torch.randn(40, 64, dtype=torch.bfloat16)
    cot = torch.randn(40, 64, dtype=torch.bfloat16)
    factors = [t.requires_grad_() for branches in lora.values() for a, b, _, _ in branches
               for t in (a, b)]  # fmt: skip

    def layer(x):
        return experts.forward(ex, x, index, weights.to(torch.bfloat16), lora=lora)

    results = []
    # torch's own patch, not monkeypatch: undoing a monkeypatch deletes a config module's entry
    # (torch 2.13: every later compile then fails, "fallback_random does not exist")
    with inductor_config.patch(fallback_random=True):
        for fn in (layer, torch.compile(layer, fullgraph=False)):
            x = x0.clone().requires_grad_()
            torch.manual_seed(3)
            out = fn(x)
            results.append((out, *torch.autograd.grad(out, (x, *factors), cot)))
    for mine, ref in zip(results[1], results[0], strict=True):
        assert torch.allclose(mine.float(), ref.float(), rtol=0.02, atol=0.02 * ref.abs().max().item())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 0),
                    reason="needs a CUDA GPU of compute capability 8.0+ and triton")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("two", [True, False], ids=["base+adapters", "base"])
def test_the_gather_sum_kernels_equal_torch(dtype, two):
    """kit.recipe.experts_kernels' gather_sum (the layer's weighted sum of its sorted rows, the
    base's and the adapters' parts added as read) and combine_grad (that sum's two gradients in
    one pass) against the torch expressions in fp32, with a width off their tiles and an expert
    no token picks: fp32 to 1e-5, bf16 to its rounding."""
    from kit.recipe import grouped_experts
    from kit.recipe.experts_kernels import combine_grad_op, gather_sum_op

    tokens, k, width = 777, 4, 1000
    index, weights = routed(tokens, 16, k, unused=3, device="cuda")
    groups = grouped_experts.Groups(index, 16, fast=True)
    a = torch.randn(tokens * k, width, device="cuda", dtype=dtype)
    b = torch.randn_like(a) if two else None
    w = weights.to(dtype)
    got = gather_sum_op(a, b, groups.inverse, w, k, dtype)
    h = a.float() if b is None else a.float() + b.float()
    rows = h[groups.inverse].view(tokens, k, width)
    want = (rows * w.float()[..., None]).sum(1)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    assert got.dtype == dtype and (got.float() - want).abs().max() < tol * want.abs().max()
    g = torch.randn(tokens, width, device="cuda", dtype=dtype)
    dh, dw = combine_grad_op(g, a, b, groups.inverse, w)
    want_dh = g.float()[groups.order // k] * w.float().reshape(-1)[groups.order, None]
    want_dw = (rows * g.float()[:, None, :]).sum(-1)
    for got, want in ((dh, want_dh), (dw, want_dw)):
        assert got.dtype == dtype and (got.float() - want).abs().max() < tol * want.abs().max()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0),
                    reason="needs a CUDA GPU of compute capability 9.0+ (torch._grouped_mm)")
def test_a_compiled_grouped_layer_sums_its_rows_by_the_kernel_without_a_graph_break():
    """With the kernels loaded as a CUDA build loads them (kit.recipe.model), a compiled experts
    layer runs the gather_sum kernel (forward and backward) and its graph does not break (the
    first version asked for the kernels inside the trace: 10 breaks, 10% slower, 2.4 GiB more on
    Qwen3-30B-A3B's shape); outputs and gradients equal the eager torch path's (the compiled
    layer draws its dropout seeds from torch's generator as eager code does: fallback_random)."""
    import torch._inductor.config as inductor_config

    from kit.recipe import experts, grouped_experts, nf4
    from kit.recipe.checks import graph_breaks

    ex, lora = _experts_on("cuda", "qwen3_moe", hidden=512, inner=256, count=16, k=4, ranks=(16,))
    index, weights = routed(1000, 16, 4, unused=3, device="cuda")
    x0 = torch.randn(1000, 512, device="cuda", dtype=torch.bfloat16)
    w0 = weights.to(torch.bfloat16)
    factors = [t for branches in lora.values() for a, b, _, _ in branches for t in (a, b)]
    cot = torch.randn(1000, 512, device="cuda", dtype=torch.bfloat16)
    results = []
    with inductor_config.patch(fallback_random=True):  # torch's own patch (see above)
        for kernel in (False, True):
            if kernel:
                assert nf4.available(torch.device("cuda"))
                grouped_experts.kernels()
            else:
                grouped_experts._LOADED.clear()
            x, w = x0.clone().requires_grad_(), w0.clone().requires_grad_()
            fn = experts.forward
            if kernel:
                before = graph_breaks()
                fn = torch.compile(experts.forward)
            out = run(fn, ex, x, index, w, lora, seed=3)
            results.append((out, *torch.autograd.grad(out, (x, w, *factors), cot)))
            if kernel:
                assert graph_breaks(before) == {}
    for mine, ref in zip(*results, strict=True):
        top = ref.float().abs().max()
        assert top > 0 and (mine.float() - ref.float()).abs().max() < 0.03 * top
