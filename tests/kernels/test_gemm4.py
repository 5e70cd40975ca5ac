"""Fused 4-bit matmuls (C ABI): against an fp64 reference, judged by the
error of dequantize + dense matmul in the same dtype; exact cases; scalar vs
AVX2; bad input."""

import numpy as np
import pytest
from q4_reference import inputs
from q4_reference.matmul import check_against_baseline, quantized_weight, rel_err

import q4

SHAPES = [
    (1, 64, 64),
    (1, 33, 128),
    (2, 96, 160),
    (7, 33, 72),
    (64, 130, 264),
    (300, 40, 136),
    (5, 7, 9),
    (3, 17, 100),
    (1, 31, 40),
]


def _state(rng, n, k, blocksize, quant_type, nested, scale=1.0):
    return quantized_weight(rng, n, k, blocksize, quant_type, nested, scale)


@pytest.mark.parametrize("dtype", inputs.DTYPES)
@pytest.mark.parametrize("quant_type, nested, blocksize", [("nf4", False, 64), ("nf4", True, 32), ("fp4", True, 128)])
def test_gemm_and_grad_match_reference(isa_all, rng, dtype, quant_type, nested, blocksize):
    for m, n, k in SHAPES:
        packed, state, w = _state(rng, n, k, blocksize, quant_type, nested)
        x = inputs.make(rng, (m, k), dtype)
        y = q4.gemm_4bit(x, packed, state)
        assert y.shape == (m, n) and y.dtype == x.dtype
        check_against_baseline(inputs.to_f32(y), inputs.to_f32(x), w.T, dtype, what=f"forward {(m, n, k)}")
        g = inputs.make(rng, (m, n), dtype)
        dx = q4.gemm_4bit_grad_input(g, packed, state)
        assert dx.shape == (m, k) and dx.dtype == g.dtype
        check_against_baseline(inputs.to_f32(dx), inputs.to_f32(g), w, dtype, what=f"grad input {(m, n, k)}")


def test_bias_is_added_in_fp32(rng):
    packed, state, w = _state(rng, 48, 64, 64, "nf4", False)
    x = inputs.make(rng, (3, 64), "float32")
    bias = inputs.make(rng, (48,), "bfloat16")
    y = q4.gemm_4bit(x, packed, state, bias=bias)
    want = x.astype(np.float64) @ w.T.astype(np.float64) + inputs.to_f32(bias)
    assert rel_err(y, want) < 1e-6


@pytest.mark.parametrize("quant_type", ["nf4", "fp4"])
def test_identity_weight_is_exact(isa_all, rng, quant_type):
    for m, k in [(1, 64), (4, 128), (13, 256)]:
        packed, absmax = q4.quantize_4bit(np.eye(k, dtype=np.float32), 64, quant_type)
        state = q4.QuantState(quant_type, 64, (k, k), "float32", absmax)
        x = inputs.make(rng, (m, k), "float32")
        assert np.array_equal(q4.gemm_4bit(x, packed, state), x)
        assert np.array_equal(q4.gemm_4bit_grad_input(x, packed, state), x)


def test_single_nonzero_weight_is_exact(isa_all, rng):
    n, k = 24, 200  # k % blocksize != 0: blocks straddle rows
    w = np.zeros((n, k), np.float32)
    w[5, 77] = -3.25
    for blocksize in (32, 64):
        packed, absmax = q4.quantize_4bit(w, blocksize, "nf4")
        state = q4.QuantState("nf4", blocksize, (n, k), "float32", absmax)
        x = inputs.make(rng, (9, k), "float32")
        y = q4.gemm_4bit(x, packed, state)
        want = np.zeros((9, n), np.float32)
        want[:, 5] = x[:, 77] * np.float32(-3.25)
        assert np.array_equal(y, want)
        g = inputs.make(rng, (9, n), "float32")
        dx = q4.gemm_4bit_grad_input(g, packed, state)
        want_dx = np.zeros((9, k), np.float32)
        want_dx[:, 77] = g[:, 5] * np.float32(-3.25)
        assert np.array_equal(dx, want_dx)


