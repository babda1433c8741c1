"""The kit's NF4 dequantize (kit.recipe.nf4): the values bitsandbytes' own dequantize returns, bit
for bit, on every layout the kit stores; the 4-bit layer's op (`kit::nf4_linear`) computes x @ W^T
and its input's gradient, and the selective recompute policies keep its result as any frozen
matmul's. On a GPU the Triton kernel equals bitsandbytes' CUDA kernel, and a Linear4bit switched
to it gives bitsandbytes' outputs and gradients (compiled: the kit's op; eagerly it keeps
bitsandbytes' forward, whose host path is the shorter there); compiled, the Triton ops' kernel is
launched by the generated code and no dequantized weight is kept from forward to backward."""

from __future__ import annotations

import re

import bitsandbytes as bnb
import bitsandbytes.functional as F
import pytest
import torch
from torch.utils.checkpoint import CheckpointPolicy

from kit.recipe import nf4, recompute

LAYOUTS = {  # name: (shape, weight dtype, nested absmax, quant_storage)
    "bf16 nested": ((256, 192), torch.bfloat16, True, torch.bfloat16),
    "fp16 plain absmax": ((128, 256), torch.float16, False, torch.uint8),
    "fp32 nested": ((64, 320), torch.float32, True, torch.float32),
    "a last block cut short": ((1000, 1), torch.bfloat16, True, torch.bfloat16),
    "more than 256 blocks (two absmax2)": ((512, 64), torch.bfloat16, True, torch.bfloat16),
}


def _quantized(shape, dtype, nested, storage, device="cpu"):
    w = torch.randn(shape, generator=torch.Generator().manual_seed(sum(shape)), dtype=torch.float32)
    return F.quantize_4bit(w.to(dtype).to(device), blocksize=64, compress_statistics=nested,
                           quant_type="nf4", quant_storage=storage)


def _op_args(packed, state):
    return (nf4._bytes(packed), *nf4._tensors(state), list(state.shape), state.blocksize)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_the_reference_returns_bitsandbytes_values_bit_for_bit(layout):
    packed, state = _quantized(*LAYOUTS[layout])
    got = nf4.dequant_op(*_op_args(packed, state), state.dtype)
    assert got.dtype == state.dtype and got.shape == state.shape
    assert torch.equal(got, F.dequantize_4bit(packed, state))
    assert torch.equal(nf4.reference(packed, state), got)


def test_the_ops_schemas_fakes_and_gradients_check():
    packed, state = _quantized(*LAYOUTS["bf16 nested"])
    x = torch.randn(3, 5, 192, requires_grad=True)
    torch.library.opcheck(nf4.dequant_op, (*_op_args(packed, state), state.dtype))
    torch.library.opcheck(nf4.linear_op, (x, *_op_args(packed, state), state.dtype, None))
    bias = torch.randn(256, requires_grad=True)
    torch.library.opcheck(nf4.linear_op, (x, *_op_args(packed, state), state.dtype, bias))


def test_the_layer_op_is_x_times_w_transposed_and_its_input_gradient():
    packed, state = _quantized(*LAYOUTS["bf16 nested"])
    w = F.dequantize_4bit(packed, state).float()
    x = torch.randn(2, 7, 192, requires_grad=True)
    bias = torch.randn(256, requires_grad=True)  # a trainable bias gets its gradient too
    y = nf4.linear(x, packed, bias, state)
    g = torch.randn_like(y)
    y.backward(g)
    torch.testing.assert_close(y, x.detach() @ w.T + bias.detach())
    torch.testing.assert_close(x.grad, g @ w)
    torch.testing.assert_close(bias.grad, g.sum((0, 1)))


def test_the_recompute_policies_keep_the_4bit_layers_result_as_a_frozen_matmuls():
    packed, state = _quantized(*LAYOUTS["bf16 nested"])
    args = (torch.randn(4, 192), *_op_args(packed, state), state.dtype, None)
    op = torch.ops.kit.nf4_linear.default
    assert recompute._matmul_shape(op, args) == (192, 256)
    # 256 outputs: the MLP's width here, so attention_matmuls recomputes it, matmuls keeps it
    assert recompute.save_policy("matmuls", 16, 256)(None, op, *args) == CheckpointPolicy.MUST_SAVE
    assert (recompute.save_policy("attention_matmuls", 16, 256)(None, op, *args)
            == CheckpointPolicy.PREFER_RECOMPUTE)


