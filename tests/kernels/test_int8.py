"""LLM.int8 kernels (through q4's numpy entry points, i.e. the C ABI) against
the int8 oracle and bitsandbytes 0.50.2.

- Row quantization: bit-exact with bitsandbytes' int8_vectorwise_quant and
  the oracle (q, row_stats bits, outlier columns).
- Linear: bit-exact with the oracle's evaluation of the documented fp32
  expression order, within the fp32 rounding bound of its fp64 value, the
  integer part recovered exactly, outlier columns exactly through fp32.
- Input gradient: bit-exact with the documented fp32 order, within the fp32
  bound of the fp64 value.
- The scalar and AVX2 paths, and any thread count, give identical bytes.
"""

import numpy as np
import pytest
import torch
from conftest import on_isa
from q4_reference import inputs
from q4_reference import int8_oracle as oracle

import q4
from q4._src import native

DTYPES = inputs.DTYPES
F32 = np.float32


def _torch(x: np.ndarray) -> torch.Tensor:
    if x.dtype == inputs.NP_DTYPES["bfloat16"]:
        return torch.from_numpy(x.view(np.uint16).copy()).view(torch.bfloat16)
    return torch.from_numpy(x.copy())


def _bnb_quantize(x: np.ndarray, threshold: float):
    import bitsandbytes.functional as bnbf

    q, stats, cols = bnbf.int8_vectorwise_quant(_torch(x), threshold=threshold)
    flags = np.zeros(x.shape[1], bool)
    if cols is not None:
        flags[cols.numpy()] = True
    return q.numpy(), stats.numpy(), flags


def _activations(rng, shape, dtype, outlier_cols=(), zero_rows=(), scale=1.5):
    """Normal activations; each column in outlier_cols holds values of
    magnitude 6..60 (both signs); rows in zero_rows are all zero."""
    x = (rng.standard_normal(shape) * scale).astype(F32)
    for c in outlier_cols:
        x[:, c] = rng.choice([-1.0, 1.0], shape[0]) * rng.uniform(6.0, 60.0, shape[0])
    x[list(zero_rows)] = 0.0
    return x.astype(inputs.NP_DTYPES[dtype])


def _weight(rng, n, k):
    w = rng.integers(-127, 128, (n, k)).astype(np.int8)
    scb = rng.uniform(0.05, 3.0, n).astype(F32)
    return w, scb


# ------------------------------------------------------------ quantize_rows

# (shape, outlier columns, zero rows)
QUANT_CASES = [
    ((1, 37), (), ()),
    ((1, 37), (5,), ()),
    ((2, 300), (0, 299), ()),
    ((7, 100), (50,), (3,)),
    ((33, 517), (1, 64, 65, 516), (0, 32)),
    ((4, 8), (), (0, 1, 2, 3)),
]


@pytest.mark.parametrize("threshold", [0.0, 6.0])
@pytest.mark.parametrize("dtype", DTYPES)
def test_quantize_rows_matches_bitsandbytes_and_oracle(isa, rng, dtype, threshold):
    for shape, cols, zero_rows in QUANT_CASES:
        x = _activations(rng, shape, dtype, cols, zero_rows)
        q, stats, flags = q4.int8_quantize_rows(x, threshold)
        ref_q, ref_stats, ref_flags = oracle.quantize_rows(inputs.to_f32(x), threshold, dtype)
        assert np.array_equal(q, ref_q), shape
        assert np.array_equal(inputs.bits(stats), inputs.bits(ref_stats)), shape
        assert np.array_equal(flags, ref_flags), shape
        bnb_q, bnb_stats, bnb_flags = _bnb_quantize(x, threshold)
        assert np.array_equal(q, bnb_q), shape
        assert np.array_equal(inputs.bits(stats), inputs.bits(bnb_stats)), shape
        assert np.array_equal(flags, bnb_flags), shape
        if threshold > 0 and cols:
            assert set(cols) <= set(np.flatnonzero(flags))


