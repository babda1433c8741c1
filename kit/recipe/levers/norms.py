"""training.recompute.lean_norms: RMSNorms that keep their input, not its fp32 copy.

    lean_norms(model)   # before sharding; eager layers

transformers' Llama-style RMSNorm upcasts its input to fp32, normalises, casts back and scales:
autograd keeps the fp32 copy for backward, 4 bytes per value of a tensor that exists anyway in
bf16 (16 KiB per token at the 8B shape, twice per layer). At long context that is a large share of
what a recomputed layer holds: at 131,072 tokens one such copy is 2 GiB, the allocation that ran
out of memory with attention tiles on at 24 GiB (benchmarks/records/2026-11-27-attention-tiles-context-8b-1xh100). This
norm computes the same forward, op for op, and keeps the bf16 input and the fp32 reciprocal
root mean square (4 bytes per token); backward recomputes the normalised values from them. Both
run 8,192 tokens at a time, so their fp32 work never spans the whole sequence (autograd's
backward of the eager norm holds several fp32 tensors of the sequence's size at once).

For the RMSNorm classes of Llama, Mistral, Qwen2 and Qwen3 (weight * normalised, in that order);
other families' norms ((1 + weight) in Gemma, the order of OLMo 2) are refused in one line.
Gap filled: transformers' RMSNorms have no memory-lean backward; torch's fused rms_norm rounds
differently (it scales in fp32 before the cast).
"""

from __future__ import annotations

import types

import torch

from kit.recipe.layers import decoder_layers

NORMS = ("LlamaRMSNorm", "MistralRMSNorm", "Qwen2RMSNorm", "Qwen3RMSNorm")


ROWS = 8192  # tokens per chunk: forward's and backward's fp32 work exists for one chunk at a time


def _rows(x):
    return x.reshape(-1, x.shape[-1]).split(ROWS)


class _LeanRMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps):
        out, rstds = torch.empty_like(x).reshape(-1, x.shape[-1]), []
        start = 0
        for rows in _rows(x):  # HF's forward, op for op, a chunk of tokens at a time
            x32 = rows.to(torch.float32)
            rstds.append(torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps))
            out[start:start + len(rows)] = weight * (x32 * rstds[-1]).to(x.dtype)
            start += len(rows)
        rstd = torch.cat(rstds)
        ctx.save_for_backward(x, weight, rstd)
        return out.reshape(x.shape)

    @staticmethod
    def backward(ctx, grad):
        x, weight, rstd = ctx.saved_tensors
        dx = torch.empty_like(x).reshape(-1, x.shape[-1])
        dw = torch.zeros(x.shape[-1], dtype=torch.float32, device=x.device)
        start = 0
        for rows, g, r in zip(_rows(x), _rows(grad), rstd.split(ROWS), strict=True):
            n = rows.to(torch.float32) * r
            gn = (g * weight).to(torch.float32)  # through the cast back, as autograd passes it
            dx[start:start + len(rows)] = (r * (gn - n * (gn * n).mean(-1, keepdim=True))).to(x.dtype)
            if ctx.needs_input_grad[1]:
                dw += (g * n.to(x.dtype)).sum(0, dtype=torch.float32)
            start += len(rows)
        return dx.reshape(x.shape), dw.to(weight.dtype) if ctx.needs_input_grad[1] else None, None


def _forward(self, hidden_states):
    if not torch.is_grad_enabled():
        return type(self).forward(self, hidden_states)
    return _LeanRMSNorm.apply(hidden_states, self.weight, self.variance_epsilon)


def lean_norms(model) -> int:
    """Give every decoder layer's RMSNorms the lean backward; returns how many norms."""
    from kit.config import ConfigError

    count = 0
    for layer in decoder_layers(model):
        for module in layer.modules():
            name = type(module).__name__
            if not name.endswith("RMSNorm") and not name.endswith("LayerNorm"):
                continue
            if name not in NORMS or not hasattr(module, "variance_epsilon"):
                raise ConfigError(f"training.recompute.lean_norms: true is not allowed for "
                                  f"{name}; expected the RMSNorm of Llama, Mistral, Qwen2 or "
                                  "Qwen3 (or false)")
            module.forward = types.MethodType(_forward, module)
            count += 1
    return count
