"""What each decoder layer keeps for backward, and what it computes again (training.* levers).

    apply(model, cfg)                                 # what cfg.training.recompute asks for
    enable_activation_checkpointing(model, every=1)   # whole layers: keep only their inputs
    selective_checkpointing(model, "matmuls", r=16)   # keep the matmuls' results, redo the rest
    compile_layers(model, 1.0, "cpp")                 # torch.compile each layer (after sharding)
    tile_mlp(model, tokens=8192)                      # each MLP a tile of tokens at a time

Backward needs what forward computed. Keeping all of it costs ~0.4 GiB per decoder layer and
2,048-token sequence at the 8B shape (most of it element-wise results: norms, RoPE, SiLU, the
adapters' dropout copies); recomputing a whole layer costs a second forward, a third more compute.
Between the two, `training.recompute.keeps` chooses what a checkpointed layer keeps:

- `inputs`: only the layer's input (transformers' own activation checkpointing); backward runs the
  whole layer again, its frozen matmuls included.
- `matmuls`: the results of the frozen linear layers (q, k, v, o, gate, up, down), of attention and
  of each adapter's down-projection; backward recomputes only the cheap rest (norms, RoPE, SiLU,
  dropout from its saved RNG state, the adapters' up-projections). No base-model matmul runs twice.
- `mlp_matmuls`: the MLP's gate and up projections (the widest results), attention's and the
  adapters'; q, k, v, o and down are recomputed (about a fifth of the layer's matmul work runs
  twice).
- `attention_matmuls`: as `matmuls`, except the MLP's gate and up projections, which are
  recomputed (about half of the layer's matmul work runs twice).

`training.recompute.matmul_layers: N` gives the first N of them the `matmuls` policy instead: the
memory between two policies, used a layer at a time (opt-in: measured, it paid ~0.2% a layer).

This is torch's selective activation checkpointing (`torch.utils.checkpoint` with
`create_selective_checkpoint_contexts`): a policy sees each operation of the layer's forward and
says save or recompute. It runs the same eagerly and inside compiled layers, where the compiler's
partitioner follows the policy (and recomputes dropout with the RNG state of the forward).
"""

from __future__ import annotations

import functools
import types

import torch

from kit.recipe import lora_down, nf4
from kit.recipe.layers import decoder_layers
from kit.recipe.levers.attention_tiles import restored_rng, rng_state, tile_attention
from kit.recipe.levers.norms import lean_norms

KEEPS = ("inputs", "matmuls", "mlp_matmuls", "attention_matmuls")
_MATMULS = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default}
_TWO_OPERANDS = {getattr(torch.ops.aten, name).default for name in ("_scaled_mm", "_grouped_mm")
                 if hasattr(torch.ops.aten, name)}  # fmt: skip
_ATTENTION = {getattr(torch.ops.aten, name).default for name in (
    "_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_flash_attention_for_cpu",
    "_flash_attention_forward", "_efficient_attention_forward",
) if hasattr(torch.ops.aten, name)}  # fmt: skip


def enable_activation_checkpointing(model, every: int = 1) -> list[int]:
    """Non-reentrant recompute per decoder layer, through transformers' own switch (renamed in
    transformers 5.2x; the old name remains in the versions GPU images ship). With every=k only
    layers 0, k, 2k, ... recompute (selective checkpointing): transformers keeps a
    `gradient_checkpointing` flag on each decoder layer, and the others are switched back off.
    Returns the indices of the checkpointed layers."""
    kwargs = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    # transformers also hooks the input embeddings to make their output require grad, which only
    # reentrant checkpointing needs: with it, backward runs down to the embeddings and FSDP2
    # gathers the whole table again there (measured, notebook 04: 1 GiB a step for a 128k x
    # 4,096 table), to compute a gradient nobody uses.
    model.disable_input_require_grads()
    layers = decoder_layers(model)
    for i, layer in enumerate(layers):
        layer.gradient_checkpointing = i % every == 0
    return [i for i, layer in enumerate(layers) if layer.gradient_checkpointing]


