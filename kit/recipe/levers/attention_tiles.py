"""training.recompute.attention_tile_tokens: each layer's attention block a tile of queries at a time.

    tile_attention(model, tokens=8192)   # before sharding; eager layers, whole-layer recompute

At long context, what a recomputed layer holds for its backward is mostly its attention block's:
the norm's fp32 copy, q, k, v before and after RoPE, attention's output and the copy o_proj reads,
and each adapter's dropped input, all of them per token of the whole sequence (~90 KiB per token
at the 8B shape, where the layer's input is 8 KiB). Run a tile of queries at a time, the block
keeps only its input: forward computes keys and values for the whole sequence (4 KiB per token
at the 8B shape, with grouped-query attention) and then each tile's queries, attention over the
keys up to the tile's end and o_proj, without a graph; backward computes the projections again,
a tile at a time, with one. Attention's causal mask for a tile that ends at e and starts at s > 0
is aligned to its lower right (query s + i sees keys 0 .. s + i). Each tile runs on
kit.recipe.levers.tile_kernels, which returns attention's log-sum-exp and takes it back in backward.
Inside whole-layer recompute (how the kit runs tiles) the recompute's tiles keep their output and
log-sum-exp on the module for the backward that follows, so attention's forward runs twice a step,
as untiled (forward, recompute), and backward runs its backward kernels only; the output kept is
the sequence's q values per token (4 GiB at 524,288 tokens of the 8B shape), while the layer is in
backward. Run without the layer's recompute, backward runs each tile's forward once more.

Each projection's RNG state is saved in forward and restored in backward: the same dropout masks.
The adapters' gradients are summed over the tiles and returned as this function's own (as
kit.recipe.recompute's tiled MLP does).

For decoder layers whose attention module has q_proj, k_proj, v_proj and o_proj (optional
q_norm / k_norm) and RoPE through its modeling module's apply_rotary_pos_emb: Llama, Mistral,
Qwen2, Qwen3 and their kin. Sliding-window attention and attention dropout are refused in one line.
A batch that carries an attention mask (padded rows) runs its attention whole, said once.

Gap filled: transformers and torch tile no attention block over its queries for training;
flash attention tiles inside the kernel, not the projections and adapters around it.
"""

from __future__ import annotations

import contextlib
import sys
import types

import torch
import torch.nn.functional as F

from kit.recipe.layers import decoder_layers
from kit.recipe.levers import tile_kernels

_SAID: set[str] = set()


def rng_state(device: torch.device) -> torch.Tensor:
    return torch.cuda.get_rng_state(device) if device.type == "cuda" else torch.get_rng_state()


@contextlib.contextmanager
def restored_rng(device: torch.device, state: torch.Tensor):
    """Run with the RNG state a tile saw in forward; the global state is left as it was."""
    on_gpu = device.type == "cuda"
    with torch.random.fork_rng(devices=[device.index or 0] if on_gpu else []):
        (torch.cuda.set_rng_state(state, device) if on_gpu else torch.set_rng_state(state))
        yield


def _rope(attn):
    return sys.modules[type(attn).__module__].apply_rotary_pos_emb


def _heads(attn, proj, norm, x):
    b, t = x.shape[:2]
    y = getattr(attn, proj)(x).view(b, t, -1, attn.head_dim)
    if norm and hasattr(attn, norm):
        y = getattr(attn, norm)(y)
    return y.transpose(1, 2)


def _queries(attn, x, cos, sin):
    q = _heads(attn, "q_proj", "q_norm", x)
    return _rope(attn)(q, q, cos, sin)[0]


def _keys_values(attn, x, cos, sin):
    k = _heads(attn, "k_proj", "k_norm", x)
    return _rope(attn)(k, k, cos, sin)[0], _heads(attn, "v_proj", None, x)


