"""quantization.fp8_matmul: the frozen 4-bit layers' matmuls in FP8 (rank side; opt-in).

    enable(model)   # every bitsandbytes Linear4bit: dequantize, then an FP8 matmul with row scales

A QLoRA step spends most of its time in the frozen base layers' matmuls: forward, and the input
gradient in backward (no weight gradient: the base is frozen). bitsandbytes runs each as a 4-bit
weight dequantized to bf16 and a bf16 matmul. Here the dequantized weight and the activations are
cast to FP8 (e4m3) with one scale per row, and the product runs in `torch._scaled_mm`, which
Hopper GPUs execute at about twice the bf16 rate; the output and every gradient stay bf16, and
the adapters (LoRA) are untouched. It changes numerics: the loss difference it makes is measured
(`benchmarks/records/2026-11-24-fp8-8b-1xh100`; on a real model, `2026-11-24-levers-learning-smollm2-cpu`: the held-out loss
after 10 steps 0.045 above the article recipe's, where two seeds differ by 0.029), so it is
opt-in. Evaluation inside the run uses it too; the saved adapter is the same kind as always, and
a plain PEFT reload computes in bf16, so its logits differ from the run's own by FP8's rounding.

Gap filled: bitsandbytes has no FP8 path for its 4-bit layers, and torchao's FP8 training
converts nn.Linear layers whose weights it owns (trainable, bf16), not frozen 4-bit ones.
"""

from __future__ import annotations

import types

import torch

E4M3 = torch.float8_e4m3fn
E4M3_MAX = torch.finfo(E4M3).max


def quantize_rows(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(FP8 e4m3 tensor, fp32 scale per row): t ~= fp8 * scale, each row scaled to the format's
    range by its own largest magnitude."""
    scale = t.abs().amax(dim=-1, keepdim=True).float().clamp(min=1e-12) / E4M3_MAX
    return (t.float() / scale).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3), scale


def fp8_matmul(a: torch.Tensor, b_rows: torch.Tensor, out_dtype) -> torch.Tensor:
    """a @ b_rows.T for 2-D a (M x K) and b_rows (N x K), both scaled per row, in FP8."""
    qa, sa = quantize_rows(a)
    qb, sb = quantize_rows(b_rows)
    return torch._scaled_mm(qa, qb.t(), scale_a=sa, scale_b=sb.t(), out_dtype=out_dtype)


class _FP8Linear(torch.autograd.Function):
    """y = x @ W.T (+ bias) with W frozen and 4-bit, both matmuls in FP8: forward (rows of x
    against rows of W) and the input gradient (rows of the output gradient against rows of W.T).
    Keeps the packed weight for backward and dequantizes it again there, as bitsandbytes'
    MatMul4Bit does (whose argument order and saved state this mirrors, so that torch.compile
    traces it the same way)."""

    @staticmethod
    def forward(ctx, x, packed, bias, quant_state):
        from kit.recipe.nf4 import dequantize

        packed = packed.view(-1, 1)  # bitsandbytes' canonical layout; quant_state has the shape
        w = dequantize(packed, quant_state).to(x.dtype)  # (out, in)
        y = fp8_matmul(x.reshape(-1, x.shape[-1]), w, x.dtype).reshape(*x.shape[:-1], w.shape[0])
        ctx.state, ctx.tensors = quant_state, (packed,)
        return y + bias.to(y.dtype) if bias is not None else y

    @staticmethod
    def backward(ctx, grad):
        from kit.recipe.nf4 import dequantize

        w = dequantize(ctx.tensors[0], ctx.state).to(grad.dtype)
        dx = fp8_matmul(grad.reshape(-1, grad.shape[-1]), w.t().contiguous(), grad.dtype)
        return dx.reshape(*grad.shape[:-1], w.shape[1]), None, None, None


def _fits(x: torch.Tensor, out_features: int) -> bool:
    # torch._scaled_mm on GPUs wants the inner and outer sizes in multiples of 16.
    return x.shape[-1] % 16 == 0 and out_features % 16 == 0


def enable(model) -> int:
    """Run every bitsandbytes Linear4bit of `model` through the FP8 matmul (a frozen weight; a
    layer whose sizes are not multiples of 16 keeps bitsandbytes' own path). Returns how many."""
    import bitsandbytes as bnb
    from bitsandbytes.nn.modules import fix_4bit_weight_quant_state_from_module

    def forward(self, x):
        fix_4bit_weight_quant_state_from_module(self)
        if self.weight.requires_grad or not _fits(x, self.out_features):
            return type(self).forward(self, x)
        bias = None if self.bias is None else self.bias.to(x.dtype)
        return _FP8Linear.apply(x, self.weight, bias, self.weight.quant_state)

    layers = [m for m in model.modules() if isinstance(m, bnb.nn.Linear4bit)]
    for m in layers:
        m.forward = types.MethodType(forward, m)
    return len(layers)
