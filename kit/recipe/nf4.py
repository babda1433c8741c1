"""4-bit (NF4) weights dequantized by the kit's Triton kernel (rank side; GPUs where the kit's
kernels run, kit.recipe.lora_down.available).

    w = dequantize(packed, quant_state)       # bitsandbytes.functional.dequantize_4bit's values
    y = linear(x, weight, bias, quant_state)  # x @ W^T (+ bias), W 4-bit and frozen
    enable(model)                             # every bitsandbytes Linear4bit runs `linear`

A QLoRA step dequantizes every 4-bit weight twice (forward, and backward for the input's
gradient: the base is frozen, so nothing else of it is needed). bitsandbytes does it in two
kernels when the absmax is itself quantized (the absmax, then the weight), the weight's at about
1.9 TB/s on an H200 (18.6 ms a step for the Llama-3-8B shape's 14 billion values: the profile in
benchmarks/records/2026-11-30-lora-up-add-2xh200). kit.recipe.nf4_kernels does both in one
kernel, each program a run of whole blocks, and returns the same values bit for bit (the GPU
test holds it to bitsandbytes on every layout the kit stores: NF4, nested or not, bf16/fp16/fp32,
a last block cut short): 3.15 against 2.24 TB/s on a mixture of experts' stacks, and the 8B
shape's step at 24 GiB +1.7-4.6% (benchmarks/records/2026-11-30-nf4-dequant-1xh200).

`linear` is one op forward (dequantize, then the matmul, as bitsandbytes' `gemm_4bit` is one op;
compiled layers call it, eager ones bitsandbytes' own, `enable`), and backward the dequantize op
and a matmul, as bitsandbytes' MatMul4Bit runs them: nothing of the dequantized weight is kept
between the passes. On CUDA both are `torch.library.triton_op` ops (kit.recipe.nf4_kernels:
kit::nf4_linear_triton, kit::nf4_dequant_triton), whose kernel a compiled layer launches from its
own generated code, from C++ with inductor's C++ wrapper; backward's launch takes the incoming
gradient as an unread argument, so that the compiler neither merges it with the forward's nor runs
it in forward to keep its bf16 result. Off CUDA the custom ops kit::nf4_linear and kit::nf4_dequant
run the same arithmetic in torch (`dequantize`, for the experts' stacks and the FP8 lever, calls
kit::nf4_dequant, which launches the kernel on CUDA). The selective recompute policies
(kit.recipe.recompute) keep its result as they keep any frozen matmul's. bitsandbytes' own path
runs for FP4 and a nested absmax in blocks other than 256.

Gap filled: bitsandbytes' dequantize is a fixed CUDA kernel, and no library offers another for its
layout.
"""

from __future__ import annotations

import math
import types

import torch

_AVAILABLE: dict = {}  # device type -> bool, asked once (a compiled layer reads the answer)


def available(device: torch.device) -> bool:
    """The kernel runs here (the rule of the kit's other Triton kernels); kit.recipe.model asks
    before any layer compiles, so a layer's trace finds the answer kept, not a probe."""
    if device.type not in _AVAILABLE:
        from kit.recipe.lora_down import available as kernels

        _AVAILABLE[device.type] = kernels(device)
    return _AVAILABLE[device.type]


def _fits(state) -> bool:
    """A layout the kernel reads: NF4, its absmax plain or 8-bit in blocks of 256."""
    return state.quant_type == "nf4" and (not state.nested or state.state2.blocksize == 256)


def _tensors(state) -> tuple:
    """(code, absmax, absmax2, code2, offset) of a bitsandbytes QuantState (the last three None
    when the absmax is not quantized)."""
    if not state.nested:
        return state.code, state.absmax, None, None, None
    offset = state.offset
    if not isinstance(offset, torch.Tensor):
        offset = torch.tensor(float(offset), device=state.absmax.device)
    return state.code, state.absmax, state.state2.absmax, state.state2.code, offset.float()


def _bytes(packed: torch.Tensor) -> torch.Tensor:
    """The packed weight as its bytes (the kit stores it in a float `quant_storage`)."""
    flat = packed.reshape(-1)
    return flat if flat.dtype == torch.uint8 else flat.view(torch.uint8)


