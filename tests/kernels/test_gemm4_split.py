"""The fp32 forward and input gradient on the AMX tile unit (amx.gemm4_split,
amx.grad4_split, kernels/cpu/x86/amx/gemm4.cc): fp32 / fp16 x from SPLIT_MIN_M
rows, fp32 dY from SPLIT_GRAD_MIN_M rows, each input and W element split
exactly into three bf16 parts and the six larger part products summed on
TDPBF16PS, through q4's numpy API.

It keeps the fp32 contract: checked against the fp64 oracle within the fp32
accumulation bound of a sum five terms longer (the three part products left
out are below 2^-22 + 2^-31 of each product) plus what the row scaling drops
(each x / dY row is scaled by a power of two to a largest magnitude in [1, 2)
and its elements below 2^-60 after that are dropped: at most 2^-60 max|row|
sum|w| per output), exactly where the answer is exact (the split loses no
bit of x or of W, and the scaling none of a row), and bit for bit against the
avx512 level's fp32 kernel wherever it declines the call (a NaN or an
infinity in x / dY, or an extreme block scale: the tile unit reads denormals
as zero, which the row scaling keeps away from every product that matters,
but not from a weight's).
"""

from __future__ import annotations

import numpy as np
import pytest
from conftest import on_isa
from q4_reference.bf16_gemm import FORMATS, check_thread_counts_agree, last_kernels
from q4_reference.matmul import check_accumulation_bound
from q4_reference.matmul import quantized_weight as make_weight

import q4

ISA = "amx"
pytestmark = pytest.mark.usefixtures("module_isa")

SPLIT_MIN_M = 8  # kSplitMinM in kernels/cpu/x86/amx/gemm4.cc
SPLIT_GRAD_MIN_M = 64  # kSplitGradMinM
SPLIT_MIN_N = 512  # test shapes: as wide as a layer where the split pays (the kernel runs at any width)
SPLIT_GRAD_MIN_K = 512
SPLIT, FALLBACK = "amx.gemm4_split", "avx512.gemm4"
GRAD_SPLIT, GRAD_FALLBACK = "amx.grad4_split", "avx512.grad4"
TINY = 2.0**-126  # the tile unit flushes partial products below it
DROPPED = 2.0**-60  # of a row's largest magnitude: the scaled row's elements below it are dropped


def dropped_bound(a, w_abs_sum):
    """What the row scaling may drop: 2^-60 max|a_row| sum|w| for each output."""
    return DROPPED * np.abs(a.astype(np.float64)).max(axis=1, keepdims=True) * w_abs_sum[None, :]


def fp32_input(rng, shape):
    return rng.standard_normal(shape).astype(np.float32)


def forward(x, packed, state, w32, out_dtype="float32", bias=None, what="", kernel=SPLIT):
    y = q4.gemm_4bit(x, packed, state, bias=bias, out_dtype=out_dtype)
    assert last_kernels()["gemm_4bit"] == kernel, what
    w64 = w32.astype(np.float64)
    extra = dropped_bound(x, np.abs(w64).sum(axis=1)) if kernel == SPLIT else 0.0
    check_accumulation_bound(y, x.astype(np.float64), w64.T, x.shape[1] + 5, out_dtype, bias, TINY, what, extra)
    return y


def avx512_bytes(x, packed, state, **kw):
    with on_isa("avx512"):
        y = q4.gemm_4bit(x, packed, state, **kw)
        assert last_kernels()["gemm_4bit"] == FALLBACK
    return y


@pytest.mark.parametrize("quant_type, nested, blocksize", FORMATS)
@pytest.mark.parametrize("out_dtype", ["float32", "bfloat16", "float16"])
def test_forward_matches_oracle(rng, quant_type, nested, blocksize, out_dtype):
    n, k = SPLIT_MIN_N + 8, 384
    packed, state, w32 = make_weight(rng, n, k, blocksize, quant_type, nested)
    bias = rng.standard_normal(n).astype(np.float32)
    for m in (SPLIT_MIN_M, 16, 17, 40):
        x = rng.standard_normal((m, k)).astype(np.float32)
        forward(x, packed, state, w32, out_dtype, bias, what=f"m={m} {quant_type} bs{blocksize} {out_dtype}")


