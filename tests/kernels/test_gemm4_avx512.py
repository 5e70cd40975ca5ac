"""fp32-compute AVX-512 fused 4-bit matmuls (kernels/cpu/x86/avx512/
gemm4_tiled.cc: the forward for m >= 2 and the input gradient), through q4's
numpy API, against an fp64 oracle of the fp32 contract.

The contract: each W element is decode(nibble) * scale(block) in fp32 -- the
value dequantize_4bit returns (here: tests/q4_reference/oracle.py's dequantize) --
products and sums in fp32 (FMA allowed), the bias added in fp32, one rounding
to the output dtype. A 16-bit input is widened exactly to fp32 first (on the
avx512 level a bf16 input reaches these kernels too: the bf16-compute kernels
are on the level above).

Error bound, derived: the fp32 result is a sum of L products (L = the
reduction length, plus the bias) in some order, every FMA or add rounded once,
at most L + 1 roundings on any path: |acc - exact| <= gamma_{L+1} * sum|terms|
<= (L + 2) u sum|terms| (u = 2^-24), plus an absolute 2^-149 per operation for
results in the subnormal range (IEEE arithmetic: the kernels run without
flush-to-zero). The final rounding to the output dtype adds u_out * |acc|
(u_out = 2^-8 for bf16, 2^-11 for fp16, 0 for fp32).
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from q4_reference.matmul import check_accumulation_bound
from q4_reference.matmul import quantized_weight as make_weight

import q4

BF16 = ml_dtypes.bfloat16
TINY = 2.0**-149
NP_DTYPE = {"float32": np.float32, "bfloat16": BF16, "float16": np.float16}
KERNEL_FWD, KERNEL_GRAD = "avx512.gemm4", "avx512.grad4"

# every test on the avx512 level (whatever Q4_ISA says), all threads; not run,
# named, on a processor without it
ISA = "avx512"
pytestmark = pytest.mark.usefixtures("module_isa")


def last_kernels() -> dict:
    return q4.cpu_features()["last_kernel"]


def check(got, a64, b64, length, out_dtype, bias=None, what=""):
    """got ~ a64 @ b64 (+ bias) within the contract's bound (module docstring)."""
    check_accumulation_bound(got, a64, b64, length, out_dtype, bias, TINY, what)


def forward(x, packed, state, w32, out_dtype, bias=None, what=""):
    y = q4.gemm_4bit(x, packed, state, bias=bias, out_dtype=out_dtype)
    assert y.dtype == NP_DTYPE[out_dtype]
    assert last_kernels()["gemm_4bit"] == KERNEL_FWD, what
    check(y, x.astype(np.float64), w32.astype(np.float64).T, x.shape[1], out_dtype, bias, what)
    return y


def grad(g, packed, state, w32, out_dtype, what=""):
    dx = q4.gemm_4bit_grad_input(g, packed, state, out_dtype=out_dtype)
    assert dx.dtype == NP_DTYPE[out_dtype]
    assert last_kernels()["gemm_4bit_grad_input"] == KERNEL_GRAD, what
    check(dx, g.astype(np.float64), w32.astype(np.float64), g.shape[1], out_dtype, None, what)
    return dx


def make_input(rng, shape, dtype, scale=3.0):
    return (rng.standard_normal(shape) * scale).astype(np.float32).astype(NP_DTYPE[dtype])


# Batches. Forward: row-dot (2..8); one tiled panel, partial or full (12, 16:
# 24 x 1 tiles); 16 / 32 tiled rows and the last one by row-dot (17, 33);
# three panels, the last partial (45: 9 x 3 tiles); nine panels, the last with
# 12 rows (140: 14 x 2 and 14 x 1 tiles). Gradient: fused (1..8), then dY
# slivers of <= 6 rows. Weights: k % 32 == 16 (a final half group per row;
# blocks of 32 and 64 split groups and rows), and k = 4 chunks of 256 + 64 (a
# partial last chunk) with n > 128 (two gradient chunks); n is not a multiple
# of any tile size.
BATCHES = (2, 3, 5, 8, 12, 16, 17, 33, 45, 140)
GRAD_BATCHES = (1,) + BATCHES
WEIGHTS = ((77, 336), (145, 1088))
FORMATS = [(qt, nested, bs) for qt in ("nf4", "fp4") for nested in (False, True) for bs in (32, 64, 256, 4096)]


