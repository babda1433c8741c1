"""training.recompute and training.compile (kit.recipe.recompute): what each decoder layer keeps for
backward and recomputes, the policies telling the matmuls apart, and compiled layers under FSDP2.
Each lever must not change what is learned: the same loss and gradients as the layer run once."""

import shutil

import pytest
import torch
from levers import kept_by, saved_bytes, tiny_model
from transformers import AutoModelForCausalLM

from kit.inputs import builtin
from kit.recipe.recompute import enable_activation_checkpointing


@pytest.mark.parametrize("every,recomputed", [(1, [0, 1]), (2, [0])])
def test_selective_checkpointing_recomputes_only_chosen_layers(every, recomputed):
    model = tiny_model()
    chosen = enable_activation_checkpointing(model, every)
    model.train()
    assert chosen == recomputed
    calls = [0] * len(model.model.layers)
    for i, layer in enumerate(model.model.layers):
        # A wrapped forward, not a hook: module hooks do not fire again in the recompute.
        def counted(x, i=i, forward=layer.mlp.forward):
            calls[i] += 1
            return forward(x)

        layer.mlp.forward = counted
    ids = torch.randint(3, 1024, (2, 16), generator=torch.Generator().manual_seed(2))
    model(input_ids=ids, labels=ids).loss.backward()
    # A recomputed layer runs its forward twice: once in forward, once in backward.
    assert calls == [2 if i in recomputed else 1 for i in range(len(calls))]


@pytest.mark.full  # CI time: a lever the planner never picks; its one-process equivalence stays in the default run
@pytest.mark.slow  # compiles
def test_activation_memory_budget_keeps_less_and_learns_the_same():
    """training.activation_memory_budget: the compiled layers recompute more in backward, keep
    fewer activations, and give the same loss and gradients as the uncompiled model."""
    from kit.config import load_config
    from kit.recipe import lora
    from kit.recipe.recompute import compile_layers

    cfg = load_config(None, ["lora.dropout=0", "quantization.method=none"])
    ids = torch.randint(3, 1024, (2, 64), generator=torch.Generator().manual_seed(5))

    def run(budget):
        torch.manual_seed(0)
        model = lora.apply_lora(tiny_model(), cfg)
        for n, p in model.named_parameters():  # non-zero B, so the adapters matter
            if "lora_B" in n:
                torch.nn.init.normal_(p, std=0.02)
        model.train()
        if budget is not None:
            torch._dynamo.reset()
            compile_layers(model, budget)
        # Activations only: a compiled graph also keeps the weights it recomputes with.
        weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
        loss, kept = saved_bytes(lambda: model(input_ids=ids, labels=ids).loss, weights)
        loss.backward()
        grads = {n: p.grad for n, p in model.named_parameters() if p.requires_grad}
        return loss.item(), grads, kept

    try:
        eager, full, low = run(None), run(1.0), run(0.1)
    finally:
        import torch._functorch.config as functorch_config

        functorch_config.activation_memory_budget = 1.0
        torch._dynamo.reset()
    for loss, grads, _ in (full, low):
        assert loss == pytest.approx(eager[0], rel=1e-5)
        for name, g in grads.items():
            assert torch.allclose(g, eager[1][name], rtol=1e-4, atol=1e-6), name
    assert low[2] < 0.6 * full[2], (eager[2], full[2], low[2])


