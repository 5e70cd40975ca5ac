"""q4torch LLM.int8 ops: bitsandbytes-identical row quantization, the
differentiable int8 linear, and errors for bad input."""

import bitsandbytes.functional as bnbf
import pytest
import torch
from q4_reference import inputs
from q4_reference.matmul import rel_err

import q4
import q4torch.functional as F
from q4torch._src import ops


@pytest.mark.parametrize("threshold", [0.0, 6.0])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_vectorwise_quant_matches_bitsandbytes(rng, threshold, dtype):
    x = torch.from_numpy(inputs.make(rng, (33, 70), "float32")).to(dtype)
    x[:, 9] *= 10  # an outlier column
    q, stats, cols = F.int8_vectorwise_quant(x, threshold)
    bq, bstats, bcols = bnbf.int8_vectorwise_quant(x.clone(), threshold)
    assert torch.equal(q, bq) and torch.equal(stats, bstats)
    assert (cols is None and bcols is None) or torch.equal(cols, bcols)


@pytest.mark.parametrize("threshold", [0.0, 6.0])
def test_int8_linear_forward_backward(rng, threshold):
    w = torch.from_numpy(inputs.make(rng, (96, 128), "float32")) * 0.1
    CB, SCB, _ = F.int8_vectorwise_quant(w)
    x = torch.from_numpy(inputs.make(rng, (7, 128), "float32"))
    x[:, 3] = 20.0  # outlier column when threshold = 6
    x.requires_grad_()
    bias = torch.from_numpy(inputs.make(rng, (96,), "float32")).requires_grad_()
    y = F.int8_linear(x, CB, SCB, threshold, bias)
    want = q4.int8_linear(x.detach().numpy(), CB.numpy(), SCB.numpy(), threshold, bias.detach().numpy())
    assert torch.equal(y.detach(), torch.from_numpy(want))
    g = torch.from_numpy(inputs.make(rng, (7, 96), "float32"))
    y.backward(g)
    w_deq = CB.double() * SCB.double()[:, None] / 127
    assert rel_err(x.grad.numpy(), (g.double() @ w_deq).numpy()) < 1e-6
    assert torch.allclose(bias.grad, g.sum(0), atol=1e-5)


def test_opcheck_and_compile(rng):
    w = torch.from_numpy(inputs.make(rng, (48, 64), "float32"))
    CB, SCB, _ = F.int8_vectorwise_quant(w)
    x = torch.from_numpy(inputs.make(rng, (5, 64), "float32")).requires_grad_()
    torch.library.opcheck(ops.int8_linear, (x, CB, SCB, 6.0, torch.from_numpy(inputs.make(rng, (48,), "float32"))))
    torch.library.opcheck(ops.int8_grad_input, (torch.from_numpy(inputs.make(rng, (5, 48), "float32")), CB, SCB))
    torch.library.opcheck(ops.int8_quantize_rows, (x.detach(), 0.0))
    compiled = torch.compile(lambda a: F.int8_linear(a, CB, SCB, 6.0).sum(), fullgraph=True)
    (gc,) = torch.autograd.grad(compiled(x), x)
    (ge,) = torch.autograd.grad(F.int8_linear(x, CB, SCB, 6.0).sum(), x)
    assert torch.allclose(gc, ge)


def test_bad_input():
    CB = torch.zeros(32, 64, dtype=torch.int8)
    SCB = torch.ones(32)
    with pytest.raises(ValueError, match="input has 63 features, the weight expects 64"):
        F.int8_linear(torch.ones(2, 63), CB, SCB)
    with pytest.raises(TypeError, match="weight must be a 2-D int8 tensor"):
        F.int8_linear(torch.ones(2, 64), CB.float(), SCB)
    with pytest.raises(ValueError, match=r"weight_scale must be float32 of shape \(32,\)"):
        F.int8_linear(torch.ones(2, 64), CB, torch.ones(31))
    with pytest.raises(ValueError, match="threshold must be >= 0"):
        F.int8_linear(torch.ones(2, 64), CB, SCB, -1.0)
    with pytest.raises(TypeError, match="got torch.int32"):
        F.int8_linear(torch.ones(2, 64, dtype=torch.int32), CB, SCB)