def test_error_no_larger_than_the_fp32_kernels(rng):
    """Norm-wise error against the fp64 product at most the avx512 fp32
    kernel's (the worst-case bound above is far looser than either): a dropped
    part product (mid . mid is 2^-16 of a product) would show here."""
    n, k, m = SPLIT_MIN_N, 2048, 32
    packed, state, w32 = make_weight(rng, n, k, 64, "nf4", True)
    x = rng.standard_normal((m, k)).astype(np.float32)
    ref = x.astype(np.float64) @ w32.astype(np.float64).T
    y = q4.gemm_4bit(x, packed, state, out_dtype="float32")
    assert last_kernels()["gemm_4bit"] == SPLIT
    err = np.linalg.norm(y - ref) / np.linalg.norm(ref)
    err_fp32 = np.linalg.norm(avx512_bytes(x, packed, state, out_dtype="float32") - ref) / np.linalg.norm(ref)
    assert err <= err_fp32, (err, err_fp32)


def test_fewer_rows_take_the_fp32_kernel(rng):
    packed, state, w32 = make_weight(rng, SPLIT_MIN_N, 128, 64, "nf4", True)
    x = rng.standard_normal((SPLIT_MIN_M - 1, 128)).astype(np.float32)
    forward(x, packed, state, w32, kernel=FALLBACK, what="m below the split path")
    forward(np.vstack([x, x]), packed, state, w32, what="m at the split path")