def reference(packed: torch.Tensor, state) -> torch.Tensor:
    """The kernel's arithmetic in torch ops, for a packed weight and its QuantState (notebook 02
    reads a layer back with it; the tests hold the kernel and bitsandbytes to it)."""
    return _reference(_bytes(packed), *_tensors(state), list(state.shape), state.blocksize,
                      state.dtype)


def _reference(packed, code, absmax, absmax2, code2, offset, shape, blocksize, dtype):
    """The absmax code2[q] x absmax2[block / 256] + offset, then each code's level (the high
    nibble of a byte first) times its block's absmax."""
    n = math.prod(shape)
    if absmax2 is not None:
        absmax = code2[absmax.long()] * absmax2.repeat_interleave(256)[:absmax.numel()] + offset
    b = packed.to(torch.int64)
    values = code[torch.stack([b >> 4, b & 15], -1).reshape(-1)[:n]]
    return (values * absmax.repeat_interleave(blocksize)[:n]).reshape(shape).to(dtype)


def _dequant(packed, code, absmax, absmax2, code2, offset, shape, blocksize, dtype):
    if not packed.is_cuda:
        return _reference(packed, code, absmax, absmax2, code2, offset, shape, blocksize, dtype)
    from kit.recipe.nf4_kernels import dequantize_into

    out = torch.empty(shape, dtype=dtype, device=packed.device)
    return dequantize_into(out, packed, code, absmax, absmax2, code2, offset, blocksize, 256)


@torch.library.custom_op("kit::nf4_dequant", mutates_args=())
def dequant_op(packed: torch.Tensor, code: torch.Tensor, absmax: torch.Tensor,
               absmax2: torch.Tensor | None, code2: torch.Tensor | None,
               offset: torch.Tensor | None, shape: list[int], blocksize: int,
               dtype: torch.dtype) -> torch.Tensor:
    return _dequant(packed, code, absmax, absmax2, code2, offset, shape, blocksize, dtype)


@dequant_op.register_fake
def _(packed, code, absmax, absmax2, code2, offset, shape, blocksize, dtype):
    return packed.new_empty(shape, dtype=dtype)


def _weight(packed, code, absmax, absmax2, code2, offset, shape, blocksize, state_dtype, dtype,
            op=dequant_op):
    w = op(packed, code, absmax, absmax2, code2, offset, shape, blocksize, state_dtype)
    return w if w.dtype == dtype else w.to(dtype)  # as bitsandbytes: its dtype, then the input's


@torch.library.custom_op("kit::nf4_linear", mutates_args=())
def linear_op(x: torch.Tensor, packed: torch.Tensor, code: torch.Tensor, absmax: torch.Tensor,
              absmax2: torch.Tensor | None, code2: torch.Tensor | None,
              offset: torch.Tensor | None, shape: list[int], blocksize: int,
              state_dtype: torch.dtype, bias: torch.Tensor | None) -> torch.Tensor:
    w = _weight(packed, code, absmax, absmax2, code2, offset, shape, blocksize, state_dtype,
                x.dtype, op=_dequant)  # inside the op: the kernel itself, no second dispatch
    return torch.nn.functional.linear(x, w, bias)


@linear_op.register_fake
def _(x, packed, code, absmax, absmax2, code2, offset, shape, blocksize, state_dtype, bias):
    return x.new_empty(*x.shape[:-1], shape[0])


def _setup(ctx, inputs, output):
    x, packed, code, absmax, absmax2, code2, offset, shape, blocksize, state_dtype, bias = inputs
    ctx.save_for_backward(packed, code, absmax, absmax2, code2, offset)
    ctx.shape, ctx.blocksize, ctx.state_dtype = shape, blocksize, state_dtype