def _attend(attn, q, k, v, start):
    """Queries `q` (positions start .. start + len) over keys 0 .. start + len, causally, through
    SDPA with torch's causal_lower_right mask: round 5's path, kept as the reference
    benchmarks/tools/tile_attention_bench.py measures tile_kernels against."""
    from torch.nn.attention.bias import causal_lower_right

    gqa = q.shape[1] != k.shape[1]
    if start == 0:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=attn.scaling,
                                              enable_gqa=gqa)
    mask = causal_lower_right(q.shape[2], k.shape[2])
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=attn.scaling,
                                          enable_gqa=gqa)


def _output(attn, a):
    b, _, t, _ = a.shape
    return attn.o_proj(a.transpose(1, 2).reshape(b, t, -1))


def _spans(length: int, tokens: int) -> list[tuple[int, int]]:
    return [(s, min(s + tokens, length)) for s in range(0, length, tokens)]


def _add(total, more):
    return [a if b is None else b if a is None else a + b for a, b in zip(total, more, strict=True)]


def _in_backward() -> bool:
    """True while autograd runs a backward: here, a checkpointed layer's recompute."""
    return torch._C._current_graph_task_id() != -1


class _TiledAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, attn, tokens, x, cos, sin, *params):
        ctx.attn, ctx.tokens, ctx.params = attn, tokens, params
        ctx.save_for_backward(x, cos, sin)
        spans = _spans(x.shape[1], tokens)
        ctx.rng_kv, ctx.rng_q, ctx.rng_o = [], [], []
        keys, values = [], []
        for s, e in spans:
            ctx.rng_kv.append(rng_state(x.device))
            k, v = _keys_values(attn, x[:, s:e], cos[:, s:e], sin[:, s:e])
            keys.append(k)
            values.append(v)
        k, v = torch.cat(keys, 2), torch.cat(values, 2)
        del keys, values
        # Run again by a checkpointed layer's recompute, the backward that follows is this
        # block's: it takes the keys, values and each tile's output and log-sum-exp from here
        # instead of running attention's forward a third time.
        stash = [] if _in_backward() else None
        outs = []
        for s, e in spans:
            ctx.rng_q.append(rng_state(x.device))
            q = _queries(attn, x[:, s:e], cos[:, s:e], sin[:, s:e])
            a, lse, aux = tile_kernels.forward(q, k[:, :, :e], v[:, :, :e], s, attn.scaling)
            ctx.rng_o.append(rng_state(x.device))
            outs.append(_output(attn, a))
            if stash is not None:
                stash.append((a, lse, aux))
        attn._kit_tile_stash = None if stash is None else (x.data_ptr(), x.shape, k, v, stash)
        return torch.cat(outs, 1)

    @staticmethod
    def backward(ctx, grad):
        x, cos, sin = ctx.saved_tensors
        attn, params, dev = ctx.attn, ctx.params, x.device
        spans = _spans(x.shape[1], ctx.tokens)
        stash, attn._kit_tile_stash = getattr(attn, "_kit_tile_stash", None), None
        if stash is not None and stash[:2] == (x.data_ptr(), x.shape):
            k, v, tiles = stash[2:]
        else:  # not recomputed just before: the keys and values again (the same masks)
            tiles = None
            with torch.no_grad():
                kv = []
                for (s, e), rng in zip(spans, ctx.rng_kv, strict=True):
                    with restored_rng(dev, rng):
                        kv.append(_keys_values(attn, x[:, s:e], cos[:, s:e], sin[:, s:e]))
                k, v = torch.cat([p[0] for p in kv], 2), torch.cat([p[1] for p in kv], 2)
                del kv
        del stash
        dk, dv = torch.zeros_like(k), torch.zeros_like(v)
        dx = torch.empty_like(x)
        dp = [None] * len(params)
        for i, ((s, e), rq, ro) in enumerate(zip(spans, ctx.rng_q, ctx.rng_o, strict=True)):
            xt = x[:, s:e].detach().requires_grad_(True)
            with torch.enable_grad(), restored_rng(dev, rq):
                q = _queries(attn, xt, cos[:, s:e], sin[:, s:e])
            if tiles is not None:
                (a, lse, aux), tiles[i] = tiles[i], None
            else:
                with torch.no_grad():
                    a, lse, aux = tile_kernels.forward(q.detach(), k[:, :, :e], v[:, :, :e], s,
                                                       attn.scaling)
            a_in = a.detach().requires_grad_(True)
            with torch.enable_grad(), restored_rng(dev, ro):
                out = _output(attn, a_in)
            got = torch.autograd.grad(out, (a_in, *params), grad[:, s:e], allow_unused=True)
            dp = _add(dp, got[1:])
            del out, a_in
            dq = tile_kernels.backward(got[0], q.detach(), k[:, :, :e], v[:, :, :e], a, lse, aux,
                                       s, attn.scaling, dk[:, :, :e], dv[:, :, :e])
            del got, a, lse, aux
            got = torch.autograd.grad(q, (xt, *params), dq, allow_unused=True)
            dx[:, s:e] = got[0]
            dp = _add(dp, got[1:])
        del k, v
        for (s, e), rng in zip(spans, ctx.rng_kv, strict=True):
            xt = x[:, s:e].detach().requires_grad_(True)
            with torch.enable_grad(), restored_rng(dev, rng):
                kt, vt = _keys_values(attn, xt, cos[:, s:e], sin[:, s:e])
                got = torch.autograd.grad((kt, vt), (xt, *params),
                                          (dk[:, :, s:e], dv[:, :, s:e]), allow_unused=True)
            dx[:, s:e] += got[0]
            dp = _add(dp, got[1:])
        return None, None, dx, None, None, *dp