@pytest.mark.parametrize("quant_type, nested, blocksize", FORMATS)
@pytest.mark.parametrize("in_dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("out_dtype", ["float32", "float16", "bfloat16"])
def test_forward_matches_oracle(rng, quant_type, nested, blocksize, in_dtype, out_dtype):
    for n, k in WEIGHTS:
        packed, state, w32 = make_weight(rng, n, k, blocksize, quant_type, nested)
        for i, m in enumerate(BATCHES):
            x = make_input(rng, (m, k), in_dtype)
            bias = [None, make_input(rng, (n,), "float32"), make_input(rng, (n,), "bfloat16")][i % 3]
            what = f"forward {(m, n, k)} bias={None if bias is None else bias.dtype}"
            forward(x, packed, state, w32, out_dtype, bias, what=what)


@pytest.mark.parametrize("quant_type, nested, blocksize", FORMATS)
@pytest.mark.parametrize("in_dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("out_dtype", ["float32", "float16", "bfloat16"])
def test_grad_input_matches_oracle(rng, quant_type, nested, blocksize, in_dtype, out_dtype):
    for n, k in WEIGHTS:
        packed, state, w32 = make_weight(rng, n, k, blocksize, quant_type, nested)
        for m in GRAD_BATCHES:
            g = make_input(rng, (m, n), in_dtype)
            grad(g, packed, state, w32, out_dtype, what=f"grad {(m, n, k)}")


def test_every_small_batch(rng):
    """Each m up to 2 panels (every row-dot and fused-gradient instantiation,
    every row-dot tail), one format."""
    for n, k, blocksize in ((77, 336, 64), (40, 1024, 32)):
        packed, state, w32 = make_weight(rng, n, k, blocksize, "nf4", True)
        for m in range(1, 41):
            if m > 1:
                forward(make_input(rng, (m, k), "float32"), packed, state, w32, "float32", what=f"forward m={m}")
            grad(make_input(rng, (m, n), "float32"), packed, state, w32, "float32", what=f"grad m={m}")


@pytest.mark.parametrize(
    "m, n, k, blocksize",
    [
        (2, 301, 4112, 64),  # row-dot: W rows in tiles of 8 + 5 leftovers, a final half group
        (10, 130, 2048, 32),  # row-dot, the largest m
        (44, 300, 1088, 64),  # tiled: 3 panels (9 x 3 tiles), the last partial, partial row tile
        (130, 129, 576, 4096),  # tiled: 8 panels + the last 2 rows by row-dot; blocks straddle rows
        (64, 1000, 272, 128),  # tiled: 4 panels, 72 row tiles (several per thread chunk)
    ],
)
def test_larger_shapes(rng, m, n, k, blocksize):
    packed, state, w32 = make_weight(rng, n, k, blocksize, "nf4", True)
    x = make_input(rng, (m, k), "float32")
    bias = make_input(rng, (n,), "float32")
    forward(x, packed, state, w32, "float32", bias, what=f"forward {(m, n, k)}")
    forward(x.astype(np.float16), packed, state, w32, "bfloat16", None, what=f"forward {(m, n, k)} fp16 in")
    g = make_input(rng, (m, n), "float32")
    grad(g, packed, state, w32, "float32", what=f"grad {(m, n, k)}")
    grad(g, packed, state, w32, "float16", what=f"grad {(m, n, k)} fp16 out")


def test_large_and_small_weight_values(rng):
    """Scales far from 1: W up to ~1e30 and down to ~1e-30."""
    for scale in (1e30, 1e-30):
        packed, state, w32 = make_weight(rng, 50, 128, 64, "fp4", True, scale=scale)
        for m in (3, 20):
            x = make_input(rng, (m, 128), "float32", scale=1.0)
            forward(x, packed, state, w32, "float32", what=f"forward m={m} W scale {scale}")
            g = make_input(rng, (m, 50), "float32", scale=1.0)
            grad(g, packed, state, w32, "float32", what=f"grad m={m} W scale {scale}")


def test_denormal_values_are_not_flushed(rng):
    """IEEE arithmetic: denormal inputs (and products) keep their value."""
    packed, state, w32 = make_weight(rng, 40, 128, 64, "nf4", False)
    for m in (4, 20):
        x = (rng.standard_normal((m, 128)) * 1e-39).astype(np.float32)
        y = forward(x, packed, state, w32, "float32", what=f"denormal x, m={m}")
        assert np.count_nonzero(y) > y.size // 2
        g = (rng.standard_normal((m, 40)) * 1e-39).astype(np.float32)
        dx = grad(g, packed, state, w32, "float32", what=f"denormal dY, m={m}")
        assert np.count_nonzero(dx) > dx.size // 2


def test_exact_cases(rng):
    """W = identity (codes +-1 times absmax 1): y = x and dX = dY exactly; a
    single nonzero weight gives exactly its products; a zero weight zeros."""
    for quant_type in ("nf4", "fp4"):
        for m in (1, 2, 7, 12, 33):
            k = 144
            packed, absmax = q4.quantize_4bit(np.eye(k, dtype=np.float32), 64, quant_type)
            state = q4.QuantState(quant_type, 64, (k, k), "float32", absmax)
            x = make_input(rng, (m, k), "float32")
            if m > 1:
                assert np.array_equal(q4.gemm_4bit(x, packed, state), x)
                assert last_kernels()["gemm_4bit"] == KERNEL_FWD
            assert np.array_equal(q4.gemm_4bit_grad_input(x, packed, state), x)
            assert last_kernels()["gemm_4bit_grad_input"] == KERNEL_GRAD
    n, k = 24, 208  # k % 32 == 16, k % 64 != 0: blocks straddle rows
    w = np.zeros((n, k), np.float32)
    w[5, 77] = -3.25
    for blocksize in (32, 64):
        packed, absmax = q4.quantize_4bit(w, blocksize, "nf4")
        state = q4.QuantState("nf4", blocksize, (n, k), "float32", absmax)
        for m in (3, 9, 40):
            x = make_input(rng, (m, k), "float32")
            want = np.zeros((m, n), np.float32)
            want[:, 5] = x[:, 77] * np.float32(-3.25)
            assert np.array_equal(q4.gemm_4bit(x, packed, state), want)
            g = make_input(rng, (m, n), "float32")
            want_dx = np.zeros((m, k), np.float32)
            want_dx[:, 77] = g[:, 5] * np.float32(-3.25)
            assert np.array_equal(q4.gemm_4bit_grad_input(g, packed, state), want_dx)
    packed, absmax = q4.quantize_4bit(np.zeros((48, 64), np.float32), 64, "nf4")
    state = q4.QuantState("nf4", 64, (48, 64), "float32", absmax)
    for m in (2, 20):
        assert np.array_equal(q4.gemm_4bit(make_input(rng, (m, 64), "float32"), packed, state), np.zeros((m, 48)))


def test_nan_and_inf_inputs_propagate(rng):
    packed, state, w32 = make_weight(rng, 40, 128, 64, "nf4", False)
    for m in (3, 20):  # row-dot and tiled
        x = make_input(rng, (m, 128), "float32")
        x[1, 5] = np.nan
        x[2, 7] = np.inf
        y = q4.gemm_4bit(x, packed, state)
        assert np.isnan(y[1]).all()
        w_col = w32[:, 7]
        assert np.array_equal(np.isnan(y[2]), w_col == 0)  # inf * 0 is NaN
        assert np.array_equal(np.sign(y[2][w_col != 0]), np.sign(w_col[w_col != 0]))
        assert np.isfinite(np.delete(y, [1, 2], axis=0)).all()
        g = make_input(rng, (m, 40), "float32")
        g[1, 3] = np.nan
        dx = q4.gemm_4bit_grad_input(g, packed, state)
        assert np.isnan(dx[1]).all() and np.isfinite(np.delete(dx, 1, axis=0)).all()


@pytest.mark.parametrize("m", [1, 2, 5, 8, 9, 16, 17, 45, 64, 140, 160])
def test_bit_identical_across_thread_counts(rng, m):
    # 64, 140 and 160: the tiled forward split by panels on 2 and 3 threads, by
    # W rows on 1; 160: the gradient split by dY rows on 2 and 3 threads (runs
    # of 84 + 76 and 54 + 54 + 52 rows), by dX strips on 1
    n, k = 203, 1232  # k % 32 == 16
    packed, state, _ = make_weight(rng, n, k, 64, "nf4", True)
    x = make_input(rng, (m, k), "float32")
    g = make_input(rng, (m, n), "float32")
    bias = make_input(rng, (n,), "bfloat16")
    outs = []
    for threads in (1, 2, 3):
        q4.set_num_threads(threads)
        outs.append(
            (
                q4.gemm_4bit(x, packed, state, bias=bias),
                q4.gemm_4bit(x.astype(np.float16), packed, state),
                q4.gemm_4bit_grad_input(g, packed, state),
                q4.gemm_4bit_grad_input(g, packed, state, out_dtype="bfloat16"),
            )
        )
        assert last_kernels()["gemm_4bit_grad_input"] == KERNEL_GRAD
        if m > 1:  # m == 1 is the batch-1 gemv's (or, for this k, the next level's)
            assert last_kernels()["gemm_4bit"] == KERNEL_FWD
    for other in outs[1:]:
        for a, b in zip(outs[0], other, strict=True):
            assert a.tobytes() == b.tobytes()


def test_misaligned_inputs(rng):
    """fp32 / fp16 inputs at addresses that are not 64-byte (nor 4-byte for fp16) aligned."""
    n, k = 64, 160
    packed, state, _ = make_weight(rng, n, k, 64, "nf4", False)
    for dtype, offset in (("float32", 4), ("float16", 2)):
        for m in (2, 20):
            x = make_input(rng, (m, k), dtype)
            buf = np.zeros(x.nbytes + 64, np.uint8)
            xm = buf[offset : offset + x.nbytes].view(x.dtype).reshape(m, k)
            xm[...] = x
            assert np.array_equal(q4.gemm_4bit(xm, packed, state), q4.gemm_4bit(x, packed, state))
            g = make_input(rng, (m, n), dtype)
            gm = buf[offset : offset + g.nbytes].view(g.dtype).reshape(m, n)
            gm[...] = g
            assert np.array_equal(q4.gemm_4bit_grad_input(gm, packed, state), q4.gemm_4bit_grad_input(g, packed, state))


def test_declined_shapes_fall_back(rng):
    """k % 16 != 0 is not served by these kernels: the next kernel in the chain
    runs and keeps the same fp32 bound."""
    for n, k in ((70, 200), (33, 24)):
        packed, state, w32 = make_weight(rng, n, k, 32, "nf4", True)
        w64 = w32.astype(np.float64)
        for m in (2, 9, 40):
            x = make_input(rng, (m, k), "float32")
            y = q4.gemm_4bit(x, packed, state)
            assert last_kernels()["gemm_4bit"] not in ("", KERNEL_FWD)
            check(y, x.astype(np.float64), w64.T, k, "float32", what=f"declined forward {(m, n, k)}")
            g = make_input(rng, (m, n), "float32")
            dx = q4.gemm_4bit_grad_input(g, packed, state)
            assert last_kernels()["gemm_4bit_grad_input"] not in ("", KERNEL_GRAD)
            check(dx, g.astype(np.float64), w64, n, "float32", what=f"declined grad {(m, n, k)}")
