"""lora.fused_down (kit.recipe.lora_down): an adapter's down-projection with its dropout inside
one kernel. The op is (x * keep) @ a[s]^T per segment of rows, keep the hash mask of
kit.recipe.grouped_experts; its gradients are autograd's of that expression; a dense LoRA layer,
a group of them and a mixture of experts' sorted rows run it and compute what the unfused path
computes with the same mask. On a GPU the Triton kernels equal the torch reference."""

from __future__ import annotations

import re

import pytest
import torch
from levers import saved_bytes
from test_grouped_experts import chain_of, routed, run
from test_lora_groups import _build
from test_moe import built, outermost_wrapper

from kit.budget import plan as kplan
from kit.config import load_config
from kit.recipe import lora_down, recompute
from kit.recipe.drop_mask import drop_mask
from kit.recipe.levers import lora_groups


def _case(m, k, r, segments, *, rows=False, drop=True, dtype=torch.float32, device="cpu",
          empty=True):
    g = torch.Generator(device).manual_seed(m + k + r + segments)
    x = torch.randn(m, k, generator=g, device=device).to(dtype)
    a = (torch.randn(segments, r, k, generator=g, device=device) * 0.1).to(dtype)
    bounds = None
    if segments > 1:
        cuts = torch.sort(torch.randint(0, m + 1, (segments - 1,), generator=g, device=device))[0]
        if empty:  # an expert no row picked: two equal bounds
            cuts[segments // 2] = cuts[segments // 2 - 1]
        bounds = torch.cat([cuts.new_zeros(1), cuts, cuts.new_full((1,), m)]).int()
    ids = torch.randperm(m, generator=g, device=device) if rows else None
    seed = torch.tensor([987654], dtype=torch.int32, device=device) if drop else None
    return x, a, bounds, ids, seed


def _explicit(x, a, bounds, ids, seed, threshold):
    """The same product written in plain torch ops, autograd through it."""
    keep = x
    if seed is not None:
        where = ids if ids is not None else torch.arange(x.shape[0], device=x.device)
        keep = x.masked_fill(drop_mask(seed, where, x.shape[1], threshold), 0)
    ends = [0, x.shape[0]] if bounds is None else bounds.tolist()
    return torch.cat([keep[lo:hi] @ a[s].t() for s, (lo, hi) in enumerate(zip(ends, ends[1:], strict=False))])


@pytest.mark.parametrize("rows", [False, True], ids=["row ids m", "sorted rows"])
@pytest.mark.parametrize("segments", [1, 6])
def test_the_op_is_the_masked_product_per_segment_with_its_gradients(segments, rows):
    """Output, input gradient and factor gradients equal autograd's of the explicit expression
    (fp32); dropout drops ~p of the input; without a seed nothing is dropped."""
    threshold = lora_down.threshold_of(0.3)
    x, a, bounds, ids, seed = _case(200, 96, 16, segments, rows=rows)
    x.requires_grad_(), a.requires_grad_()
    got = lora_down.lora_down(x, a, bounds, ids, seed, threshold)
    want = _explicit(x, a, bounds, ids, seed, threshold)
    assert got.shape == (200, 16) and torch.allclose(got, want, atol=1e-5)
    cot = torch.randn_like(want)
    g = torch.autograd.grad(got, (x, a), cot)
    w = torch.autograd.grad(want, (x, a), cot)
    for mine, ref in zip(g, w, strict=True):
        assert ref.abs().max() > 0 and torch.allclose(mine, ref, atol=1e-5)
    dropped = (g[0] == 0).float().mean().item()  # the input's gradient is zero where dropped
    assert 0.25 < dropped < 0.35
    plain = lora_down.lora_down(x, a, bounds, ids, None, threshold)
    assert torch.allclose(plain, _explicit(x, a, bounds, ids, None, 0), atol=1e-5)


def test_the_op_compiles_and_a_recompute_policy_keeps_it():
    """Inside torch.compile it is one opaque op (its fake gives the shape) with the same result
    and gradients; every selective-recompute policy keeps its result (r numbers a token)."""
    from torch.utils.checkpoint import CheckpointPolicy

    threshold = lora_down.threshold_of(0.1)
    x, a, bounds, ids, seed = _case(130, 64, 16, 3, rows=True)
    x.requires_grad_(), a.requires_grad_()

    def f(x, a):
        return (lora_down.lora_down(x, a, bounds, ids, seed, threshold) ** 2).sum()

    eager = f(x, a)
    compiled = torch.compile(f, fullgraph=True)(x, a)
    assert torch.allclose(eager, compiled, rtol=1e-5)
    assert all(torch.allclose(e, c, atol=1e-5) for e, c in zip(
        torch.autograd.grad(eager, (x, a)), torch.autograd.grad(compiled, (x, a)), strict=True))
    for keeps in recompute.KEEPS[1:]:
        policy = recompute.save_policy(keeps, rank=16, mlp_width=64)
        assert all(policy(None, op, x, a) == CheckpointPolicy.MUST_SAVE
                   for op in lora_down.ops())  # the reference's op and, once loaded, the kernels'


def test_a_lora_layer_runs_the_kernel_with_the_hash_mask():
    """One adapted linear layer: base(x) + ((x * keep) / (1 - p)) @ A^T @ B^T * scale, keep the
    hash mask of the seed torch's generator gives; in eval mode PEFT's own forward (no dropout)."""
    model = _build(["lora.dropout=0.25"], False)
    assert lora_down.enable(model) == 7 * 2  # q k v o gate up down, two layers
    layer = model.base_model.model.model.layers[0].self_attn.o_proj.train()
    x = torch.randn(2, 5, layer.in_features)
    torch.manual_seed(11)
    got = layer(x)
    torch.manual_seed(11)
    seed = torch.randint(0, 2**31 - 1, (1,), dtype=torch.int32)
    keep = x.reshape(10, -1).masked_fill(
        drop_mask(seed, torch.arange(10), x.shape[-1], lora_down.threshold_of(0.25)), 0)
    A, B = layer.lora_A["default"].weight, layer.lora_B["default"].weight
    delta = (keep / 0.75) @ A.t() @ B.t() * layer.scaling["default"]
    assert torch.allclose(got, layer.base_layer(x) + delta.reshape(2, 5, -1), atol=1e-5)
    layer.eval()
    assert torch.allclose(layer(x), layer.base_layer(x) + x @ A.t() @ B.t() * layer.scaling["default"],
                          atol=1e-5)


@pytest.mark.parametrize("group", [False, True], ids=["each adapter", "grouped"])
def test_fused_adapters_train_as_the_unfused_ones(group):
    """At dropout 0 the fused model's loss and gradients are the unfused one's; with dropout it
    trains (every adapter gets a gradient) and keeps no dropout mask or dropped copy: less
    saved for backward than PEFT's dropout."""
    from test_lora_groups import _step

    ids = torch.randint(3, 1024, (2, 32), generator=torch.Generator().manual_seed(3))

    def build(p, fused):
        model = _build([f"lora.dropout={p}"], False)  # groups after the fused forward
        if fused:
            lora_down.enable(model)
        if group:
            lora_groups.enable(model)
        return model.train()

    loss_a, grads_a, _ = _step(build(0, False), ids)
    loss_b, grads_b, _ = _step(build(0, True), ids)
    assert loss_b == pytest.approx(loss_a, abs=1e-6)
    for name in grads_a:
        assert torch.allclose(grads_a[name], grads_b[name], atol=1e-6), name
    _, grads, _ = _step(build(0.1, True), ids)
    assert all(g.abs().sum() > 0 for g in grads.values())
    kept = {}
    for fused in (False, True):
        model = build(0.1, fused)
        weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
        kept[fused] = saved_bytes(lambda m=model: m(input_ids=ids, labels=ids).loss, weights)[1]
    assert kept[True] < kept[False], kept


@pytest.mark.parametrize("dropout", [0.0, 0.3])
def test_fused_experts_equal_the_unfused_grouped_path(dropout):
    """A mixture of experts' sorted rows: the kernel with the same seeds gives the grouped
    path's output and gradients (fp32), input, routing weights and every factor."""
    from kit.recipe import experts

    model = built("kit:tiny-qwen3-moe", "model.dtype=float32", "quantization.method=none",
                  f"lora.dropout={dropout}")  # fmt: skip
    wrapper = outermost_wrapper(model).train()
    chain = chain_of(wrapper)
    ex = chain[-1]
    torch.manual_seed(0)
    for w in chain[:-1]:
        torch.nn.init.normal_(w.lora_B["default"].weight, std=0.5)
    lora_map = experts.lora_factors(wrapper)
    index, weights = routed(24, ex.num_experts, model.config.num_experts_per_tok, unused=1)
    x = torch.randn(24, model.config.hidden_size, requires_grad=True)
    weights.requires_grad_()
    factors = [t for branches in lora_map.values() for a, b, _, _ in branches for t in (a, b)]
    results = []
    for fused in (False, True):
        ex._kit_fused_down = fused
        out = run(experts.forward, ex, x, index, weights, lora_map, seed=7)
        cot = torch.randn(out.shape, generator=torch.Generator().manual_seed(1))
        results.append((out, *torch.autograd.grad(out, (x, weights, *factors), cot)))
    for mine, ref in zip(*results, strict=True):
        top = ref.abs().max()
        assert top > 0 and (mine - ref).abs().max() < 1e-5 * top


def test_lora_enable_marks_the_experts_and_the_build_applies_it():
    """The build switches it on from the config (lora.fused_down=true, off the GPU the torch
    reference): every dense adapter and every experts module run it."""
    from conftest import ROOT

    from kit.recipe import model as kmodel

    cfg = load_config(ROOT / "kit/configs/tiny-cpu.yaml", [
        "model.name=kit:tiny-qwen3-moe", "model.loading=full", "lora.fused_down=true",
        "lora.dropout=0.1"])
    model = kmodel.build(cfg, torch.device("cpu")).model
    marked = [m for m in model.modules() if getattr(m, "_kit_fused_down", False)]
    assert any(type(m).__name__.endswith("Experts") for m in marked)
    assert any(hasattr(m, "lora_A") and type(m).__name__ != "ParamWrapper" for m in marked)


def _planned(overrides, **hardware):
    cfg = load_config(None, ["model.name=kit:tiny-llama", "data.max_seq_len=64", *overrides])
    hw = kplan.Hardware("cuda", 1, 80.0, "NVIDIA H100 80GB HBM3", fp8=True, grouped_gemm=True,
                        **hardware)
    return kplan.plan(cfg, hw, 64)


@pytest.mark.parametrize(("triton", "dropout", "want"), [
    (True, 0.05, True), (False, 0.05, False), (True, 0.0, False)])
def test_the_plan_fuses_where_the_kernels_run_and_there_is_dropout(triton, dropout, want):
    planned = _planned([f"lora.dropout={dropout}"], triton=triton)
    choice = next(c for c in planned.choices if c.field == "lora.fused_down")
    assert planned.cfg.lora.fused_down is want and choice.by == "plan"
    assert ("Triton" in choice.why) == (not triton)
    kept = _planned(["lora.fused_down=false"], triton=True)
    assert kept.cfg.lora.fused_down is False
    assert kplan.plain(load_config(None, [])).lora.fused_down is False


def test_the_down_kernel_splits_its_columns_only_where_the_rows_are_few():
    """kit.budget.machine.column_shares, the split of the down-projection kernel
    (kit.recipe.lora_down_kernels), on 132 multiprocessors (an H100 or H200): a dense layer's
    4,096 rows at batch 2 (64 blocks) take 9 shares of their columns, batch 10's 20,480 two, a
    mixture of experts' sorted rows and inputs narrower than 4 tiles one."""
    from kit.budget import machine

    assert machine.column_shares(4096, 4096, 132) == 9
    assert machine.column_shares(4096, 14336, 132) == 9
    assert machine.column_shares(20480, 4096, 132) == 2
    assert machine.column_shares(26624 * 8, 2048, 132) == 1
    assert machine.column_shares(1000, 200, 132) == 1


# ---------------------------------------------------------------- GPU: the Triton kernels

gpu = pytest.mark.skipif(not (torch.cuda.is_available() and lora_down.available(torch.device("cuda"))),
                         reason="needs a CUDA GPU of compute capability 8.0+ and triton")


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("m", "k", "r", "segments", "rows"), [
    (1000, 4096, 48, 1, False),   # a q/k/v group, dense rows
    (777, 1000, 16, 1, False),    # sizes off the tiles
    (3000, 512, 16, 16, True),    # experts: sorted rows, an empty expert
    (300, 256, 8, 40, True),      # rank 8 padded to a tile of 16, many small segments
])
def test_the_triton_kernels_equal_the_reference(m, k, r, segments, rows, dtype):
    """Forward, input gradient and factor gradient of the Triton kernels against the torch
    reference, with and without dropout: fp32 (IEEE dots) to 1e-4, bf16 to its rounding."""
    threshold = lora_down.threshold_of(0.1)
    if (m, segments) == (1000, 1):  # few rows: `down` splits each row block's columns
        from kit.recipe import lora_down_kernels

        assert lora_down_kernels.down_split(m, k, torch.device("cuda")) > 1  # the split path
    for drop in (True, False):
        x, a, bounds, ids, seed = _case(m, k, r, segments, rows=rows, drop=drop, dtype=dtype,
                                        device="cuda")
        g = torch.randn(m, r, device="cuda", dtype=dtype)
        pairs = [
            (lora_down.kernels().down_op(x, a, bounds, ids, seed, threshold),
             lora_down._ref_down(x, a, bounds, ids, seed, threshold)),
            (lora_down.kernels().dx_op(g, a, bounds, ids, seed, threshold, x),
             lora_down._ref_dx(g, a, bounds, ids, seed, threshold, dtype)),
            (lora_down.kernels().da_op(g, x, bounds, ids, seed, threshold, a),
             lora_down._ref_da(g, x, bounds, ids, seed, threshold, dtype)),
        ]
        for got, want in pairs:
            top = want.float().abs().max()
            tol = 1e-4 if dtype == torch.float32 else 2e-2
            assert top > 0 and (got.float() - want.float()).abs().max() < tol * top
        if drop:  # the dropped entries are exactly the mask's
            dx = pairs[1][0]
            where = ids if ids is not None else torch.arange(m, device="cuda")
            mask = drop_mask(seed, where, k, threshold)
            assert torch.equal(dx[mask], torch.zeros_like(dx[mask]))