@pytest.mark.slow  # compiles
def test_compiled_layers_under_fsdp2_compile_once_per_policy(tmp_path, monkeypatch):
    """The kit's training step with training.compile=true under FSDP2 and NF4, recomputing with
    two policies (training.recompute.matmul_layers=2: layers 0-1 keep every matmul, 2-3 what
    attention_matmuls keeps): no graph break inside a decoder layer, one graph per policy and
    guard, none per layer. Three regressions this guards: FSDP2's gathered 4-bit weights lost
    bitsandbytes' quant_state (a graph break per 4-bit linear layer); a KV cache in training
    forwards made every layer recompile (past torch's recompile limit, the rest ran uncompiled);
    and both policies' forwards were one code object, so layers 2-3 ran layer 1's graph (one H100
    measured 32.0 GiB where ~20 was due: benchmarks/records/2026-11-27-layers-24gib-8b-1xh100)."""
    import torch._dynamo.utils as dynamo_utils
    from transformers import AutoConfig

    from kit.config import load_config
    from kit.train import Recipe

    src = builtin.resolve("kit:tiny-llama")  # its tokenizer, with four layers instead of two
    shutil.copytree(src, tmp_path / "model")
    config = AutoConfig.from_pretrained(src)
    config.num_hidden_layers = 4
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "model")
    for var in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(var, raising=False)
    cfg = load_config(None, [
        f"model.name={tmp_path / 'model'}", "training.device=cpu", "sharding.engine=fsdp2",
        "quantization.method=nf4", "training.compile=true",
        "training.recompute.keeps=attention_matmuls", "training.recompute.matmul_layers=2",
        "training.batch_size=2", "data.max_seq_len=32", f"run.output_dir={tmp_path / 'run'}",
    ])
    torch._dynamo.reset()
    dynamo_utils.counters.clear()
    recipe = Recipe(cfg)
    try:
        recipe.setup()
        losses = [recipe.train_step()["loss"] for _ in range(2)]
    finally:
        recipe.cleanup()
        torch._dynamo.reset()
    assert all(torch.isfinite(torch.tensor(losses)))
    assert sum(dynamo_utils.counters["graph_break"].values()) == 0, dict(
        dynamo_utils.counters["graph_break"])
    # Layer 0 (its input needs no grad: frozen embeddings), layer 1 (every matmul kept), layers
    # 2-3 (attention_matmuls): three graphs; one code object for both policies gives two.
    assert dynamo_utils.counters["stats"]["unique_graphs"] == 3, dict(dynamo_utils.counters["stats"])


def test_policies_tell_the_matmuls_apart_4bit_included():
    """The policy sees bitsandbytes' 4-bit matmul as one op of its own, not aten.mm (the GPU run
    that missed it recomputed every matmul): both kinds are recognised, by shape."""
    from types import SimpleNamespace

    import bitsandbytes  # noqa: F401  (registers its ops)
    from torch.utils.checkpoint import CheckpointPolicy

    from kit.recipe.recompute import save_policy

    save, redo = CheckpointPolicy.MUST_SAVE, CheckpointPolicy.PREFER_RECOMPUTE
    mm, gemm4 = torch.ops.aten.mm.default, torch.ops.bitsandbytes.gemm_4bit.default
    x = SimpleNamespace  # only shapes are read

    def decide(keeps, op, inner, out):
        if op is mm:
            args = (x(shape=(32, inner)), x(shape=(inner, out)))
        else:  # gemm_4bit(A, B, shape=(out, in), absmax, blocksize, quant_type)
            args = (x(shape=(32, inner)), x(shape=(1,)), [out, inner], None, 64, "nf4")
        return save_policy(keeps, rank=8, mlp_width=448)(None, op, *args)

    for op in (mm, gemm4):
        assert decide("matmuls", op, 128, 128) == save  # q / o projection
        assert decide("matmuls", op, 128, 448) == save  # gate / up
        assert decide("attention_matmuls", op, 128, 448) == redo
        assert decide("attention_matmuls", op, 128, 128) == save
        assert decide("mlp_matmuls", op, 128, 448) == save
        assert decide("mlp_matmuls", op, 128, 32) == redo  # k / v projection
    assert decide("attention_matmuls", mm, 128, 8) == save  # adapter down-projection: kept
    assert decide("matmuls", mm, 8, 128) == redo  # adapter up-projection: recomputed
    # a MoE layer's grouped GEMMs (kit.recipe.grouped_experts): _grouped_mm(rows, (E, in, out)),
    # told apart as the linear layers are; r=4 runs padded to 8 there
    grouped = torch.ops.aten._grouped_mm.default
    for keeps, inner, out, want in (("matmuls", 128, 2 * 448, save), ("matmuls", 448, 128, save),
                                    ("attention_matmuls", 128, 2 * 448, redo),
                                    ("attention_matmuls", 448, 128, save),
                                    ("mlp_matmuls", 448, 128, redo)):
        args = (x(shape=(32, inner)), x(shape=(16, inner, out)))
        assert save_policy(keeps, rank=8, mlp_width=448)(None, grouped, *args) == want
    padded = save_policy("attention_matmuls", rank=4, mlp_width=448)
    assert padded(None, grouped, x(shape=(32, 128)), x(shape=(16, 128, 8))) == save
    assert padded(None, grouped, x(shape=(32, 8)), x(shape=(16, 8, 128))) == redo
    policy = save_policy("matmuls", rank=8, mlp_width=448)
    assert policy(None, torch.ops.aten.add.Tensor, x(shape=(1,)), x(shape=(1,))) == redo