def test_quantize_rows_outlier_rows_and_ties(isa):
    """A row made only of outliers has row_stats 0 and quantizes to 0; values
    at exactly x.5 after scaling round half to even; threshold is inclusive."""
    x = np.array([[10.0, -7.0, 6.0, 8.0], [0.0, 1.0, 2.0, 4.0], [1.0, 3.0, -5.0, 0.5]], F32)
    q, stats, flags = q4.int8_quantize_rows(x, 6.0)
    assert stats.tolist() == [0.0, 4.0, 5.0] and flags.tolist() == [True, True, True, True]
    assert not q.any()
    # row [0, 1, 2, 4]: mult = fp32(1/4) * 127 = 31.75; 2 * 31.75 = 63.5 -> 64 (even), 1 -> 31.75 -> 32
    q, stats, _ = q4.int8_quantize_rows(x[1:2].copy(), 0.0)
    assert q.tolist() == [[0, 32, 64, 127]] and stats.tolist() == [4.0]
    for ref_x in (x, x[1:]):
        bnb_q, bnb_stats, _ = _bnb_quantize(ref_x, 6.0)
        q, stats, _ = q4.int8_quantize_rows(ref_x, 6.0)
        assert np.array_equal(q, bnb_q) and np.array_equal(stats, bnb_stats)


@pytest.mark.parametrize("dtype", DTYPES)
def test_quantize_rows_threshold_in_input_dtype(isa, rng, dtype):
    """|x| is compared with the threshold rounded to x's dtype, as torch does
    (fp16 6.0009 -> 6.0, bf16 6.01 -> 6.0); a threshold that rounds to 0
    makes every element an outlier."""
    for threshold in (6.0009, 6.01, 5.999, 1e-10):
        x = _activations(rng, (5, 24), dtype, scale=4.0)
        x[1, 3] = 6.0
        x[2, 7] = -6.0
        q, stats, flags = q4.int8_quantize_rows(x, threshold)
        ref_q, ref_stats, ref_flags = oracle.quantize_rows(inputs.to_f32(x), threshold, dtype)
        bnb_q, bnb_stats, bnb_flags = _bnb_quantize(x, threshold)
        for ours, ref, bnb in ((q, ref_q, bnb_q), (stats, ref_stats, bnb_stats), (flags, ref_flags, bnb_flags)):
            assert np.array_equal(ours, ref) and np.array_equal(ours, bnb), threshold


@pytest.mark.parametrize("dtype", DTYPES)
def test_quantize_rows_special_values(isa, rng, dtype):
    """Denormals, huge values, Inf and NaN follow the definition (oracle)."""
    for threshold in (0.0, 6.0):
        x = inputs.make(rng, (9, 131), dtype, "special")
        x[2] = inputs.make(rng, (131,), dtype, "tiny")  # row_stats subnormal (fp32): mult overflows to inf
        with np.errstate(over="ignore"):
            x[4, 7] = np.inf
            x[5, 9] = np.nan
        q, stats, flags = q4.int8_quantize_rows(x, threshold)
        ref_q, ref_stats, ref_flags = oracle.quantize_rows(inputs.to_f32(x), threshold, dtype)
        assert np.array_equal(q, ref_q)
        assert np.array_equal(inputs.bits(stats), inputs.bits(ref_stats))
        assert np.array_equal(flags, ref_flags)


# ------------------------------------------------------------ linear

LINEAR_KN = [(37, 13), (300, 77), (1001, 9)]


@pytest.mark.parametrize("threshold", [0.0, 6.0])
@pytest.mark.parametrize("k,n", LINEAR_KN, ids=[f"k{k}-n{n}" for k, n in LINEAR_KN])
@pytest.mark.parametrize("m", [1, 2, 7, 64, 300])
def test_linear_matches_oracle(isa_all, rng, m, k, n, threshold):
    x = _activations(rng, (m, k), "float32", outlier_cols=(3, k - 1))
    w, scb = _weight(rng, n, k)
    bias = rng.standard_normal(n).astype(F32)
    y = q4.int8_linear(x, w, scb, threshold=threshold, bias=bias)
    assert y.dtype == F32 and y.shape == (m, n)
    assert np.array_equal(inputs.bits(y), inputs.bits(oracle.linear_f32(x, w, scb, threshold, bias)))
    exact, terms = oracle.linear_f64(x, w, scb, threshold, bias)
    n_cols = int(oracle.quantize_rows(x, threshold)[2].sum())
    assert np.all(np.abs(y - exact) <= oracle.linear_error_bound(terms, n_cols))