@pytest.mark.gpu
@gpu
def test_the_kernel_path_keeps_less_and_matches_in_a_compiled_layer():
    """Through the Triton op on CUDA, compiled: the output and gradients equal the reference
    expression's in bf16, autograd keeps no (rows, width) mask or dropped copy, and the compiled
    code launches the kernels itself (no op call left in it: no dispatch per call)."""
    from torch._inductor.utils import run_and_get_code

    threshold = lora_down.threshold_of(0.05)
    lora_down.kernels()  # as the build loads them: the policies keep their result too
    assert torch.ops.kit.lora_down_triton.default in lora_down.ops()
    x, a, _, _, seed = _case(4096, 4096, 48, 1, dtype=torch.bfloat16, device="cuda")
    x.requires_grad_(), a.requires_grad_()
    f = torch.compile(lambda x, a: lora_down.lora_down(x, a, None, None, seed, threshold))
    got, kept = saved_bytes(lambda: f(x, a), {x.untyped_storage().data_ptr(),
                                                a.untyped_storage().data_ptr()})
    want = _explicit(x, a, None, None, seed, threshold)
    assert (got.float() - want.float()).abs().max() < 2e-2 * want.float().abs().max()
    assert kept < x.numel()  # less than one byte per input element: no mask, no copy
    grads = torch.autograd.grad(want.float().sum(), (x, a))
    torch._dynamo.reset()
    _, code = run_and_get_code(lambda: torch.autograd.grad(f(x, a).float().sum(), (x, a)))
    source = "\n".join(code)
    # the op's name is left only in comments (the graph's source nodes): the kernels are launched
    # by the generated code itself (`down_0.run(...)`, as inductor names a user's kernel)
    launched = set(re.findall(r"\b(down|dx|da)_\d+\.run\(", source))
    assert "ops.kit." not in source and launched == {"down", "dx", "da"}, launched
    got_grads = torch.autograd.grad(f(x, a).float().sum(), (x, a))
    for g, w in zip(got_grads, grads, strict=True):
        assert (g.float() - w.float()).abs().max() < 2e-2 * w.float().abs().max()


