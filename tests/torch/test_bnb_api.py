"""The bitsandbytes functional / autograd API q4torch provides beside its
layers (README "bitsandbytes API -> q4"): each function against an
independent definition (numpy, fp64, or bitsandbytes 0.50.2 for the code-book
builders, which are pure functions of their arguments)."""

from __future__ import annotations

import warnings

import bitsandbytes.functional as BF
import numpy as np
import pytest
import torch

import q4
import q4torch
import q4torch.functional as F
from q4torch.nn import Int8Params, Linear8bitLt


@pytest.fixture
def gen():
    return torch.Generator().manual_seed(7)


def test_has_avx512bf16_reports_the_cpu():
    assert F.has_avx512bf16() is bool(q4.cpu_features()["features"]["avx512_bf16"])


@pytest.mark.parametrize(
    "args",
    [(), (True, 4, 4), (False, 7, 8), (True, 3, 8), (True, 8, 8), (True, 2, 4)],
)
def test_create_dynamic_map_matches_bitsandbytes(args):
    assert torch.equal(F.create_dynamic_map(*args), BF.create_dynamic_map(*args))


def test_default_dynamic_map_is_the_kernel_table():
    assert torch.equal(F.create_dynamic_map(), torch.from_numpy(q4.code_table("dynamic").copy()))
    assert F.create_dynamic_map("cpu").device.type == "cpu"  # the older create_dynamic_map(device)
    with pytest.raises(ValueError, match="max_exponent_bits=9"):
        F.create_dynamic_map(True, 9, 8)


@pytest.mark.parametrize("args", [(), (True, 4), (False, 8), (True, 8, False)])
def test_create_linear_map_matches_bitsandbytes(args):
    assert torch.equal(F.create_linear_map(*args), BF.create_linear_map(*args))


@pytest.mark.parametrize("args", [(), (True, 2, 1, 4), (True, 3, 0, 4), (True, 4, 3), (False, 5, 3), (True, 1, 6)])
def test_create_fp8_map_matches_bitsandbytes(args):
    assert torch.equal(F.create_fp8_map(*args), BF.create_fp8_map(*args))


def test_create_fp8_map_checks_the_bits():
    with pytest.raises(ValueError, match="exponent_bits \\+ precision_bits"):
        F.create_fp8_map(True, 4, 4, 8)


@pytest.mark.parametrize("extra", [True, False])
def test_create_normal_map(extra):
    code = F.create_normal_map(use_extra_value=extra)
    assert torch.equal(code, BF.create_normal_map(use_extra_value=extra))
    if extra:  # its non-padding values are the NF4 table (to fp32 rounding of the quantiles)
        values = torch.cat([code[:7], torch.zeros(1), code[-8:]]).numpy()
        assert np.allclose(values, q4.code_table("nf4"), atol=1e-6)


def test_gemv_4bit_is_the_fused_matmul(gen):
    w = torch.randn(96, 128, generator=gen)
    x = torch.randn(3, 128, generator=gen)
    qw, st = F.quantize_4bit(w, quant_type="nf4", compress_statistics=True)
    before = (qw.clone(), st.absmax.clone())
    qc, sc = F._convert_weight_packed_for_cpu(qw, st)
    assert torch.equal(qw, before[0]) and torch.equal(st.absmax, before[1])  # pure: arguments untouched
    assert torch.equal(qc, qw) and qc.data_ptr() != qw.data_ptr() and sc is not st
    y = F.gemv_4bit(x, qc.t().t(), state=sc)
    assert torch.equal(y, F.matmul_4bit(x, qw, st))
    out = torch.empty(3, 96)
    assert F.gemv_4bit(x, qw, out=out, state=st) is out and torch.equal(out, y)
    with pytest.raises(ValueError, match="state cannot be None"):
        F.gemv_4bit(x, qw)