def test_linear_integer_part_exact(isa_all, rng):
    """One nonzero weight per row: acc = q[m, perm[n]] * CB[n, perm[n]], small
    enough (|acc| <= 127^2) that the fp32 scaling cannot hide an error of 1."""
    m, k, n = 7, 45, 41
    x = _activations(rng, (m, k), "float32")
    perm = rng.integers(0, k, n)
    w = np.zeros((n, k), np.int8)
    w[np.arange(n), perm] = rng.integers(-127, 128, n)
    w[0, perm[0]] = -128  # the int8 minimum is accepted too
    scb = rng.uniform(0.5, 2.0, n).astype(F32)
    q, stats, _ = oracle.quantize_rows(x)
    acc = oracle.int_dot(q, w)
    y = q4.int8_linear(x, w, scb)
    recovered = np.rint(y.astype(np.float64) * 16129.0 / (stats[:, None].astype(np.float64) * scb[None, :]))
    assert np.array_equal(recovered.astype(np.int64), acc)
    assert np.array_equal(inputs.bits(y), inputs.bits(oracle.linear_f32(x, w, scb)))
    # all-int8-range weights and a short k: still recoverable (|acc| <= 127 * 128 * 8)
    w8, scb8 = _weight(rng, 19, 8)
    x8 = _activations(rng, (5, 8), "float32")
    q8, stats8, _ = oracle.quantize_rows(x8)
    y8 = q4.int8_linear(x8, w8, scb8)
    rec8 = np.rint(y8.astype(np.float64) * 16129.0 / (stats8[:, None].astype(np.float64) * scb8[None, :]))
    assert np.array_equal(rec8.astype(np.int64), oracle.int_dot(q8, w8))


@pytest.mark.parametrize("m", [1, 5])
def test_linear_outlier_column_exact(isa_all, rng, m):
    """A column of large inputs goes through fp32 unquantized: with weights
    zero outside that column the output is exactly x[:, c] * wd[n, c]."""
    k, n, c = 70, 33, 17
    x = _activations(rng, (m, k), "float32", outlier_cols=(c,))
    w = np.zeros((n, k), np.int8)
    w[:, c] = rng.integers(-127, 128, n)
    scb = rng.uniform(0.5, 2.0, n).astype(F32)
    wd = (w[:, c].astype(F32) * scb) * oracle.INV127
    y = q4.int8_linear(x, w, scb, threshold=6.0)
    assert np.array_equal(inputs.bits(y), inputs.bits(F32(0) + x[:, c : c + 1] * wd[None, :]))
    exact = x[:, c : c + 1].astype(np.float64) * oracle.dequantize_weight_f64(w[:, c : c + 1], scb).T
    assert np.all(np.abs(y - exact) <= 4 * oracle.U32 * np.abs(exact))
    # threshold 0: the same column is quantized like every other one
    y0 = q4.int8_linear(x, w, scb, threshold=0.0)
    assert np.array_equal(inputs.bits(y0), inputs.bits(oracle.linear_f32(x, w, scb, 0.0)))


def test_linear_outliers_reduce_error(rng):
    """The point of the outlier split: against the unquantized product
    x @ W^T, threshold 6 is more accurate than threshold 0 when a few input
    columns are large."""
    m, k, n = 16, 256, 64
    x = _activations(rng, (m, k), "float32", outlier_cols=(10, 200), scale=1.0)
    w, scb = _weight(rng, n, k)
    exact = x.astype(np.float64) @ oracle.dequantize_weight_f64(w, scb).T
    err0 = np.abs(q4.int8_linear(x, w, scb, threshold=0.0) - exact).max()
    err6 = np.abs(q4.int8_linear(x, w, scb, threshold=6.0) - exact).max()
    assert err6 < 0.5 * err0


@pytest.mark.parametrize("bias_dtype", [None, *DTYPES])
@pytest.mark.parametrize("out_dtype", DTYPES)
@pytest.mark.parametrize("x_dtype", DTYPES)
def test_linear_dtypes(rng, x_dtype, out_dtype, bias_dtype):
    m, k, n = 6, 133, 21
    x = _activations(rng, (m, k), x_dtype, outlier_cols=(0, 77))
    w, scb = _weight(rng, n, k)
    bias = None if bias_dtype is None else rng.standard_normal(n).astype(inputs.NP_DTYPES[bias_dtype])
    for threshold in (0.0, 6.0):
        y = q4.int8_linear(x, w, scb, threshold=threshold, bias=bias, out_dtype=out_dtype)
        ref32 = oracle.linear_f32(
            inputs.to_f32(x), w, scb, threshold, None if bias is None else inputs.to_f32(bias), x_dtype
        )
        assert np.array_equal(inputs.bits(y), inputs.bits(inputs.to_dtype(ref32, out_dtype)))
    if out_dtype == x_dtype:
        assert q4.int8_linear(x, w, scb).dtype == x.dtype  # default output dtype: x's