def test_compiled_fsdp2_layers_run_the_op_without_a_graph_break(tmp_path, monkeypatch):
    """The recipe as the planner runs it on a GPU (FSDP2, NF4, compiled layers, a selective
    recompute policy, grouped adapters, lora.fused_down), here a world of one on the CPU: the
    layers compile without a graph break, their graphs call kit::lora_down, and it trains."""
    import shutil

    import torch._dynamo.utils as dynamo_utils
    import torch._inductor.config as inductor_config

    from kit.inputs import builtin
    from kit.train import Recipe

    shutil.copytree(builtin.resolve("kit:tiny-llama"), tmp_path / "model")
    for var in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(var, raising=False)
    called = []

    def ops(graph):
        called.extend(n.target for n in graph.nodes if n.op == "call_function")

    cfg = load_config(None, [
        f"model.name={tmp_path / 'model'}", "training.device=cpu", "sharding.engine=fsdp2",
        "quantization.method=nf4", "training.compile=true", "lora.group_inputs=true",
        "lora.fused_down=true", "lora.dropout=0.1", "training.recompute.keeps=attention_matmuls",
        "training.batch_size=2", "data.max_seq_len=32", f"run.output_dir={tmp_path / 'run'}"])
    with inductor_config.patch(fx_graph_cache=False, post_grad_custom_post_pass=ops):
        torch._dynamo.reset()
        dynamo_utils.counters.clear()
        recipe = Recipe(cfg)
        try:
            recipe.setup()
            losses = [recipe.train_step()["loss"] for _ in range(4)]
        finally:
            recipe.cleanup()
        breaks = dict(dynamo_utils.counters["graph_break"])
    torch._dynamo.reset()
    assert not breaks, breaks
    assert torch.ops.kit.lora_down.default in called
    assert all(loss == loss for loss in losses) and losses[-1] < losses[0], losses


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("m", "n", "r"), [(1000, 4096, 16), (777, 1000, 48), (300, 14336, 8)])
def test_the_up_add_kernel_equals_the_reference(m, n, r, dtype):
    """kit::lora_up_add_triton (c + alpha * low @ up^T, lora_down.add_up on CUDA) against
    torch.addmm, forward and the three gradients: fp32 to 1e-4, bf16 to its rounding."""
    lora_down.kernels()
    g = torch.Generator("cuda").manual_seed(m + n + r)
    c, low, up = (torch.randn(*s, generator=g, device="cuda").to(dtype).requires_grad_()
                  for s in ((m, n), (m, r), (n, r)))
    grad = torch.randn(m, n, generator=g, device="cuda").to(dtype)
    got = lora_down.kernels().up_add_op(c, low, up, 0.37)
    want = torch.addmm(c.float(), low.float(), up.float().t(), alpha=0.37)
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    assert (got.float() - want).abs().max() < tol * want.abs().max()
    for g_got, g_want in zip(torch.autograd.grad(got, (c, low, up), grad),
                             torch.autograd.grad(want, (c, low, up), grad.float()), strict=True):
        assert (g_got.float() - g_want.float()).abs().max() < tol * g_want.float().abs().max()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0),
                    reason="needs a CUDA GPU of compute capability 9.0+ (torch._grouped_mm)")
