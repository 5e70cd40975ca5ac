"""q4torch.matmul_4bit: forward and gradients through the fused kernels."""

import numpy as np
import pytest
import torch
from q4_reference import inputs
from q4_reference.matmul import check_against_baseline

import q4torch
import q4torch.functional as F
from q4torch._src import ops

TORCH = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def _t(x: np.ndarray, device="cpu") -> torch.Tensor:
    if x.dtype == inputs.NP_DTYPES["bfloat16"]:
        return torch.from_numpy(x.view(np.uint16).copy()).view(torch.bfloat16).to(device)
    return torch.from_numpy(x.copy()).to(device)


@pytest.mark.parametrize("dtype", inputs.DTYPES)
@pytest.mark.parametrize("nested", [False, True])
@pytest.mark.parametrize("m", [1, 7, 64])
def test_forward_and_gradients(device, rng, dtype, nested, m):
    n, k = 72, 160
    w = _t(inputs.make(rng, (n, k), "float32"), device)
    packed, state = F.quantize_4bit(w, blocksize=64, quant_type="nf4", compress_statistics=nested)
    w_deq = F.dequantize_4bit(packed, state).cpu().numpy()
    x = _t(inputs.make(rng, (m, k), dtype), device).requires_grad_()
    bias = _t(inputs.make(rng, (n,), dtype), device).requires_grad_()
    y = q4torch.matmul_4bit(x, packed.t(), state, bias=bias)
    assert y.dtype == TORCH[dtype] and y.shape == (m, n)
    x32 = x.detach().float().cpu().numpy()
    check_against_baseline(y.detach().float().cpu().numpy() - bias.detach().float().cpu().numpy(), x32, w_deq.T, dtype)
    g = _t(inputs.make(rng, (m, n), dtype), device)
    y.backward(g)
    check_against_baseline(x.grad.float().cpu().numpy(), g.float().cpu().numpy(), w_deq, dtype)
    assert torch.allclose(bias.grad.float(), g.float().sum(0), rtol=1e-2 if dtype != "float32" else 1e-5, atol=1e-3)


def test_batched_input_shapes(rng):
    w = _t(inputs.make(rng, (40, 64), "float32"))
    packed, state = F.quantize_4bit(w, quant_type="fp4")
    x = _t(inputs.make(rng, (2, 3, 64), "float32"))
    y = q4torch.matmul_4bit(x, packed, state)
    assert y.shape == (2, 3, 40)
    assert torch.equal(y.reshape(6, 40), q4torch.matmul_4bit(x.reshape(6, 64), packed, state))


def test_weight_is_frozen_and_saved_for_backward(rng):
    """The backward reads the packed weight saved by the forward; modifying it
    in place in between is caught by autograd's version check."""
    w = _t(inputs.make(rng, (32, 64), "float32"))
    packed, state = F.quantize_4bit(w, quant_type="nf4")
    x = _t(inputs.make(rng, (4, 64), "float32")).requires_grad_()
    y = q4torch.matmul_4bit(x, packed, state)
    packed.add_(1)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.sum().backward()


def test_opcheck_and_compile(rng):
    w = _t(inputs.make(rng, (48, 64), "float32"))
    for nested in (False, True):
        packed, st = F.quantize_4bit(w, quant_type="nf4", compress_statistics=nested)
        x = _t(inputs.make(rng, (5, 64), "float32")).requires_grad_()
        b = _t(inputs.make(rng, (48,), "float32")).requires_grad_()
        args = (
            x,
            packed.reshape(-1),
            st.absmax,
            st.state2.absmax if nested else None,
            st.offset if nested else None,
            48,
            64,
            64,
            "nf4",
            b,
        )
        torch.library.opcheck(ops.gemm_4bit, args)
        g = _t(inputs.make(rng, (5, 48), "float32"))
        torch.library.opcheck(ops.gemm_4bit_grad_input, (g,) + args[1:-1])

        def step(inp, bias, packed=packed, st=st):
            return q4torch.matmul_4bit(inp, packed, st, bias=bias).pow(2).sum()

        compiled = torch.compile(step, fullgraph=True)
        eager_grads = torch.autograd.grad(step(x, b), (x, b))
        compiled_grads = torch.autograd.grad(compiled(x, b), (x, b))
        for e, c in zip(eager_grads, compiled_grads, strict=True):
            assert torch.allclose(e, c, rtol=1e-5, atol=1e-5)


def test_bad_input(rng):
    w = _t(inputs.make(rng, (32, 64), "float32"))
    packed, state = F.quantize_4bit(w, quant_type="nf4")
    with pytest.raises(ValueError, match="input has 63 features, the weight expects 64"):
        q4torch.matmul_4bit(torch.ones(2, 63), packed, state)
    with pytest.raises(TypeError, match="got torch.int64"):
        q4torch.matmul_4bit(torch.ones(2, 64, dtype=torch.int64), packed, state)
    with pytest.raises(ValueError, match="absmax has 31 values"):
        ops.gemm_4bit(torch.ones(2, 64), packed.reshape(-1), state.absmax[:-1], None, None, 32, 64, 64, "nf4", None)
    with pytest.raises(ValueError, match=r"bias must have shape \(32,\)"):
        q4torch.matmul_4bit(torch.ones(2, 64), packed, state, bias=torch.ones(5))