# ------------------------------------------------------------ grad input

GRAD_NK = [(13, 37), (300, 77), (1000, 23)]


def grad_kernel(isa: str, m: int) -> str:
    """The int8 input-gradient kernel a level runs for m rows (the AVX-512
    strip kernel from 48 rows; int8.cc's loops below)."""
    if isa in ("avx512", "avx512_bf16", "amx") and m >= 48:
        return "avx512.int8_grad"
    return "scalar.int8_grad" if isa == "scalar" else "avx2.int8_grad"


@pytest.mark.parametrize("n,k", GRAD_NK, ids=[f"n{n}-k{k}" for n, k in GRAD_NK])
@pytest.mark.parametrize("m", [1, 7, 64, 300])
def test_grad_input_matches_oracle(isa_all, rng, m, n, k):
    dy = rng.standard_normal((m, n)).astype(F32)
    w, scb = _weight(rng, n, k)
    dx = q4.int8_grad_input(dy, w, scb)
    assert q4.cpu_features()["last_kernel"]["int8_grad_input"] == grad_kernel(isa_all, m)
    assert dx.dtype == F32 and dx.shape == (m, k)
    assert np.array_equal(inputs.bits(dx), inputs.bits(oracle.grad_input_f32(dy, w, scb)))
    exact = oracle.grad_input_f64(dy, w, scb)
    assert np.all(np.abs(dx - exact) <= oracle.grad_input_error_bound(dy, w, scb))


@pytest.mark.parametrize("out_dtype", DTYPES)
@pytest.mark.parametrize("dy_dtype", DTYPES)
@pytest.mark.parametrize("m", [5, 61])
def test_grad_input_dtypes(rng, dy_dtype, out_dtype, m):
    dy = rng.standard_normal((m, 40)).astype(inputs.NP_DTYPES[dy_dtype])
    w, scb = _weight(rng, 40, 29)
    dx = q4.int8_grad_input(dy, w, scb, out_dtype=out_dtype)
    ref32 = oracle.grad_input_f32(inputs.to_f32(dy), w, scb)
    assert np.array_equal(inputs.bits(dx), inputs.bits(inputs.to_dtype(ref32, out_dtype)))


# ------------------------------------------------------------ paths and threads


def _all_ops(rng):
    x = _activations(rng, (7, 1001), "bfloat16", outlier_cols=(2, 640))
    w, scb = _weight(rng, 77, 1001)
    dy = rng.standard_normal((7, 77)).astype(F32)
    out = []
    for threshold in (0.0, 6.0):
        out += list(q4.int8_quantize_rows(x, threshold))
        out.append(q4.int8_linear(x, w, scb, threshold=threshold, out_dtype="float32"))
    out.append(q4.int8_grad_input(dy, w, scb))
    return out


# the int8_linear dot-product kernel each level runs (cpu_features()["kernels"])
INT8_KERNEL = {
    "scalar": "scalar.int8_dots",
    "avx2": "avx2.int8_dots",
    "avx512": "avx2.int8_dots",
    "avx512_bf16": "avx512_bf16.int8_dots",
    "amx": "avx512_bf16.int8_dots",
}


def test_every_level_agrees_bit_for_bit():
    """Every CPU level the processor has gives the scalar path's bytes (the
    integer sums are exact, the fp32 epilogue the same), and runs its own kernel."""
    levels = [name for code, name in native.isa_names().items() if code > 0 and native.lib().q4_cpu_has_isa(code)]
    assert levels, "the processor has no SIMD level to compare with the scalar path"
    before = q4.cpu_isa()
    try:
        results = {}
        for isa in ("scalar", *levels):
            q4.set_cpu_isa(isa)
            results[isa] = _all_ops(np.random.default_rng(7))
            assert q4.cpu_features()["last_kernel"]["int8_linear"] == INT8_KERNEL[isa]
    finally:
        q4.set_cpu_isa(before)
    for isa in levels:
        for a, b in zip(results["scalar"], results[isa], strict=True):
            assert a.dtype == b.dtype and np.array_equal(inputs.bits(a), inputs.bits(b)), isa