@pytest.mark.parametrize(("m", "n", "r", "segments"), [(3000, 1536, 16, 16), (777, 1000, 8, 5)])
def test_the_rows_up_add_kernel_equals_the_product_per_segment(m, n, r, segments):
    """kit::lora_up_add_rows_triton (c + low @ up[s] for segment s's rows, a mixture of experts'
    sorted rows: lora_down.add_rows; its backward two torch._grouped_mm) in bf16 against c +
    low_s @ up[s] per segment in fp32, forward and the three gradients, with segments off the
    tiles and an empty one: to bf16's rounding."""
    g = torch.Generator("cuda").manual_seed(m + n)
    cuts = torch.randint(0, m, (segments - 1,), generator=g, device="cuda").sort().values
    cuts[1] = cuts[0]  # an empty segment
    bounds = torch.cat([cuts.new_zeros(1), cuts, cuts.new_full((1,), m)]).int()
    c, low, up = (torch.randn(*s, generator=g, device="cuda").bfloat16().requires_grad_()
                  for s in ((m, n), (m, r), (segments, r, n)))
    grad = torch.randn(m, n, generator=g, device="cuda").bfloat16()
    ends = bounds.tolist()
    ids = torch.cat([torch.full((hi - lo,), s, device="cuda") for s, (lo, hi) in
                     enumerate(zip(ends[:-1], ends[1:], strict=True))])
    got = lora_down.add_rows(c, low, up, ids, bounds[1:])
    want = c.float() + torch.cat([low[lo:hi].float() @ up[s].float() for s, (lo, hi) in
                                  enumerate(zip(ends[:-1], ends[1:], strict=True))])
    assert (got.float() - want).abs().max() < 2e-2 * want.abs().max()
    for g_got, g_want in zip(torch.autograd.grad(got, (c, low, up), grad),
                             torch.autograd.grad(want, (c, low, up), grad.float()), strict=True):
        assert (g_got.float() - g_want.float()).abs().max() < 2e-2 * g_want.float().abs().max()