def _nf4_layer_model():
    """kit:tiny-llama-8b-ratios (2 layers, the 8B shape's ratios) in NF4 + LoRA, as the recipe
    builds it, on CPU in float32, with non-zero adapters."""
    from kit.config import load_config
    from kit.recipe import model as kmodel

    cfg = load_config(None, ["model.name=kit:tiny-llama-8b-ratios", "model.dtype=float32",
                             "lora.dropout=0.1", "quantization.method=nf4",
                             "training.seed=0"])
    model = kmodel.build(cfg, torch.device("cpu"), train=False).model  # loaded + LoRA
    for n, p in model.named_parameters():  # non-zero B, so the adapters matter
        if "lora_B" in n:
            torch.nn.init.normal_(p, std=0.02)
    return model.train(), cfg.lora.r


def _with_keeps(model, keeps, r):
    """keeps: a policy, "none", or "<policy>+1" (its first layer keeps every matmul instead:
    training.recompute.matmul_layers=1)."""
    from kit.recipe.recompute import selective_checkpointing

    if keeps == "inputs":
        enable_activation_checkpointing(model)
    elif keeps != "none":
        policy, _, more = keeps.partition("+")
        assert selective_checkpointing(model, policy, r, matmul_layers=int(more or 0)) == [0, 1]
    return model.train()


def test_recompute_keeps_gives_the_same_gradients():
    """Eager, NF4, dropout 0.1: each policy recomputes with the forward's RNG state, so loss and
    gradients equal those of the layer run once."""
    ids = torch.randint(3, 1000, (2, 48), generator=torch.Generator().manual_seed(3))
    results = {}
    for keeps in ("none", "matmuls", "mlp_matmuls", "attention_matmuls", "attention_matmuls+1"):
        model, r = _nf4_layer_model()
        _with_keeps(model, keeps, r)
        torch.manual_seed(7)
        loss = model(input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()
        results[keeps] = loss.item(), {n: p.grad for n, p in model.named_parameters()
                                       if p.requires_grad}
    loss0, grads0 = results["none"]
    for keeps, (loss, grads) in results.items():
        assert loss == pytest.approx(loss0, abs=1e-6), keeps
        for name, g in grads.items():
            assert torch.allclose(g, grads0[name], atol=1e-6), (keeps, name)


@pytest.mark.full  # CI time: the policies' gradients are checked in one process by test_recompute_keeps_gives_the_same_gradients
@pytest.mark.slow  # compiles a layer per policy
def test_recompute_keeps_policies_on_nf4():
    """Compiled, NF4: what each policy keeps for backward, in the order the docs promise
    (nothing recomputed > matmuls > mlp_matmuls > attention_matmuls), by the amounts the GPU run measured."""
    from kit.recipe.recompute import compile_layers

    ids = torch.randint(3, 1000, (1, 128), generator=torch.Generator().manual_seed(4))
    kept = {}
    try:
        for keeps in ("none", "matmuls", "mlp_matmuls", "attention_matmuls",
                      "attention_matmuls+1"):
            model, r = _nf4_layer_model()
            _with_keeps(model, keeps, r)
            torch._dynamo.reset()
            compile_layers(model)
            weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
            # Embeddings that need a gradient: both layers see the same guards (an input without
            # one compiles the first layer apart, which once hid a second policy's graph reusing
            # the first's)
            embeds = model.get_input_embeddings()(ids).detach().requires_grad_(True)
            loss, kept[keeps] = saved_bytes(
                lambda m=model, e=embeds: m(inputs_embeds=e, labels=ids, use_cache=False).loss,
                weights)
            loss.backward()
    finally:
        torch._dynamo.reset()
    assert kept["none"] > kept["matmuls"] > kept["mlp_matmuls"] > kept["attention_matmuls"], kept
    # training.recompute.matmul_layers=1: the first of the 2 layers keeps what `matmuls` keeps,
    # the second what `attention_matmuls` keeps (the logits and embeddings alike in each)
    mixed = (kept["matmuls"] + kept["attention_matmuls"]) / 2
    assert kept["attention_matmuls+1"] == pytest.approx(mixed, rel=0.05), kept
    # Per token and layer, in hidden-size units: 23.7, 12.7, 10.2, 5.7 (+ the same logits and
    # embeddings in each; benchmarks/tools/kept_per_policy.py); recomputing every matmul keeps ~2.
    assert 0.45 < kept["matmuls"] / kept["none"] < 0.65, kept
    assert 0.2 < kept["attention_matmuls"] / kept["none"] < 0.4, kept


@pytest.mark.full  # CI time: test_compiled_layers_under_fsdp2_compile_once_per_policy counts a graph per policy
def test_compiled_layers_keep_each_their_own_policy():
    """training.recompute.matmul_layers=1 on 2 compiled NF4 layers: the first keeps what
    `matmuls` keeps, the second what attention_matmuls keeps (gate and up recomputed), counted
    per layer as each saves. Both layers see the same guards (their input needs a gradient), so
    a graph compiled for the first policy would otherwise serve the second layer too (it did:
    32.0 GiB on one H100 where ~20 was due; benchmarks/records/2026-11-27-layers-24gib-8b-1xh100)."""
    from kit.recipe.layers import decoder_layers
    from kit.recipe.recompute import compile_layers

    ids = torch.randint(3, 1000, (1, 128), generator=torch.Generator().manual_seed(4))
    model, r = _nf4_layer_model()
    _with_keeps(model, "attention_matmuls+1", r)
    kept, now = [0, 0], []
    def leave(module, args, out):
        now.pop()

    for i, layer in enumerate(decoder_layers(model)):  # which layer is saving (hooks run eagerly)
        layer.register_forward_pre_hook(lambda m, a, i=i: now.append(i))
        layer.register_forward_hook(leave)
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}

    def pack(t):
        if now and t.untyped_storage().data_ptr() not in weights:
            kept[now[-1]] += t.untyped_storage().nbytes()
        return t

    try:
        torch._dynamo.reset()
        compile_layers(model)
        embeds = model.get_input_embeddings()(ids).detach().requires_grad_(True)
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = model(inputs_embeds=embeds, labels=ids, use_cache=False).loss
        loss.backward()
    finally:
        torch._dynamo.reset()
    # per token and layer in hidden-size units: matmuls ~12.7, attention_matmuls ~5.7
    assert kept[0] > 1.6 * kept[1], kept


