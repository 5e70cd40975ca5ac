"""The fused matmul through PyTorch and through JAX: the same kernel on the
same bytes gives bit-identical outputs and input gradients."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from q4_reference import inputs

import q4jax
import q4torch
import q4torch.functional as F


def _torch(x: np.ndarray) -> torch.Tensor:
    if x.dtype == inputs.NP_DTYPES["bfloat16"]:
        return torch.from_numpy(x.view(np.uint16).copy()).view(torch.bfloat16)
    return torch.from_numpy(x.copy())


def _np(t: torch.Tensor) -> np.ndarray:
    if t.dtype == torch.bfloat16:
        return t.view(torch.uint16).numpy().view(inputs.NP_DTYPES["bfloat16"])
    return t.numpy()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("quant_type, nested, blocksize", [("nf4", True, 64), ("fp4", False, 4096), ("nf4", False, 64)])
@pytest.mark.parametrize("m", [1, 5, 32])
def test_torch_and_jax_bit_identical(rng, dtype, quant_type, nested, blocksize, m):
    n, k = 96, 4096 if blocksize == 4096 else 192
    w = inputs.make(rng, (n, k), "float32")
    x = inputs.make(rng, (m, k), dtype)
    g = inputs.make(rng, (m, n), dtype)
    bias = inputs.make(rng, (n,), dtype)
    pt, st = F.quantize_4bit(_torch(w), blocksize=blocksize, quant_type=quant_type, compress_statistics=nested)
    pj, sj = q4jax.quantize_4bit(jnp.asarray(w), blocksize, quant_type, nested)
    assert np.array_equal(pt.numpy(), np.asarray(pj))
    xt = _torch(x).requires_grad_()
    yt = q4torch.matmul_4bit(xt, pt, st, bias=_torch(bias))
    yt.backward(_torch(g))
    yj, vjp = jax.vjp(lambda a: q4jax.matmul_4bit(a, pj, sj, jnp.asarray(bias)), jnp.asarray(x))
    (dxj,) = vjp(jnp.asarray(g))
    assert np.array_equal(inputs.bits(_np(yt.detach())), inputs.bits(np.asarray(yj)))
    assert np.array_equal(inputs.bits(_np(xt.grad)), inputs.bits(np.asarray(dxj)))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("quant_type, nested, blocksize", [("nf4", True, 64), ("fp4", False, 32), ("nf4", False, 256)])
@pytest.mark.parametrize("m", [1, 17, 40])
def test_w4a8_torch_and_jax_bit_identical(rng, dtype, quant_type, nested, blocksize, m):
    """activation_quant='int8': the same W4A8 kernel through both front ends
    (bit-identical outputs), and the gradient of each is the exact one (the
    regular path's, bit for bit)."""
    n, k = 70, 384
    w = inputs.make(rng, (n, k), "float32")
    x = inputs.make(rng, (m, k), dtype)
    g = inputs.make(rng, (m, n), dtype)
    bias = inputs.make(rng, (n,), dtype)
    pt, st = F.quantize_4bit(_torch(w), blocksize=blocksize, quant_type=quant_type, compress_statistics=nested)
    pj, sj = q4jax.quantize_4bit(jnp.asarray(w), blocksize, quant_type, nested)
    outs, grads = {}, {}
    for aq in (None, "int8"):
        xt = _torch(x).requires_grad_()
        yt = q4torch.matmul_4bit(xt, pt, st, bias=_torch(bias), activation_quant=aq)
        yt.backward(_torch(g))
        fj = jax.jit(lambda a, aq=aq: q4jax.matmul_4bit(a, pj, sj, jnp.asarray(bias), activation_quant=aq))
        yj, vjp = jax.vjp(fj, jnp.asarray(x))
        (dxj,) = vjp(jnp.asarray(g))
        assert np.array_equal(inputs.bits(_np(yt.detach())), inputs.bits(np.asarray(yj)))
        assert np.array_equal(inputs.bits(_np(xt.grad)), inputs.bits(np.asarray(dxj)))
        outs[aq], grads[aq] = np.asarray(yj), inputs.bits(np.asarray(dxj))
    assert np.array_equal(grads[None], grads["int8"])
    y32, q32 = outs[None].astype(np.float32), outs["int8"].astype(np.float32)
    assert not np.array_equal(y32, q32)  # W4A8 is another (int8) computation...
    assert np.linalg.norm(q32 - y32) / np.linalg.norm(y32) < 2e-2  # ...of the same product