def _matmul_shape(op, args) -> tuple[int, int] | None:
    """(inputs, outputs) per token of a matmul of a linear layer (FP8 ones too), or None for any
    other op. bitsandbytes runs a 4-bit layer as one op of its own, `bitsandbytes::gemm_4bit(A, B, shape,
    ...)`, with the weight's (out, in) shape as its third argument; the kit's (`kit::nf4_linear`,
    kit.recipe.nf4) as its eighth."""
    if op in _MATMULS:
        a, b = args[-2], args[-1]  # addmm(bias, a, b), mm(a, b)
        return a.shape[-1], b.shape[-1]
    if op in lora_down.sum_ops():  # (base's result (M, N), low (M, r), up (N, r), alpha)
        return args[1].shape[-1], args[0].shape[-1]
    if op in _TWO_OPERANDS:  # kit.recipe.levers.fp8's _scaled_mm(a, b, scale_a, scale_b); the grouped
        # experts' _grouped_mm(a (rows, in), b (E, in, out), offs=...): one op for every expert
        return args[0].shape[-1], args[1].shape[-1]
    if getattr(op, "namespace", None) == "bitsandbytes" and "gemm" in op.__name__:
        out, inner = args[2][0], args[2][1]
        return inner, out
    if op in nf4.linear_ops():  # the kit's 4-bit layer (kit.recipe.nf4): the same, shape at 7
        out, inner = args[7][0], args[7][1]
        return inner, out
    return None


def save_policy(keeps: str, rank: int, mlp_width: int, sums: bool = False):
    """The policy for `keeps` ('matmuls', 'mlp_matmuls' or 'attention_matmuls'): which results of a decoder layer's
    forward backward gets from memory. Matmuls are told apart by shape: an adapter's
    down-projection has `rank` outputs, its up-projection `rank` inputs (the grouped experts pad
    the rank to a multiple of 8: that width too). With `sums` (compiled layers) an up-projection
    that adds itself to the base's result in one op (kit.recipe.lora_down.add_up) is the
    adapted projection's output and is kept as the base's would be: the compiler's partitioner
    then keeps that sum and drops the base's result, which backward no longer needs. Eagerly
    every kept result is held (torch's eager policy keeps what it is told), so there the sum is
    recomputed from the kept base, as any up-projection. The MLP's gate and up projections have
    `mlp_width` outputs (2 x that when fused). A MoE layer's grouped GEMMs (kit.recipe.
    grouped_experts: one `aten._grouped_mm` per projection for every expert) are told apart the
    same way: gate_up is the MLP's, down (hidden-wide) is kept with attention's. Everything not
    saved is recomputed."""
    from torch.utils.checkpoint import CheckpointPolicy

    if keeps not in KEEPS[1:]:
        raise ValueError(f"training.recompute.keeps: {keeps!r} has no policy; expected "
                         f"one of {KEEPS[1:]}")

    ranks = (rank, rank + -rank % 8)

    def policy(ctx, op, *args, **kwargs):
        if op in _ATTENTION or op in lora_down.ops():  # an adapter's down-projection, dropout inside
            return CheckpointPolicy.MUST_SAVE
        shape = _matmul_shape(op, args)
        if shape is None:
            return CheckpointPolicy.PREFER_RECOMPUTE
        inner, out = shape
        if out in ranks:  # adapter down-projection: rank numbers per token, cheap to keep
            return CheckpointPolicy.MUST_SAVE
        if inner in ranks and not (sums and op in lora_down.sum_ops()):
            return CheckpointPolicy.PREFER_RECOMPUTE  # adapter up-projection: r-wide, cheap
        in_mlp = out in (mlp_width, 2 * mlp_width)
        if (keeps == "attention_matmuls" and in_mlp) or (keeps == "mlp_matmuls" and not in_mlp):
            return CheckpointPolicy.PREFER_RECOMPUTE
        return CheckpointPolicy.MUST_SAVE

    return policy


def selective_checkpointing(model, keeps: str, rank: int, every: int = 1,
                            matmul_layers: int = 0, compiled: bool = False) -> list[int]:
    """Run decoder layers 0, every, 2*every, ... under torch.utils.checkpoint with the save policy
    for `keeps`, the first `matmul_layers` of them with the policy that keeps every matmul
    (training.recompute.matmul_layers); returns their indices. `compiled`: the layers will be
    compiled (training.compile), so the policy keeps adapted projections' sums (`save_policy`).
    Call before sharding and
    compiling: the layer's forward is replaced in place (one function per policy, so a compiled
    layer compiles once per policy)."""
    from kit.config import ConfigError

    config = model.config
    # A mixture of experts' MLP is its experts (Qwen3-MoE, OLMoE: moe_intermediate_size wide)
    width = getattr(config, "moe_intermediate_size", None) or config.intermediate_size
    chosen = [i for i in range(len(decoder_layers(model))) if i % every == 0]
    if matmul_layers > len(chosen):
        raise ConfigError(f"training.recompute.matmul_layers: {matmul_layers} is not allowed; "
                          f"expected at most the {len(chosen)} recomputed decoder layers")
    forwards = (_checkpointed("matmuls", rank, width, compiled),
                _checkpointed(keeps, rank, width, compiled))
    layers = decoder_layers(model)
    for n, i in enumerate(chosen):
        layers[i].forward = types.MethodType(forwards[n >= matmul_layers], layers[i])
    return chosen