def _backward(ctx, grad):
    if grad.is_cuda:  # the Triton op's (the kernel's launch ordered after `grad`: nf4_kernels)
        w = kernels().dequant_op(*ctx.saved_tensors, ctx.shape, ctx.blocksize, ctx.state_dtype,
                                 grad)
        w = w if w.dtype == grad.dtype else w.to(grad.dtype)
    else:
        w = _weight(*ctx.saved_tensors, ctx.shape, ctx.blocksize, ctx.state_dtype, grad.dtype)
    dx = torch.matmul(grad, w) if ctx.needs_input_grad[0] else None
    db = grad.reshape(-1, grad.shape[-1]).sum(0) if ctx.needs_input_grad[-1] else None
    return dx, None, None, None, None, None, None, None, None, None, db


linear_op.register_autograd(_backward, setup_context=_setup)

_LOADED: list = []  # kit.recipe.nf4_kernels, once `kernels()` loaded it


def kernels():
    """The Triton ops (kit.recipe.nf4_kernels: kit::nf4_linear_triton, kit::nf4_dequant_triton),
    loaded on first use: triton is imported only where a CUDA run asks for them (`enable` does,
    before any layer is compiled)."""
    if not _LOADED:
        from kit.recipe import nf4_kernels as k

        k.linear_op.register_autograd(_backward, setup_context=_setup)
        _LOADED.append(k)
    return _LOADED[0]


def linear_ops() -> tuple:
    """The ops whose result is a 4-bit layer's output (kit.recipe.recompute's policies keep it as
    any frozen matmul's; their shape argument, index 7, is the weight's (out, in))."""
    return (torch.ops.kit.nf4_linear.default, *(k.linear_op._opoverload for k in _LOADED))


def dequantize(packed: torch.Tensor, state) -> torch.Tensor:
    """bitsandbytes.functional.dequantize_4bit(packed, state), by the kernel where it runs."""
    if not (packed.is_cuda and _fits(state) and available(packed.device)):
        import bitsandbytes.functional as F

        return F.dequantize_4bit(packed.reshape(-1, 1), state)
    return dequant_op(_bytes(packed), *_tensors(state), list(state.shape), state.blocksize,
                      state.dtype)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
           state) -> torch.Tensor:
    """x @ W^T (+ bias) for a frozen 4-bit W (`weight` packed, `state` its QuantState): on CUDA
    the Triton op (a compiled layer launches its kernel from its own code), elsewhere the
    reference op."""
    op = kernels().linear_op if x.is_cuda else linear_op
    return op(x, _bytes(weight), *_tensors(state), list(state.shape), state.blocksize,
              state.dtype, bias)


def enable(model) -> int:
    """Every bitsandbytes Linear4bit of `model` whose weight is frozen NF4 runs `linear` inside a
    compiled layer (measured there: benchmarks/records/2026-11-30-nf4-dequant-1xh200). Called
    eagerly, off a CUDA device, or with another layout it keeps bitsandbytes' own forward, whose
    host path is the shorter one eagerly (0.51 against 0.90 ms for an 8B q/o layer's forward and
    backward at 4,096 tokens on an H200, the same record). Returns how many."""
    import bitsandbytes as bnb
    from bitsandbytes.nn.modules import fix_4bit_weight_quant_state_from_module

    def forward(self, x):
        fix_4bit_weight_quant_state_from_module(self)
        state = self.weight.quant_state
        if (not torch.compiler.is_compiling() or self.weight.requires_grad or not x.is_cuda
                or not _fits(state)):
            return type(self).forward(self, x)
        if not self.compute_type_is_set:
            self.set_compute_type(x)
            self.compute_type_is_set = True
        dtype = x.dtype
        if self.compute_dtype is not None:
            x = x.to(self.compute_dtype)
        bias = None if self.bias is None else self.bias.to(x.dtype)
        return linear(x, self.weight, bias, state).to(dtype)

    layers = [m for m in model.modules() if isinstance(m, bnb.nn.Linear4bit)]
    if layers and torch.cuda.is_available() and available(torch.device("cuda")):
        # now, before any layer compiles (the weights may still be on meta or the CPU, as when
        # streamed): loaded inside a compiled layer's trace, the import and the gradient's
        # registration break its graph, and the checkpointed layer then runs eagerly (measured:
        # 30 GiB and 0.73 s a step for the 8B plan of 18 GiB and 0.29 s)
        kernels()
    for m in layers:
        m.forward = types.MethodType(forward, m)
    return len(layers)