def tile_attention(model, tokens: int) -> int:
    """Run each decoder layer's attention block `tokens` queries at a time
    (training.recompute.attention_tile_tokens); returns how many blocks. A layer whose attention
    this cannot tile is refused in one line (kit.config.ConfigError)."""
    from kit.config import ConfigError

    field = f"training.recompute.attention_tile_tokens: {tokens} is not allowed"
    layers = decoder_layers(model)
    for layer in layers:
        attn = getattr(layer, "self_attn", None)
        need = ("q_proj", "k_proj", "v_proj", "o_proj", "head_dim", "scaling")
        if attn is None or not all(hasattr(attn, n) for n in need) or not hasattr(
                sys.modules[type(attn).__module__], "apply_rotary_pos_emb"):
            name = type(attn if attn is not None else layer).__name__
            raise ConfigError(f"{field} for {name}; expected attention with q/k/v/o projections "
                              "and rotary embeddings (Llama, Mistral, Qwen2, Qwen3), or 0")
        if getattr(attn, "sliding_window", None) or getattr(attn.config, "attention_dropout", 0):
            raise ConfigError(f"{field} with sliding-window attention or attention dropout "
                              f"({type(attn).__name__}); expected 0")

    def forward(self, hidden_states, position_embeddings=None, attention_mask=None, *args, **kw):
        cache = kw.get("cache", kw.get("past_key_values", args[0] if args else None))
        whole = (not torch.is_grad_enabled() or hidden_states.shape[1] <= tokens
                 or cache is not None or position_embeddings is None)
        if not whole and attention_mask is not None:
            if "mask" not in _SAID:
                _SAID.add("mask")
                print("[kit] training.recompute.attention_tile_tokens: this batch carries an "
                      "attention mask (padded rows); its attention runs whole", file=sys.stderr)
            whole = True
        if whole:
            return type(self).forward(self, hidden_states, position_embeddings, attention_mask,
                                      *args, **kw)
        cos, sin = position_embeddings
        params = [p for p in self.parameters() if p.requires_grad]
        return _TiledAttention.apply(self, tokens, hidden_states, cos, sin, *params), None

    for layer in layers:
        layer.self_attn.forward = types.MethodType(forward, layer.self_attn)
    return len(layers)