gpu = pytest.mark.skipif(not (torch.cuda.is_available() and nf4.available(torch.device("cuda"))),
                         reason="needs a CUDA GPU with the kit's Triton kernels")


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_the_kernel_returns_bitsandbytes_values_bit_for_bit(layout):
    packed, state = _quantized(*LAYOUTS[layout], device="cuda")
    got = nf4.dequantize(packed, state)
    assert torch.equal(got, F.dequantize_4bit(packed, state))
    assert torch.equal(got, nf4.reference(packed, state).to(got.device))


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("compiled", [False, True])
def test_a_linear4bit_switched_to_the_kernel_gives_bitsandbytes_outputs_and_gradients(compiled):
    torch.manual_seed(0)
    dense = torch.nn.Linear(512, 1024, dtype=torch.bfloat16)
    layers = []
    for _ in range(2):
        m = bnb.nn.Linear4bit(512, 1024, bias=True, compute_dtype=torch.bfloat16,
                              quant_type="nf4", quant_storage=torch.bfloat16)
        m.load_state_dict(dense.state_dict())
        layers.append(m.cuda().requires_grad_(False))
    assert nf4.enable(layers[1]) == 1
    x = torch.randn(4, 64, 512, device="cuda", dtype=torch.bfloat16)
    out = []
    for m in layers:
        xi = x.clone().requires_grad_(True)
        fn = torch.compile(m) if compiled else m
        y = fn(xi)
        y.backward(torch.ones_like(y))
        out.append((y.detach(), xi.grad))
    assert torch.equal(out[0][0], out[1][0]) and torch.equal(out[0][1], out[1][1])


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("keeps", [None, "matmuls", "attention_matmuls"])
def test_a_compiled_4bit_layer_launches_the_kernel_itself_and_keeps_no_dequantized_weight(keeps):
    """Compiled (alone, or under a selective recompute policy as the planner runs layers), the
    Triton ops' kernel is launched by the generated code (no op call left in it), once forward
    and once backward, and nothing as large as the bf16 weight is kept between the passes."""
    from functools import partial

    from levers import saved_bytes
    from torch._inductor.utils import run_and_get_code
    from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts

    torch.manual_seed(0)
    m = bnb.nn.Linear4bit(2048, 4096, bias=False, compute_dtype=torch.bfloat16,
                          quant_type="nf4", quant_storage=torch.bfloat16)
    m.load_state_dict(torch.nn.Linear(2048, 4096, bias=False, dtype=torch.bfloat16).state_dict())
    m = m.cuda().requires_grad_(False)
    nf4.enable(m)
    assert torch.ops.kit.nf4_linear_triton.default in nf4.linear_ops()
    fn = m if keeps is None else partial(
        checkpoint, m, use_reentrant=False, context_fn=partial(
            create_selective_checkpoint_contexts, recompute.save_policy(keeps, 16, 4096)))
    f = torch.compile(fn)
    x = torch.randn(2, 512, 2048, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    y, kept = saved_bytes(lambda: f(x), {m.weight.untyped_storage().data_ptr()})
    assert kept < 12 * 2**20, kept  # the bf16 weight is 16 MiB (the output, if kept, 8 MiB)
    torch._dynamo.reset()
    _, code = run_and_get_code(lambda: f(x).backward(torch.ones_like(y)))
    source = "\n".join(code)
    assert "ops.kit." not in source and len(re.findall(r"\bdequant_\d+\.run\(", source)) >= 2


def test_enable_switches_every_frozen_linear4bit_and_leaves_the_cpu_on_bitsandbytes_path():
    torch.manual_seed(0)
    dense = torch.nn.Linear(128, 64, dtype=torch.bfloat16)
    m = bnb.nn.Linear4bit(128, 64, compute_dtype=torch.bfloat16, quant_type="nf4",
                          quant_storage=torch.bfloat16)
    m.load_state_dict(dense.state_dict())
    m.weight = bnb.nn.Params4bit(m.weight.data, requires_grad=False, quant_type="nf4",
                                 quant_storage=torch.bfloat16)._quantize("cpu")
    x = torch.randn(3, 128, dtype=torch.bfloat16)
    before = m(x)
    model = torch.nn.Sequential(m, torch.nn.Linear(64, 8))
    assert nf4.enable(model) == 1 and "forward" in vars(m)
    assert torch.equal(m(x), before)  # off the GPU the layer runs bitsandbytes' own forward