def _checkpointed(keeps: str, rank: int, width: int, compiled: bool = False):
    """A decoder layer's forward under torch.utils.checkpoint with the save policy for `keeps`."""
    from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts

    context_fn = functools.partial(create_selective_checkpoint_contexts,
                                   save_policy(keeps, rank, width, sums=compiled))

    def forward(self, *args, **kwargs):
        if not torch.is_grad_enabled():
            return type(self).forward(self, *args, **kwargs)
        # As transformers' own checkpointing: a KV cache written in forward would be written again
        # by the recompute (and training needs none).
        if kwargs.get("past_key_values") is not None:
            kwargs["past_key_values"] = None
        return checkpoint(type(self).forward, self, *args, use_reentrant=False,
                          context_fn=context_fn, **kwargs)

    # A code object of its own per policy: torch.compile caches compiled graphs per code object,
    # and torch 2.11's guards do not tell two closures apart by their context_fn, so layers with
    # the second policy ran the first one's graph (measured on one H100: 4 of 32 layers asked to
    # keep every matmul, all 32 did, 32.0 GiB instead of ~20; bench-8b-layers-probe.yaml).
    forward.__code__ = forward.__code__.replace(co_name=f"forward_keeps_{keeps}")
    return forward


class _TiledMLP(torch.autograd.Function):
    """An MLP run over its tokens a tile at a time, keeping only its input for backward: forward
    computes each tile without a graph; backward computes each tile again with one and takes its
    gradients, so at most one tile's intermediates (gate, up, SiLU, the adapters' dropout) exist
    at once. The adapters' gradients are summed over the tiles and returned as this function's
    own, so autograd accumulates them once, as the engines' hooks expect. Each tile's RNG state
    is saved in forward and restored in backward: the same dropout masks. Gap filled: torch's
    checkpoint keeps a whole module's intermediates during its recompute; transformers has no
    tiled MLP."""

    @staticmethod
    def forward(ctx, mlp, tokens, x, *params):
        ctx.mlp, ctx.tokens, ctx.params = mlp, tokens, params
        ctx.save_for_backward(x)
        flat = x.reshape(-1, x.shape[-1])
        ctx.rng, outs = [], []
        for tile in flat.split(tokens):
            ctx.rng.append(rng_state(x.device))
            outs.append(type(mlp).forward(mlp, tile))
        return torch.cat(outs).reshape(*x.shape[:-1], -1)

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        flat, grad = x.reshape(-1, x.shape[-1]), grad.reshape(-1, grad.shape[-1])
        grads_x, grads_p = [], [None] * len(ctx.params)
        for tile, g, rng in zip(flat.split(ctx.tokens), grad.split(ctx.tokens), ctx.rng, strict=True):
            with restored_rng(x.device, rng), torch.enable_grad():
                tile = tile.detach().requires_grad_(True)
                out = type(ctx.mlp).forward(ctx.mlp, tile)
                got = torch.autograd.grad(out, (tile, *ctx.params), g, allow_unused=True)
            grads_x.append(got[0])
            grads_p = [a if b is None else b if a is None else a + b
                       for a, b in zip(grads_p, got[1:], strict=True)]  # fmt: skip
        return None, None, torch.cat(grads_x).reshape(x.shape), *grads_p


def tile_mlp(model, tokens: int) -> int:
    """Run each decoder layer's MLP `tokens` tokens at a time (training.recompute.mlp_tile_tokens):
    at long sequences the MLP's intermediates are the widest tensors of a layer (gate and up:
    intermediate_size values per token each). Returns how many MLPs were tiled."""
    from kit.config import ConfigError

    layers = decoder_layers(model)
    missing = [type(layer).__name__ for layer in layers if not hasattr(layer, "mlp")]
    if missing:
        raise ConfigError(f"training.recompute.mlp_tile_tokens: {tokens} is not allowed for "
                          f"{missing[0]}; expected decoder layers with an `mlp` module (or 0)")

    def forward(self, x):
        params = [p for p in self.parameters() if p.requires_grad]
        if not torch.is_grad_enabled() or x.shape[:-1].numel() <= tokens:
            return type(self).forward(self, x)
        return _TiledMLP.apply(self, tokens, x, *params)

    for layer in layers:
        layer.mlp.forward = types.MethodType(forward, layer.mlp)
    return len(layers)