def test_output_columns_do_not_depend_on_the_layer_width(rng):
    """Each output is the same bytes whether the call computes it alone, in a
    column shard (a column-parallel layer: W's rows split over devices) or
    with the whole layer; likewise each dX column of the gradient in a shard
    of W's columns."""
    n, k, m = 520, 640, 40
    packed, state, w32 = make_weight(rng, n, k, 64, "nf4", False)
    x = rng.standard_normal((m, k)).astype(np.float32)
    whole = q4.gemm_4bit(x, packed, state, out_dtype="float32")
    for r0, r1 in ((0, 65), (65, 130), (512, 520), (100, 101)):
        sp, sa = q4.quantize_4bit(w32[r0:r1], 64, "nf4")
        assert np.array_equal(sp.reshape(-1), packed.reshape(-1)[r0 * k // 2 : r1 * k // 2])  # the shard's own bytes
        part = q4.gemm_4bit(x, sp, q4.QuantState("nf4", 64, (r1 - r0, k), "float32", sa), out_dtype="float32")
        assert last_kernels()["gemm_4bit"] == SPLIT
        assert part.tobytes() == whole[:, r0:r1].copy().tobytes(), (r0, r1)
    g = rng.standard_normal((SPLIT_GRAD_MIN_M, n)).astype(np.float32)
    whole = q4.gemm_4bit_grad_input(g, packed, state, out_dtype="float32")
    for c0, c1 in ((0, 64), (64, 320), (576, 640)):
        sp, sa = q4.quantize_4bit(np.ascontiguousarray(w32[:, c0:c1]), 64, "nf4")
        part = q4.gemm_4bit_grad_input(
            g, sp, q4.QuantState("nf4", 64, (n, c1 - c0), "float32", sa), out_dtype="float32"
        )
        assert last_kernels()["gemm_4bit_grad_input"] == GRAD_SPLIT
        assert part.tobytes() == whole[:, c0:c1].copy().tobytes(), (c0, c1)


@pytest.mark.parametrize(
    "m, n, k",
    [
        (130, 512, 4096),  # x blocks of 4 panels: three blocks, C carried in memory between segments
        (33, 523, 192),  # partial last W tile; k % 128 != 0: a 64-column last segment
        (16, 513, 64),  # a last W tile of one row, one segment step
    ],
)
def test_blocking(rng, m, n, k):
    packed, state, w32 = make_weight(rng, n, k, 64, "nf4", True)
    x = rng.standard_normal((m, k)).astype(np.float32)
    forward(x, packed, state, w32, bias=rng.standard_normal(n).astype(np.float32), what=f"{(m, n, k)}")


def test_fp16_input(rng):
    packed, state, w32 = make_weight(rng, SPLIT_MIN_N, 256, 64, "fp4", False)
    x = rng.standard_normal((20, 256)).astype(np.float16)
    forward(x, packed, state, w32, "float16", what="fp16 x")


def spread_rows(rng, m, k):
    """fp32 rows whose magnitudes span 2^57 (within the 2^60 the row scaling
    keeps), full 24-bit mantissas, around a row magnitude from 2^-80 to 2^80."""
    exps = rng.integers(-28, 28, (m, k)) + rng.integers(-80, 80, (m, 1))
    mant = rng.uniform(1.0, 2.0, (m, k)) * rng.choice([-1.0, 1.0], (m, k))
    return (mant * 2.0**exps).astype(np.float32)


def test_split_loses_no_bit(rng):
    """The parts are exact: one-hot x rows give W's columns exactly (every W
    value, whose mantissa fills all 24 bits, rebuilt from its three parts), and
    W = identity gives x exactly (random fp32 x over a wide range)."""
    for quant_type, nested, blocksize in FORMATS:
        n, k = SPLIT_MIN_N, 256
        packed, state, w32 = make_weight(rng, n, k, blocksize, quant_type, nested, scale=3.7)
        cols = rng.choice(k, size=24, replace=False)
        x = np.zeros((24, k), np.float32)
        x[np.arange(24), cols] = 1.0
        y = q4.gemm_4bit(x, packed, state, out_dtype="float32")
        assert last_kernels()["gemm_4bit"] == SPLIT
        assert np.array_equal(y, w32[:, cols].T), (quant_type, nested, blocksize)
    k = SPLIT_MIN_N
    for quant_type in ("nf4", "fp4"):
        packed, absmax = q4.quantize_4bit(np.eye(k, dtype=np.float32), 64, quant_type)
        state = q4.QuantState(quant_type, 64, (k, k), "float32", absmax)
        x = spread_rows(rng, 33, k)
        y = q4.gemm_4bit(x, packed, state, out_dtype="float32")
        assert last_kernels()["gemm_4bit"] == SPLIT
        assert np.array_equal(y, x), quant_type


@pytest.mark.parametrize("value", [np.nan, np.inf, -np.inf])
def test_x_not_finite_takes_the_fp32_kernel(rng, value):
    """A NaN or an infinity anywhere in x: the whole call is the avx512
    level's, byte for byte (the non-finite row's outputs, and only its)."""
    n, k = SPLIT_MIN_N, 256
    packed, state, _ = make_weight(rng, n, k, 64, "nf4", True)
    x = rng.standard_normal((16, k)).astype(np.float32)
    x[5, 77] = value
    bias = rng.standard_normal(n).astype(np.float32)
    y = q4.gemm_4bit(x, packed, state, bias=bias, out_dtype="float32")
    assert last_kernels()["gemm_4bit"] == FALLBACK
    assert y.tobytes() == avx512_bytes(x, packed, state, bias=bias, out_dtype="float32").tobytes()
    assert np.isnan(y[5]).any() or np.isinf(y[5]).any()
    assert np.isfinite(np.delete(y, 5, axis=0)).all()


EXTREMES = [2.0**-149, 1e-40, 1e-35, 2.0**-61, 2.0**-59, -(2.0**59), 2.0**61, 2.0**100, 1e36, 0.0]


@pytest.mark.parametrize("value", EXTREMES)
def test_x_extremes_stay_on_the_split(rng, value):
    """One x element anywhere from the smallest denormal to near the fp32
    maximum (GELU's far tail gives ~1e-35): the split computes the call within
    its bound, the rows without it exactly as without it."""
    n, k = SPLIT_MIN_N, 256
    packed, state, w32 = make_weight(rng, n, k, 64, "nf4", True)
    x = rng.standard_normal((16, k)).astype(np.float32)
    bias = rng.standard_normal(n).astype(np.float32)
    plain = q4.gemm_4bit(x, packed, state, bias=bias, out_dtype="float32")
    x[5, 77] = value
    y = forward(x, packed, state, w32, bias=bias, what=f"x element {value}")
    assert np.array_equal(np.delete(y, 5, axis=0), np.delete(plain, 5, axis=0))


@pytest.mark.parametrize("power", [-140, -100, -60, 60, 100])
def test_row_scale_changes_no_bit(rng, power):
    """x * 2^p gives y * 2^p exactly: each row computed at its own scale and
    scaled back with one rounding (rows of denormals -- p = -140 -- round once
    into the denormal result, and lose only what their own rounding lost)."""
    n, k, m = SPLIT_MIN_N, 384, 24
    packed, state, w32 = make_weight(rng, n, k, 64, "fp4", False)
    x = rng.standard_normal((m, k)).astype(np.float32)
    xs = np.ldexp(x, power).astype(np.float32)
    base = np.ldexp(xs.astype(np.float64), -power).astype(np.float32)  # x as xs holds it (== x unless denormal)
    y = q4.gemm_4bit(base, packed, state, out_dtype="float32")
    ys = forward(xs, packed, state, w32, what=f"x * 2^{power}")
    assert np.array_equal(ys, np.ldexp(y.astype(np.float64), power).astype(np.float32))
    if power > -140:
        assert np.array_equal(base, x)


@pytest.mark.parametrize("scale, split", [(2.0**40, False), (2.0**-40, False), (2.0**20, True), (2.0**-20, True)])
def test_scales_out_of_range_take_the_fp32_kernel(rng, scale, split):
    """A block scale outside [2^-32, 2^32] in the last W tile (found after the
    other tiles ran): the avx512 level's bytes for the whole output."""
    n, k = SPLIT_MIN_N + 8, 192
    packed, state, w32 = make_weight(rng, n, k, 64, "nf4", False)
    absmax = np.array(state.absmax, copy=True)
    absmax[-1] = scale
    state = q4.QuantState("nf4", 64, (n, k), "float32", absmax)
    x = rng.standard_normal((24, k)).astype(np.float32)
    y = q4.gemm_4bit(x, packed, state, out_dtype="float32")
    if split:
        assert last_kernels()["gemm_4bit"] == SPLIT
    else:
        assert last_kernels()["gemm_4bit"] == FALLBACK
        assert y.tobytes() == avx512_bytes(x, packed, state, out_dtype="float32").tobytes()


def test_zero_scales_are_in_range(rng):
    """All-zero blocks (scale 0) keep the split path: zero is exact."""
    w = rng.standard_normal((SPLIT_MIN_N, 128)).astype(np.float32)
    w[:32] = 0.0
    packed, absmax = q4.quantize_4bit(w, 64, "nf4")
    state = q4.QuantState("nf4", 64, (SPLIT_MIN_N, 128), "float32", absmax)
    x = rng.standard_normal((16, 128)).astype(np.float32)
    y = q4.gemm_4bit(x, packed, state, out_dtype="float32")
    assert last_kernels()["gemm_4bit"] == SPLIT
    assert np.array_equal(y[:, :32], np.zeros((16, 32), np.float32))


@pytest.mark.parametrize("m", [8, 40, 64, 130, 200])
def test_bit_identical_across_thread_counts(rng, m):
    """Forward and gradient (the split one from SPLIT_GRAD_MIN_M rows) on 1, 2 and 3 threads."""
    kernels = (SPLIT, GRAD_SPLIT if m >= SPLIT_GRAD_MIN_M else GRAD_FALLBACK)
    check_thread_counts_agree(rng, m, 523, 1216, kernels, sample=fp32_input)


def test_misaligned_input(rng):
    """x at an address that is 4 mod 64: the same bits as an aligned copy."""
    n, k, m = SPLIT_MIN_N, 128, 20
    packed, state, _ = make_weight(rng, n, k, 64, "nf4", False)
    x = rng.standard_normal((m, k)).astype(np.float32)
    buf = np.zeros(x.nbytes + 128, np.uint8)
    off = (-buf.ctypes.data) % 64 + 4
    xm = buf[off : off + x.nbytes].view(np.float32).reshape(m, k)
    xm[...] = x
    assert np.array_equal(q4.gemm_4bit(xm, packed, state), q4.gemm_4bit(x, packed, state))
    assert last_kernels()["gemm_4bit"] == SPLIT


# ------------------------------------------------------------ input gradient


def grad(g, packed, state, w32, out_dtype="float32", what="", kernel=GRAD_SPLIT):
    dx = q4.gemm_4bit_grad_input(g, packed, state, out_dtype=out_dtype)
    assert last_kernels()["gemm_4bit_grad_input"] == kernel, what
    w64 = w32.astype(np.float64)
    extra = dropped_bound(g, np.abs(w64).sum(axis=0)) if kernel == GRAD_SPLIT else 0.0
    check_accumulation_bound(dx, g.astype(np.float64), w64, g.shape[1] + 5, out_dtype, None, TINY, what, extra)
    return dx


def avx512_grad_bytes(g, packed, state, **kw):
    with on_isa("avx512"):
        dx = q4.gemm_4bit_grad_input(g, packed, state, **kw)
        assert last_kernels()["gemm_4bit_grad_input"] == GRAD_FALLBACK
    return dx


@pytest.mark.parametrize("quant_type, nested, blocksize", FORMATS)
@pytest.mark.parametrize("out_dtype", ["float32", "bfloat16"])
def test_grad_matches_oracle(rng, quant_type, nested, blocksize, out_dtype):
    n, k = 72, SPLIT_GRAD_MIN_K + 64  # two strips of 256 columns and one of 64
    packed, state, w32 = make_weight(rng, n, k, blocksize, quant_type, nested)
    for m in (SPLIT_GRAD_MIN_M, 70):
        g = rng.standard_normal((m, n)).astype(np.float32)
        grad(g, packed, state, w32, out_dtype, what=f"m={m} {quant_type} bs{blocksize} {out_dtype}")


def test_grad_below_its_rows_and_fp16_take_the_fp32_kernel(rng):
    packed, state, w32 = make_weight(rng, 40, SPLIT_GRAD_MIN_K, 64, "nf4", True)
    g = rng.standard_normal((SPLIT_GRAD_MIN_M - 1, 40)).astype(np.float32)
    grad(g, packed, state, w32, kernel=GRAD_FALLBACK, what="m below the split gradient")
    grad(np.vstack([g, g]), packed, state, w32, what="m at the split gradient")
    grad(rng.standard_normal((80, 40)).astype(np.float16), packed, state, w32, kernel=GRAD_FALLBACK, what="fp16 dY")


@pytest.mark.parametrize(
    "m, n, k",
    [
        (1600, 40, 512),  # dY blocks of 768 rows: three blocks
        (64, 333, 576),  # 256-row W segments and a partial one, odd n (last pair half zero); a 64-column strip
        (65, 1, 512),  # one dY column, a 1-row last group
    ],
)
def test_grad_blocking(rng, m, n, k):
    packed, state, w32 = make_weight(rng, n, k, 64, "nf4", True)
    grad(rng.standard_normal((m, n)).astype(np.float32), packed, state, w32, what=f"{(m, n, k)}")


def test_grad_split_loses_no_bit(rng):
    """One-hot dY rows give W's rows exactly; W = identity gives dY exactly."""
    for quant_type, nested, blocksize in FORMATS:
        n, k = 80, SPLIT_GRAD_MIN_K
        packed, state, w32 = make_weight(rng, n, k, blocksize, quant_type, nested, scale=3.7)
        rows = rng.integers(0, n, size=64)
        g = np.zeros((64, n), np.float32)
        g[np.arange(64), rows] = 1.0
        dx = q4.gemm_4bit_grad_input(g, packed, state, out_dtype="float32")
        assert last_kernels()["gemm_4bit_grad_input"] == GRAD_SPLIT
        assert np.array_equal(dx, w32[rows]), (quant_type, nested, blocksize)
    k = SPLIT_GRAD_MIN_K
    packed, absmax = q4.quantize_4bit(np.eye(k, dtype=np.float32), 64, "nf4")
    state = q4.QuantState("nf4", 64, (k, k), "float32", absmax)
    g = spread_rows(rng, 70, k)
    assert np.array_equal(q4.gemm_4bit_grad_input(g, packed, state, out_dtype="float32"), g)
    assert last_kernels()["gemm_4bit_grad_input"] == GRAD_SPLIT


def test_grad_error_no_larger_than_the_fp32_kernels(rng):
    n, k, m = 2048, SPLIT_GRAD_MIN_K, 64
    packed, state, w32 = make_weight(rng, n, k, 64, "nf4", True)
    g = rng.standard_normal((m, n)).astype(np.float32)
    ref = g.astype(np.float64) @ w32.astype(np.float64)
    dx = q4.gemm_4bit_grad_input(g, packed, state, out_dtype="float32")
    assert last_kernels()["gemm_4bit_grad_input"] == GRAD_SPLIT
    err = np.linalg.norm(dx - ref) / np.linalg.norm(ref)
    err_fp32 = np.linalg.norm(avx512_grad_bytes(g, packed, state, out_dtype="float32") - ref) / np.linalg.norm(ref)
    assert err <= err_fp32, (err, err_fp32)


@pytest.mark.parametrize("value", [np.nan, np.inf])
def test_grad_dy_not_finite_takes_the_fp32_kernel(rng, value):
    packed, state, _ = make_weight(rng, 64, SPLIT_GRAD_MIN_K, 64, "nf4", True)
    g = rng.standard_normal((64, 64)).astype(np.float32)
    g[9, 33] = value
    dx = q4.gemm_4bit_grad_input(g, packed, state, out_dtype="float32")
    assert last_kernels()["gemm_4bit_grad_input"] == GRAD_FALLBACK
    assert dx.tobytes() == avx512_grad_bytes(g, packed, state, out_dtype="float32").tobytes()


@pytest.mark.parametrize("value", EXTREMES)
def test_grad_dy_extremes_stay_on_the_split(rng, value):
    packed, state, w32 = make_weight(rng, 64, SPLIT_GRAD_MIN_K, 64, "nf4", True)
    g = rng.standard_normal((64, 64)).astype(np.float32)
    plain = q4.gemm_4bit_grad_input(g, packed, state, out_dtype="float32")
    g[9, 33] = value
    dx = grad(g, packed, state, w32, what=f"dY element {value}")
    assert np.array_equal(np.delete(dx, 9, axis=0), np.delete(plain, 9, axis=0))


@pytest.mark.parametrize("power", [-140, -100, 100])
def test_grad_row_scale_changes_no_bit(rng, power):
    n, k, m = 96, SPLIT_GRAD_MIN_K, 70
    packed, state, w32 = make_weight(rng, n, k, 64, "nf4", True)
    gs = np.ldexp(rng.standard_normal((m, n)).astype(np.float32), power).astype(np.float32)
    base = np.ldexp(gs.astype(np.float64), -power).astype(np.float32)
    dx = q4.gemm_4bit_grad_input(base, packed, state, out_dtype="float32")
    dxs = grad(gs, packed, state, w32, what=f"dY * 2^{power}")
    assert np.array_equal(dxs, np.ldexp(dx.astype(np.float64), power).astype(np.float32))


@pytest.mark.parametrize("scale, split", [(2.0**40, False), (2.0**-40, False), (2.0**-20, True)])
def test_grad_scales_out_of_range_take_the_fp32_kernel(rng, scale, split):
    n, k = 100, SPLIT_GRAD_MIN_K
    packed, state, _ = make_weight(rng, n, k, 64, "nf4", False)
    absmax = np.array(state.absmax, copy=True)
    absmax[-1] = scale
    state = q4.QuantState("nf4", 64, (n, k), "float32", absmax)
    g = rng.standard_normal((64, n)).astype(np.float32)
    dx = q4.gemm_4bit_grad_input(g, packed, state, out_dtype="float32")
    assert last_kernels()["gemm_4bit_grad_input"] == (GRAD_SPLIT if split else GRAD_FALLBACK)
    if not split:
        assert dx.tobytes() == avx512_grad_bytes(g, packed, state, out_dtype="float32").tobytes()