@pytest.mark.parametrize("m", [2, 64])
@pytest.mark.parametrize("wval", [127, -128])
def test_linear_at_the_int32_limit(isa_all, wval, m):
    """k = the largest reduction length (2^31 / (128 * 127) - 1) with every
    product at its extreme: the sums reach +-2^31 * (1 - eps) and must come back
    exactly (the VNNI kernels' unsigned-offset sums wrap modulo 2^32 in between;
    m = 64 takes the block kernel on avx512_bf16)."""
    k = (1 << 31) // (128 * 127) - 1
    x = np.full((m, k), 3.0, F32)
    x[1::2] = -3.0
    w = np.full((3, k), wval, np.int8)
    scb = np.array([1.0, 2.0, 0.5], F32)
    y = q4.int8_linear(x, w, scb)
    assert np.array_equal(inputs.bits(y), inputs.bits(oracle.linear_f32(x, w, scb)))
    with pytest.raises(ValueError, match=f"k = {k + 1} overflows"):
        q4.int8_linear(np.ones((1, k + 1), F32), np.ones((1, k + 1), np.int8), scb[:1])


def test_thread_count_does_not_change_results():
    before = q4.num_threads()
    try:
        q4.set_num_threads(1)
        one = _all_ops(np.random.default_rng(8))
        q4.set_num_threads(3)
        three = _all_ops(np.random.default_rng(8))
    finally:
        q4.set_num_threads(before)
    for a, b in zip(one, three, strict=True):
        assert np.array_equal(inputs.bits(a), inputs.bits(b))


# ------------------------------------------------------------ bad input


def test_bad_input_raises_with_value():
    x = np.ones((2, 5), F32)
    w = np.ones((3, 5), np.int8)
    scb = np.ones(3, F32)
    with pytest.raises(ValueError, match="6"):
        q4.int8_linear(x, np.ones((3, 6), np.int8), scb)  # K mismatch
    with pytest.raises(TypeError, match="int32"):
        q4.int8_linear(x.astype(np.int32), w, scb)
    with pytest.raises(TypeError, match="float32"):
        q4.int8_linear(x, w.astype(F32), scb)
    with pytest.raises(ValueError, match=r"\(4,\)"):
        q4.int8_linear(x, w, np.ones(4, F32))
    with pytest.raises(q4.KernelError, match="-1.5"):
        q4.int8_linear(x, w, scb, threshold=-1.5)
    with pytest.raises(q4.KernelError, match="-2"):
        q4.int8_quantize_rows(x, -2.0)
    with pytest.raises(TypeError, match="float64"):
        q4.int8_quantize_rows(x.astype(np.float64))
    with pytest.raises(ValueError, match="4"):
        q4.int8_grad_input(np.ones((2, 4), F32), w, scb)  # grad_out features != n
    with pytest.raises(ValueError, match=r"\(2,\)"):
        q4.int8_grad_input(np.ones((2, 3), F32), w, np.ones(2, F32))


def test_flush_denormal_mode_does_not_change_results(rng):
    """Denormal values follow IEEE rules even when the calling thread flushes
    denormals (torch.set_flush_denormal, or XLA's threads)."""
    x = (rng.standard_normal((3, 40)) * 1e-39).astype(F32)  # subnormal row_stats
    w, _ = _weight(rng, 9, 40)
    tiny_scb = np.full(9, 1e-40, F32)  # SCB * 1/127 and the scaled outputs are subnormal
    dy = rng.standard_normal((3, 9)).astype(F32)
    xs = _activations(rng, (3, 40), "float32", outlier_cols=(4,))

    def run():
        return [
            *q4.int8_quantize_rows(x),
            q4.int8_linear(xs, w, tiny_scb, threshold=6.0),
            q4.int8_grad_input(dy, w, tiny_scb),
        ]

    want = run()
    assert want[-1].any() and np.all(np.abs(want[-1]) < np.finfo(F32).tiny)
    assert torch.set_flush_denormal(True)
    try:
        got = run()
    finally:
        torch.set_flush_denormal(False)
    for a, b in zip(want, got, strict=True):
        assert np.array_equal(inputs.bits(a), inputs.bits(b))
    assert np.array_equal(inputs.bits(want[-1]), inputs.bits(oracle.grad_input_f32(dy, w, tiny_scb)))