def test_int8_linear_matmul_is_exact(gen):
    a = torch.randint(-128, 128, (2, 5, 300), dtype=torch.int8, generator=gen)
    b = torch.randint(-128, 128, (7, 300), dtype=torch.int8, generator=gen)
    want = a.numpy().astype(np.int64) @ b.numpy().astype(np.int64).T
    got = F.int8_linear_matmul(a, b)
    assert got.dtype == torch.int32 and np.array_equal(got.numpy(), want)
    with pytest.raises(TypeError, match="A must be an int8 tensor, got torch.float32"):
        F.int8_linear_matmul(a.float(), b)
    with pytest.raises(ValueError, match="do not share k"):
        F.int8_linear_matmul(a, b[:, :10])


def test_int8_mm_dequant_order(gen):
    acc = torch.randint(-(2**20), 2**20, (6, 9), dtype=torch.int32, generator=gen)
    rs, cs = torch.rand(6, generator=gen) * 3, torch.rand(9, generator=gen) * 3
    bias = torch.randn(9, generator=gen)
    want = (
        (acc.numpy().astype(np.float32) * (rs.numpy()[:, None] * cs.numpy()[None, :])) * np.float32(1 / 16129)
        + bias.numpy()
    ).astype(np.float16)
    got = F.int8_mm_dequant(acc, rs, cs, bias=bias)
    assert got.dtype == torch.float16 and np.array_equal(got.numpy(), want)
    with pytest.raises(ValueError, match="A must be int32, got torch.int64"):
        F.int8_mm_dequant(acc.long(), rs, cs)


def test_int8_vectorwise_dequant_and_double_quant(gen):
    x = torch.randn(10, 40, generator=gen)
    x[:, 3] = 9.0  # an outlier column at threshold 6
    q, stats, cols = F.int8_vectorwise_quant(x, 6.0)
    deq = F.int8_vectorwise_dequant(q, stats)
    assert np.array_equal(deq.numpy(), q.numpy().astype(np.float32) * stats.numpy()[:, None] * np.float32(1 / 127))
    row, col, rs, cs, outliers = F.int8_double_quant(x, threshold=6.0)
    assert torch.equal(row, q) and torch.equal(rs, stats) and torch.equal(outliers, cols)
    xz = x.clone()
    xz[:, 3] = 0
    qt, st, _ = F.int8_vectorwise_quant(xz.t().contiguous())
    assert torch.equal(col, qt.t()) and torch.equal(cs, st)
    with pytest.raises(ValueError, match="row_stats must be None"):
        F.int8_double_quant(x, row_stats=stats)


@pytest.mark.parametrize("nested", [False, True])
def test_quant_state_from_unpacked_dict(gen, nested):
    w = torch.randn(33, 64, generator=gen)
    _, st = F.quantize_4bit(w, quant_type="fp4", compress_statistics=nested)
    assert F.QuantState.from_dict(st.as_dict(), "cpu") == st
    bad = st.as_dict()
    bad["blocksize"] = 48
    with pytest.raises(q4.QuantStateError, match="48"):
        F.QuantState.from_dict(bad, "cpu")
    bad = st.as_dict()
    bad["quant_type"] = "nf5"
    with pytest.raises(q4.QuantStateError, match="'nf5'"):
        F.QuantState.from_dict(bad, "cpu")


def test_blockwise_state_from_unpacked_dict(gen):
    x = torch.randn(5000, generator=gen)
    c, st = F.quantize_blockwise(x, code=F.create_fp8_map(True, 4, 3), blocksize=256)
    st2 = F.QuantState.from_dict(st.as_dict(), "cpu")
    assert torch.equal(F.dequantize_blockwise(c, st2), F.dequantize_blockwise(c, st))
    bad = st.as_dict()
    bad["quant_map"] = bad["quant_map"][:10]
    with pytest.raises(q4.QuantStateError, match="quant_map must be 256"):
        F.QuantState.from_dict(bad, "cpu")