def _tiled_run(tile: int, dropout: float, ids, recompute: bool = False):
    """Loss and adapter gradients of the NF4 layer model with each MLP run `tile` tokens at a
    time (0: whole), with or without whole-layer recompute around it."""
    from kit.recipe.recompute import tile_mlp

    model, r = _nf4_layer_model()
    for m in model.modules():
        if isinstance(m, torch.nn.Dropout):
            m.p = dropout
    if tile:
        assert tile_mlp(model, tile) == 2
    if recompute:
        enable_activation_checkpointing(model)
    torch.manual_seed(7)
    loss = model(input_ids=ids, labels=ids, use_cache=False).loss
    loss.backward()
    return model, loss.item(), {n: p.grad for n, p in model.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("recompute", [False, True], ids=["alone", "inside-layer-recompute"])
def test_tiled_mlp_gives_the_same_loss_and_gradients(recompute):
    """training.recompute.mlp_tile_tokens, dropout off: tiles of 16 tokens out of 96 give the
    loss and every adapter gradient of the MLP run whole (alone and inside whole-layer recompute)."""
    ids = torch.randint(3, 1000, (2, 48), generator=torch.Generator().manual_seed(3))
    _, loss0, grads0 = _tiled_run(0, 0.0, ids)
    _, loss, grads = _tiled_run(16, 0.0, ids, recompute)
    assert loss == pytest.approx(loss0, abs=1e-6)
    assert any("mlp" in n and g.abs().sum() > 0 for n, g in grads.items())
    for name, g in grads.items():
        assert torch.allclose(g, grads0[name], atol=1e-6), name


def test_tiled_mlp_backward_uses_the_forwards_dropout_masks():
    """Dropout 0.3: each tile's backward restores the RNG state of its forward, so the gradient
    is the gradient of the loss that forward computed. Checked as a directional derivative: a
    small step against the gradient (same seed, same masks) lowers the loss by step x |g|^2."""
    ids = torch.randint(3, 1000, (2, 48), generator=torch.Generator().manual_seed(3))
    model, loss0, grads = _tiled_run(16, 0.3, ids)
    params = dict(model.named_parameters())
    eps, names = 1e-2, [n for n in grads if "mlp" in n]
    with torch.no_grad():
        for n in names:
            params[n] -= eps * grads[n]
    torch.manual_seed(7)  # with grad on: the tiled path again, drawing the same masks
    loss1 = model(input_ids=ids, labels=ids, use_cache=False).loss.item()
    predicted = eps * sum(grads[n].pow(2).sum().item() for n in names)
    assert predicted > 1e-4 and loss0 - loss1 == pytest.approx(predicted, rel=0.05)


def test_tiled_mlp_keeps_only_its_input():
    """With nothing else recomputed, a tiled MLP keeps its input instead of its intermediates."""
    from kit.recipe.recompute import tile_mlp

    ids = torch.randint(3, 1000, (1, 128), generator=torch.Generator().manual_seed(4))
    kept = {}
    for tile in (0, 32):
        model, _ = _nf4_layer_model()
        if tile:
            tile_mlp(model, tile)
        kept[tile] = kept_by(model, ids)
    assert kept[32] < 0.7 * kept[0], kept


@pytest.mark.full  # CI time: tiling's loss and gradients are checked in one process by test_tiled_mlp_gives_the_same_loss_and_gradients
@pytest.mark.slow  # two torchruns
def test_tiled_mlp_under_fsdp2_learns_the_same(tmp_path):
    """2 processes, FSDP2, NF4, dropout off: tiles of 64 tokens (4 per rank's batch) train to the
    same losses and the same adapter as the MLP run whole; the adapters' gradients reach FSDP2's
    reduce-scatter through the tiles."""
    from conftest import read_run, torchrun
    from safetensors.torch import load_file

    runs = {}
    for tile in (0, 64):
        out = tmp_path / f"tile{tile}"
        torchrun(out, "training.steps=4", "training.eval_every=0", "lora.dropout=0",
                 f"training.recompute.mlp_tile_tokens={tile}")
        losses = [m["loss"] for m in read_run(out)[1] if m["split"] == "train"]
        runs[tile] = losses, load_file(out / "adapter" / "adapter_model.safetensors")
    (l0, a0), (l1, a1) = runs[0], runs[64]
    assert l1 == pytest.approx(l0, abs=2e-3) and l1[-1] < l1[0]
    mlp = [n for n in a1 if ".mlp." in n and "lora_B" in n]  # B starts at zero: trained if not
    assert mlp and all(a1[n].abs().max() > 0 for n in mlp)
    diffs = {n: ((a1[n].float() - a0[n].float()).norm() / a0[n].float().norm()).item() for n in a0}
    # bf16 compute rounds each tile on its own: measured at most 1.2% of an adapter's norm after
    # 4 steps at lr 1e-2 (an adapter that missed its gradients would be 100% off).
    assert max(diffs.values()) < 0.05, diffs


def test_compiled_matmuls_policy_keeps_the_adapted_sum_not_the_base():
    """lora.fused_down's up-projection is one op onto the base's result
    (kit.recipe.lora_down.add_up: torch.addmm on the CPU, a Triton kernel on CUDA); a compiled layer under `matmuls` keeps that sum for backward
    (gate and up feed SiLU's gradient) and not the base's result, so backward neither runs the
    up-projection again nor reads base and delta to add them. Dropout off: the compiled run's
    kept tensors are compared with the eager run's values of both."""
    from kit.recipe import lora_down
    from kit.recipe.layers import decoder_layers
    from kit.recipe.recompute import compile_layers, selective_checkpointing

    ids = torch.randint(3, 1000, (1, 64), generator=torch.Generator().manual_seed(5))
    model, r = _nf4_layer_model()
    for m in model.modules():
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.0
    lora_down.enable(model)
    gate = decoder_layers(model)[0].mlp.gate_proj
    seen = {}
    hooks = [gate.register_forward_hook(lambda m, a, out: seen.update(sum=out.detach())),
             gate.base_layer.register_forward_hook(lambda m, a, out: seen.update(base=out.detach()))]
    with torch.no_grad():
        model(input_ids=ids, use_cache=False)
    for hook in hooks:  # not traced: a hook's result would be one more output of the graph
        hook.remove()
    assert not torch.allclose(seen["sum"], seen["base"], atol=1e-3)  # the adapter matters
    model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
    eager = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    model.zero_grad(set_to_none=True)
    assert selective_checkpointing(model, "matmuls", r, compiled=True) == [0, 1]
    kept = []
    try:
        torch._dynamo.reset()
        compile_layers(model)
        embeds = model.get_input_embeddings()(ids).detach().requires_grad_(True)
        with torch.autograd.graph.saved_tensors_hooks(lambda t: kept.append(t) or t, lambda t: t):
            loss = model(inputs_embeds=embeds, labels=ids, use_cache=False).loss
        loss.backward()
    finally:
        torch._dynamo.reset()

    def held(want):
        flat = want.reshape(-1, want.shape[-1])
        return any(t.dim() and t.shape[-1] == flat.shape[-1] and t.numel() == flat.numel()
                   and torch.allclose(t.reshape(flat.shape), flat, atol=1e-4) for t in kept)

    assert held(seen["sum"]) and not held(seen["base"])
    for n, p in model.named_parameters():  # and the adapters learn what they learn eagerly
        if p.requires_grad:
            assert torch.allclose(p.grad, eager[n], atol=1e-5), n


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_the_cpp_wrapper_computes_what_the_python_wrapper_does():
    """training.compile_wrapper=cpp (inductor's C++ wrapper) on the GPU defaults' layer (NF4,
    grouped and fused adapters with dropout, keeping every matmul): the same loss and adapter
    gradients as the Python wrapper, same seed, to bf16's rounding."""
    from kit.config import load_config
    from kit.recipe import model as kmodel
    from kit.recipe.recompute import compile_layers

    cfg = load_config(None, ["model.name=kit:tiny-llama", "data.max_seq_len=64",
                             "training.compile=true", "training.recompute.keeps=matmuls",
                             "lora.fused_down=true", "lora.group_inputs=true"])
    ids = torch.randint(3, 100, (2, 64), device="cuda")
    got = {}
    try:
        for wrapper in ("python", "cpp"):
            torch._dynamo.reset()
            model = kmodel.build(cfg, torch.device("cuda")).model
            compile_layers(model, 1.0, wrapper)
            torch.manual_seed(0)
            loss = model(input_ids=ids, labels=ids, use_cache=False).loss
            loss.backward()
            got[wrapper] = (loss.item(), torch.cat([p.grad.flatten().float() for p in
                                                    model.parameters() if p.requires_grad]))
    finally:  # compile_layers sets the wrapper process-wide: the next tests compile as before
        import torch._inductor.config as inductor_config

        inductor_config.cpp_wrapper = False
        torch._dynamo.reset()
    (lp, gp), (lc, gc) = got["python"], got["cpp"]
    assert lc == pytest.approx(lp, rel=1e-3)
    assert torch.nn.functional.cosine_similarity(gp, gc, dim=0) > 0.999 and gc.abs().sum() > 0


def _int_array_methods():
    from torch._inductor.codegen.cpp_wrapper_cpu import CppWrapperCpu

    from kit.recipe import recompute

    recompute.stable_int_arrays()  # what compile_layers(..., "cpp") does first
    return {"torch's, as the kit leaves it": CppWrapperCpu.codegen_int_array_var,
            "the kit's": recompute._int_array_var}


@pytest.mark.parametrize("which", ["torch's, as the kit leaves it", "the kit's"])
def test_the_cpp_wrapper_declares_a_size_array_in_every_buffer_that_uses_it(which):
    """training.compile_wrapper=cpp: inductor writes a layer's C++ code twice (memory planning's
    two passes, two code buffers); a size array's name must come with its declaration in the
    buffer that uses it. torch 2.11-2.12 keyed its cache by a freed bound method's id, so the
    second buffer got the first's name undeclared and the C++ compile failed on the GPU."""
    import itertools

    from torch._inductor.codegen.cpp_wrapper_cpu import CppWrapperCpu
    from torch._inductor.utils import IndentedBuffer

    method = _int_array_methods()[which]
    wrapper = object.__new__(CppWrapperCpu)  # the codegen state it reads, without a graph
    wrapper.codegen_int_array_var_cache, wrapper.declared_int_array_vars = {}, set()
    wrapper.int_array_id = itertools.count()
    first, second = IndentedBuffer(), IndentedBuffer()
    names = [method(wrapper, "{2, 4096}", code.writeline) for code in (first, second)]
    assert [f"{name}[] = {{2, 4096}};" in code.getvalue()
            for name, code in zip(names, (first, second), strict=True)] == [True, True]
    # within one buffer the declaration is reused
    assert method(wrapper, "{2, 4096}", first.writeline) == names[0]