def apply(model, cfg) -> list[int]:
    """Switch on what cfg.training.recompute asks for (before sharding); returns the indices of
    the recomputed decoder layers ([] when recompute is off). MLP and attention tiling come first:
    the layer's recompute then runs the tiled blocks too."""
    rc = cfg.training.recompute
    if rc.mlp_tile_tokens:
        tile_mlp(model, rc.mlp_tile_tokens)
    if rc.attention_tile_tokens:
        tile_attention(model, rc.attention_tile_tokens)
    if rc.lean_norms:
        lean_norms(model)
    if not rc.enabled:
        return []
    if rc.keeps == "inputs":
        return enable_activation_checkpointing(model, rc.every)
    return selective_checkpointing(model, rc.keeps, cfg.lora.r, rc.every, rc.matmul_layers,
                                   compiled=cfg.training.compile is True)


def compile_layers(model, memory_budget: float = 1.0, wrapper: str = "python") -> int:
    """torch.compile the forward of every decoder layer, in place; returns how many.

    `wrapper` (training.compile_wrapper): the host code inductor generates to launch a layer's
    kernels, Python or C++ (its cpp_wrapper, compiled once more by the host's C++ compiler). The
    kernels are the same; the host's time per launch is not, and on small batches the GPU waits
    for it. Process-wide, as the memory budget: passed as one compile's options (torch.compile's
    `options`) it reached the forward graph only, and the backward graph, compiled later, failed
    ("CudaKernelParamCache not populated", torch 2.11, one H200).

    `memory_budget` (training.activation_memory_budget) is torch's activation memory budget for
    the partitioner that splits each compiled layer into forward and backward: 1.0 keeps what the
    default min-cut keeps; lower values recompute in backward, cheapest ops first, until the kept
    activations fit that fraction. It is process-wide and read when a graph compiles.

    Called after sharding: FSDP2 swaps in a subclass of the layer, whose forward is the one
    transformers' checkpointing treats as outermost, and its unshard/reshard hooks run around the
    forward (eager), not inside the compiled graph. One compiled code object serves every layer
    (parameters are graph inputs), so the compile is paid once per input shape, not per layer."""
    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config

    functorch_config.activation_memory_budget = memory_budget
    inductor_config.cpp_wrapper = wrapper == "cpp"
    if wrapper == "cpp":
        stable_int_arrays()
    layers = decoder_layers(model)
    for layer in layers:
        layer.forward = torch.compile(layer.forward)
    return len(layers)


def _int_array_var(self, int_array, writeline, known_statically=False, graph=None) -> str:
    """The C++ wrapper's size and stride arrays, one declaration per array and code buffer."""
    buffer = getattr(writeline, "__self__", writeline)  # the buffer lives; its bound method not
    key = (int_array, id(buffer), known_statically, id(graph) if graph else None)
    cache = self.codegen_int_array_var_cache
    if key not in cache:
        cache[key] = self._codegen_int_array_var_impl(int_array, writeline, known_statically)
    return cache[key]


def stable_int_arrays() -> bool:
    """Mend inductor's C++ wrapper on torch 2.11 and 2.12, where its codegen sometimes used a
    size array it never declared, and the layer's compile failed ("'int_array_12' was not declared
    in this scope": torch 2.11, the 8B plan's backward graph, one H200, 2026-11-30). It caches
    each array's name by `id(writeline)`, a bound method made for the call and freed after it, so
    the writer of memory planning's second pass can reuse the id of the first pass's and be handed
    a name declared only in the first pass's discarded code. torch 2.13 keys the buffer behind the
    method, as `_int_array_var` does; installed only before it. Returns whether it installed."""
    from torch._inductor.codegen.cpp_wrapper_cpu import CppWrapperCpu

    if torch.torch_version.TorchVersion(torch.__version__) >= (2, 13):
        return False
    CppWrapperCpu.codegen_int_array_var = _int_array_var
    return True