def test_matmul_4bit_kn_orientation(gen):
    """A weight quantized from a [K, N] tensor: a DeprecationWarning, the
    product A . W through the fused input-gradient kernel, and its gradient
    through the forward kernel (both exact to the kernels' own results)."""
    w_kn = torch.randn(64, 96, generator=gen)
    qw, st = F.quantize_4bit(w_kn, quant_type="nf4")
    a = torch.randn(5, 64, generator=gen, requires_grad=True)
    with pytest.warns(DeprecationWarning, match="\\[K, N\\]"):
        y = F.matmul_4bit(a, qw, st)
    wd = F.dequantize_4bit(qw, st).double()
    assert y.shape == (5, 96)
    assert torch.allclose(y.double(), a.detach().double() @ wd, rtol=0, atol=1e-4)
    g = torch.randn(5, 96, generator=gen)
    y.backward(g)
    assert torch.allclose(a.grad.double(), g.double() @ wd.T, rtol=0, atol=1e-4)


def test_matmul_4bit_empty_input_joins_the_graph(gen):
    qw, st = F.quantize_4bit(torch.randn(32, 64, generator=gen), quant_type="nf4")
    a = torch.randn(0, 64, requires_grad=True)
    bias = torch.randn(32, requires_grad=True)
    y = F.matmul_4bit(a, qw, st, bias=bias)
    assert y.shape == (0, 32)
    y.sum().backward()
    assert a.grad.shape == (0, 64) and torch.equal(bias.grad, torch.zeros(32))


def test_matmul_lt_is_llm_int8(gen):
    w = torch.randn(48, 32, generator=gen)
    a = torch.randn(7, 32, generator=gen)
    cb, scb, _ = F.int8_vectorwise_quant(w.half())
    for has_fp16_weights in (True, False):
        state = q4torch.MatmulLtState(has_fp16_weights=has_fp16_weights, threshold=6.0)
        if not has_fp16_weights:
            state.CB, state.SCB = cb, scb
        y = q4torch.matmul(a, w if has_fp16_weights else cb, state=state)
        assert torch.equal(y, F.int8_linear(a, cb, scb, threshold=6.0))
    ar = a.clone().requires_grad_()
    y = q4torch.matmul(ar, w)
    y.backward(torch.ones_like(y))
    ref = a.clone().requires_grad_()
    F.int8_linear(ref, cb, scb).backward(torch.ones_like(y))
    assert torch.equal(ar.grad, ref.grad)
    empty = torch.randn(0, 32, requires_grad=True)
    assert q4torch.matmul(empty, w).shape == (0, 48)
    with pytest.raises(ValueError, match="A has 31 features, the weight expects 32"):
        q4torch.matmul(a[:, :31], w)


def test_linear8bit_force_no_igemmlt_uses_the_dequantized_weight(gen):
    w = torch.randn(24, 40, generator=gen)
    layer = Linear8bitLt(40, 24, bias=True, has_fp16_weights=False, threshold=6.0)
    layer.weight = Int8Params(w.clone(), requires_grad=False, has_fp16_weights=False)
    layer = layer.to("cpu")
    layer.state.force_no_igemmlt = True
    assert layer.state.force_no_igemmlt  # kept by the layer, not the (rebuilt) state view
    x = torch.randn(3, 40, generator=gen)
    cb, scb = layer.weight.data, layer.weight.SCB
    wd = cb.float() * (scb * (1.0 / 127.0)).unsqueeze(1)
    assert torch.equal(layer(x), torch.nn.functional.linear(x, wd, layer.bias))


def test_linear8bit_refuses_scales_for_a_float_weight():
    layer = Linear8bitLt(8, 8, bias=False, has_fp16_weights=False)
    layer.weight = torch.nn.Parameter(torch.randn_like(layer.weight))
    sd = layer.state_dict()
    sd["SCB"] = torch.ones(8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(RuntimeError, match="Loading a quantized checkpoint into non-quantized Linear8bitLt"):
            layer.load_state_dict(sd, strict=False)