def test_cpu_paths_agree(rng):
    """scalar, AVX2 and (where present) AVX-512 results: fp32 sums of the same
    products in different orders, within a few ulp of the sum of magnitudes."""
    paths = ["scalar"] + (["avx2"] if q4.cpu_has_avx2() else []) + (["avx512"] if q4.cpu_has_avx512() else [])
    if len(paths) == 1:
        pytest.skip("processor has only the scalar path")
    packed, state, w = _state(rng, 200, 256, 64, "nf4", True)
    before = q4.cpu_isa()
    for m in (1, 3, 32):
        x = inputs.make(rng, (m, 256), "float32")
        g = inputs.make(rng, (m, 200), "float32")
        out = {}
        for isa in paths:
            q4.set_cpu_isa(isa)
            try:
                out[isa] = (q4.gemm_4bit(x, packed, state), q4.gemm_4bit_grad_input(g, packed, state))
            finally:
                q4.set_cpu_isa(before)
        for isa in paths[1:]:
            for a, b, mags in (
                (out["scalar"][0], out[isa][0], np.abs(x) @ np.abs(w.T)),
                (out["scalar"][1], out[isa][1], np.abs(g) @ np.abs(w)),
            ):
                assert np.all(np.abs(a - b) <= 8 * np.finfo(np.float32).eps * mags + 1e-30), (isa, m)


def test_threads_agree(rng):
    packed, state, _ = _state(rng, 130, 128, 64, "nf4", False)
    x = inputs.make(rng, (40, 128), "float32")
    outs = []
    try:
        for t in (1, 2, 3):
            q4.set_num_threads(t)
            outs.append(q4.gemm_4bit(x, packed, state))
    finally:
        q4.set_num_threads(0)
    assert all(np.array_equal(outs[0], o) for o in outs[1:])


@pytest.mark.parametrize(
    "call, exc, message",
    [
        (
            lambda p, s: q4.gemm_4bit(np.ones((2, 63), np.float32), p, s),
            ValueError,
            "x has 63 features, the weight expects 64",
        ),
        (lambda p, s: q4.gemm_4bit(np.ones((2, 64), np.int32), p, s), TypeError, "got dtype int32"),
        (
            lambda p, s: q4.gemm_4bit(np.ones((2, 64), np.float32), p[:-1], s),
            ValueError,
            "packed weight has 1023 bytes, a weight of 2048 elements needs 1024",
        ),
        (
            lambda p, s: q4.gemm_4bit_grad_input(np.ones((2, 31), np.float32), p, s),
            ValueError,
            "grad_out has 31 features, the weight has 32",
        ),
        (
            lambda p, s: q4.gemm_4bit(
                np.ones((2, 64), np.float32), p, q4.QuantState("nf4", 64, (32, 64), "float32", s.absmax[:-1])
            ),
            q4.QuantStateError,
            r"absmax must be float32\[32\]",
        ),
        (
            lambda p, s: q4.gemm_4bit(np.ones((2, 64), np.float32), p, s, bias=np.ones(31, np.float32)),
            ValueError,
            r"bias must have shape \(32,\)",
        ),
    ],
)
def test_bad_input(rng, call, exc, message):
    packed, state, _ = _state(rng, 32, 64, 64, "nf4", False)
    with pytest.raises(exc, match=message):
        call(packed, state)


def test_c_abi_rejects_wrong_absmax_length():
    from q4._src import native

    x = np.ones((1, 64), np.float32)
    packed = np.zeros(32 * 64 // 2, np.uint8)
    absmax = np.ones(31, np.float32)
    out = np.zeros((1, 32), np.float32)
    rc = native.lib().q4_gemm_4bit(
        x.ctypes.data,
        0,
        1,
        32,
        64,
        packed.ctypes.data,
        packed.size,
        absmax.ctypes.data,
        None,
        None,
        0,
        None,
        0.0,
        31,
        64,
        0,
        None,
        0,
        out.ctypes.data,
        0,
    )
    assert rc == 1 and "absmax has 31 elements, expected 32" in native.lib().q4_last_error().decode()