# the block kernels (int8_gemm) and the x rows each level runs them from
BLOCK_KERNELS = {"avx512_bf16": ("avx512_bf16.int8_gemm", 64), "amx": ("amx.int8_gemm", 16)}


def _block_kernel_and_scalar(x, w, scb, threshold, bias, out_dtype, level="avx512_bf16"):
    """int8_linear on `level` (checked to run its block kernel; not run where
    the processor lacks the level) and on the scalar path."""
    with on_isa(level):
        y = q4.int8_linear(x, w, scb, threshold=threshold, bias=bias, out_dtype=out_dtype)
        assert q4.cpu_features()["last_kernel"]["int8_linear"] == BLOCK_KERNELS[level][0]
    with on_isa("scalar"):
        y0 = q4.int8_linear(x, w, scb, threshold=threshold, bias=bias, out_dtype=out_dtype)
    return y, y0


@pytest.mark.parametrize("level", list(BLOCK_KERNELS))
@pytest.mark.parametrize("out_dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("threshold", [0.0, 6.0])
def test_block_kernel_special_values_match_scalar(rng, threshold, out_dtype, level):
    """Inf, NaN, huge and subnormal rows through the block kernel's vectorized
    epilogue (NaN, overflow and rounding in every output dtype): the same
    bytes as the scalar path."""
    m, k, n = 70, 131, 45
    x = inputs.make(rng, (m, k), "float32", "special")
    x[2] = inputs.make(rng, (k,), "float32", "tiny")
    x[4, 7] = np.inf
    x[5, 9] = np.nan
    x[6] = rng.standard_normal(k).astype(F32) * np.float32(1e30)  # outputs past the fp16 / bf16 range
    w, scb = _weight(rng, n, k)
    bias = rng.standard_normal(n).astype(F32)
    with np.errstate(all="ignore"):
        y, y0 = _block_kernel_and_scalar(x, w, scb, threshold, bias, out_dtype, level)
    assert np.isnan(inputs.to_f32(y0)).any()
    assert np.array_equal(inputs.bits(y), inputs.bits(y0))


# (m, k, n); the amx kernel reads W in place (k % 64 == 0) but for its last
# rows past a multiple of 32, from a zero-padded copy otherwise; x panels of 16
# rows, in pairs
BLOCK_SHAPES = [
    (64, 4, 1),
    (100, 1001, 77),
    (300, 515, 130),
    (1030, 130, 70),
    (16, 128, 70),  # amx: 64 rows in place, 6 padded; one x panel
    (33, 256, 64),  # amx: every row in place; a partial third panel
    (70, 64, 200),  # amx: 192 rows in place (two blocks of 128 rows), 8 padded
]


@pytest.mark.parametrize("level", list(BLOCK_KERNELS))
@pytest.mark.parametrize("out_dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("threshold", [0.0, 6.0])
@pytest.mark.parametrize("m,k,n", BLOCK_SHAPES)
def test_block_kernel_matches_scalar(rng, m, k, n, threshold, out_dtype, level):
    """From BLOCK_KERNELS' row count on, a level runs its block kernel
    (int8_gemm: avx512_bf16 with lanes = output columns and packed weight
    panels, amx with W rows as tiles; x rows in blocks of 512; each block of
    columns finished by the thread that summed it, with the vectorized
    epilogue): the same bytes as the scalar path and as the oracle."""
    if m < BLOCK_KERNELS[level][1]:
        m = BLOCK_KERNELS[level][1]  # the level's smallest block-kernel call
    x = _activations(rng, (m, k), "bfloat16", outlier_cols=(0, k - 1) if k > 1 else ())
    w, scb = _weight(rng, n, k)
    w[0, :] = -128
    bias = rng.standard_normal(n).astype(F32)
    y, y0 = _block_kernel_and_scalar(x, w, scb, threshold, bias, out_dtype, level)
    assert np.array_equal(inputs.bits(y), inputs.bits(y0))
    if out_dtype == "float32":
        ref = oracle.linear_f32(inputs.to_f32(x), w, scb, threshold, bias)
        assert np.array_equal(inputs.bits(y), inputs.bits(ref))
