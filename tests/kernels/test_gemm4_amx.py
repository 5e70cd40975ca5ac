"""bf16-compute fused 4-bit matmuls on the AMX tile unit (the amx level,
kernels/cpu/x86/amx/gemm4.cc), through q4's numpy API, against the fp64
oracle of the bf16-compute contract (test_gemm4_bf16.py: the contract, the
oracle and its error bound, which the tile kernels share; only the order of
their fp32 additions differs).

One x row (the forward) is served by the avx512 level's fp32 gemv on this
level (faster than the bf16 gemv on these cores; the fp32 contract), fewer
than AMX_MIN_M x / dY rows otherwise by the avx512_bf16 kernels; from
AMX_MIN_M on by the tile kernels, from ROWS_MIN_M rows (k up to ROWS_MAX_K)
by the x-major forward (x read in place as A tiles, W decoded into VNNI B
tiles, C in the output's orientation; whole 32-row pairs in place, the rows
after them packed with zero rows; x blocks of L2 size, W tiles decoded in
groups of 512 KiB), whose blocking these shapes
reach, as the W-major forward's: W tiles of 32 rows (partial last tile), x panels of 16 rows (partial
last panel, one or two per tile pass), x blocks of L2 size (k = 4096: 12
panels a block), W decoded in 256-column segments, dY packed into tiles
(rows padded to 16, their length to 32), gradient strips of 256 columns
(k % 256 != 0: a narrower last strip), W decoded in 256-row segments, dY
blocks of 1536 rows (their sums kept in L2), dY read in place up to 1536
columns (whole 32-row pairs; the rest packed).
"""

from __future__ import annotations

import numpy as np
import pytest
from conftest import on_isa
from q4_reference.bf16_gemm import (
    BF16,
    FORMATS,
    TINY,
    bf16_exact,
    bf16_input,
    check_rows_independent,
    check_thread_counts_agree,
    forward,
    grad,
    last_kernels,
)
from q4_reference.matmul import check_accumulation_bound
from q4_reference.matmul import quantized_weight as make_weight

import q4

ISA = "amx"
pytestmark = pytest.mark.usefixtures("module_isa")

AMX_MIN_M = 3  # kMinM in kernels/cpu/x86/amx/gemm4.cc
ROWS_MIN_M, ROWS_MAX_K = 64, 3072  # kRowsMinM, kRowsMaxK there
FWD, ROWS, GRAD = "amx.gemm4", "amx.gemm4_rows", "amx.grad4"


def fwd_kernel(m: int, k: int) -> str:
    if m >= ROWS_MIN_M and k <= ROWS_MAX_K:
        return ROWS
    return FWD if m >= AMX_MIN_M else "avx512_bf16.gemm4"


@pytest.mark.parametrize("quant_type, nested, blocksize", [("nf4", True, 64), ("fp4", False, 32), ("nf4", False, 256)])
def test_batch1_takes_the_fp32_gemv(rng, quant_type, nested, blocksize):
    """A bf16 x row runs the fp32 gemv (amx.gemv_f32): the avx512 level's bytes,
    within the fp32 contract's bound (W exact, not rounded to bf16)."""
    n, k = 77, 384
    packed, state, w32 = make_weight(rng, n, k, blocksize, quant_type, nested)
    x = bf16_input(rng, (1, k))
    bias = bf16_input(rng, (n,))
    for out_dtype in ("float32", "bfloat16"):
        y = q4.gemm_4bit(x, packed, state, bias=bias, out_dtype=out_dtype)
        assert last_kernels()["gemm_4bit"] == "amx.gemv_f32"
        check_accumulation_bound(
            y, x.astype(np.float64), w32.astype(np.float64).T, k, out_dtype, bias, what=f"gemv_f32 {out_dtype}"
        )
        with on_isa("avx512"):
            assert np.array_equal(q4.gemm_4bit(x, packed, state, bias=bias, out_dtype=out_dtype), y)
            assert last_kernels()["gemm_4bit"] == "avx512.gemm4"


def grad_kernel(m: int) -> str:
    return GRAD if m >= AMX_MIN_M else "avx512_bf16.grad4"


@pytest.mark.parametrize("quant_type, nested, blocksize", FORMATS)
@pytest.mark.parametrize("out_dtype", ["float32", "bfloat16"])
def test_forward_and_grad_match_oracle(rng, quant_type, nested, blocksize, out_dtype):
    n, k = 77, 320  # a partial W tile; n odd and not a multiple of 32 (the gradient pads)
    packed, state, w32 = make_weight(rng, n, k, blocksize, quant_type, nested)
    # (m = 1: test_batch1_takes_the_fp32_gemv); from 64 the x-major forward:
    # whole 32-row pairs, a packed tail of 1, 16 and 17 rows
    for i, m in enumerate((2, 3, 8, 16, 17, 33, 63, 64, 65, 80, 81)):
        x = bf16_input(rng, (m, k))
        bias = [None, bf16_input(rng, (n,)), (rng.standard_normal(n) * 3).astype(np.float32)][i % 3]
        forward(x, packed, state, w32, out_dtype, bias, what=f"forward m={m}", kernel=fwd_kernel(m, k))
        g = bf16_input(rng, (m, n))
        grad(g, packed, state, w32, out_dtype, what=f"grad m={m}", kernel=grad_kernel(m))


@pytest.mark.parametrize(
    "m, n, k, blocksize",
    [
        (300, 40, 4096, 64),  # forward: two x blocks (12 + 7 panels), the last panel partial
        (200, 4096, 128, 64),  # gradient: 16 W row segments, one strip of 128 columns
        (1600, 70, 320, 64),  # gradient: two dY blocks (1536 + 64 rows), a strip of 256 columns and one of 64
        (48, 96, 4160, 32),  # k not a multiple of 128; two scales per 64-element chunk
        (40, 33, 1408, 256),  # blocks straddle W rows; one W row past a tile
        (9, 1, 64, 4096),  # one output column; the gradient's single, padded pair of W rows
        # the x-major forward: three x blocks (544 + 544 + 12 rows, the last a packed tail)
        (1100, 70, 1408, 64),
        (70, 200, 3072, 64),  # W tiles decoded two at a time (192 KiB each), 6 rows packed
        (96, 48, 1024, 32),  # two scales per 64-element chunk
        (80, 33, 2048, 4096),  # blocks straddle W rows; one W row past a tile
        (64, 1, 64, 256),  # one output column, one k step pair
        # the gradient's dY read in place (n % 32 == 0, n <= 1536), the rows after the last pair packed
        (1600, 384, 320, 64),  # two dY blocks (1536 + 64 rows)
        (100, 1536, 256, 64),  # the widest dY read in place
        (100, 1568, 256, 64),  # one step wider: packed
    ],
)
def test_blocking(rng, m, n, k, blocksize):
    packed, state, w32 = make_weight(rng, n, k, blocksize, "nf4", True)
    x = bf16_input(rng, (m, k))
    fwd = fwd_kernel(m, k)
    forward(x, packed, state, w32, "bfloat16", bf16_input(rng, (n,)), what=f"forward {(m, n, k)}", kernel=fwd)
    forward(x, packed, state, w32, "float32", None, what=f"forward {(m, n, k)} fp32 out", kernel=fwd)
    g = bf16_input(rng, (m, n))
    grad(g, packed, state, w32, "float32", what=f"grad {(m, n, k)}", kernel=GRAD)
    grad(g, packed, state, w32, "float16", what=f"grad {(m, n, k)} fp16 out", kernel=GRAD)


# From STREAMED_BYTES of packed W and up to 32 x rows (two panels) the
# W-major forward's tiles take every S-th row of a group of S * 32 rows, S =
# min(4, 8192 // k) (kStreamedBytes, kMaxRowStride there): partial groups and
# partial tiles, the rows' sums stored S columns apart (masked runs of 16),
# the group's scales decoded once for its S tiles.
STREAMED_BYTES = 4 << 20


@pytest.mark.parametrize(
    "m, n, k, blocksize",
    [
        (5, 4141, 2048, 64),  # S = 4; a last group of 45 rows (tiles of 12, 11, 11, 11 rows)
        (3, 2051, 4096, 64),  # S = 2; a last group of 3 rows (tiles of 2 and 1)
        (17, 2800, 3072, 4096),  # S = 2; blocks straddle W rows; two x panels
        (4, 2049, 4160, 32),  # S = 1 (k / 2 bytes above a page): the adjacent tiles
        (40, 1111, 8192, 64),  # S = 1 (k = 8192); three x panels
        (32, 2083, 4096, 128),  # S = 2; two whole x panels; a last group of 35 rows (tiles of 18 and 17)
        (37, 2083, 4096, 128),  # S = 1 from three x panels (the last partial)
    ],
)
def test_forward_spaced_tiles(rng, m, n, k, blocksize):
    assert n * k // 2 >= STREAMED_BYTES
    packed, state, w32 = make_weight(rng, n, k, blocksize, "nf4", True)
    x = bf16_input(rng, (m, k))
    forward(x, packed, state, w32, "bfloat16", bf16_input(rng, (n,)), what=f"forward {(m, n, k)}", kernel=FWD)
    y = forward(x, packed, state, w32, "float32", None, what=f"forward {(m, n, k)} fp32 out", kernel=FWD)
    # every output dtype's store: the same sums, rounded once
    for out_dtype in ("bfloat16", "float16"):
        got = forward(x, packed, state, w32, out_dtype, None, what=f"forward {(m, n, k)} {out_dtype}", kernel=FWD)
        assert got.tobytes() == y.astype(got.dtype).tobytes(), out_dtype
    q4.set_num_threads(1)
    try:
        assert q4.gemm_4bit(x, packed, state, out_dtype="float32").tobytes() == y.tobytes()
    finally:
        q4.set_num_threads(0)


def test_exact_cases(rng):
    """W = identity: y = x and dX = dY exactly; a zero W gives exact zeros."""
    k = 128
    for quant_type in ("nf4", "fp4"):
        packed, absmax = q4.quantize_4bit(np.eye(k, dtype=np.float32), 64, quant_type)
        state = q4.QuantState(quant_type, 64, (k, k), "float32", absmax)
        for m in (8, 33, 64, 100):
            x = bf16_input(rng, (m, k))
            assert np.array_equal(q4.gemm_4bit(x, packed, state, out_dtype="float32"), x.astype(np.float32))
            assert last_kernels()["gemm_4bit"] == fwd_kernel(m, k)
            assert np.array_equal(q4.gemm_4bit_grad_input(x, packed, state), x)
            assert last_kernels()["gemm_4bit_grad_input"] == GRAD
    packed, absmax = q4.quantize_4bit(np.zeros((48, 64), np.float32), 64, "nf4")
    state = q4.QuantState("nf4", 64, (48, 64), "float32", absmax)
    y = q4.gemm_4bit(bf16_input(rng, (20, 64)), packed, state, out_dtype="float32")
    assert np.array_equal(y, np.zeros((20, 48), np.float32))


@pytest.mark.parametrize("m", [20, 70])
def test_nan_inf_and_denormal_inputs(rng, m):
    """NaN / inf rows propagate to their outputs only; denormal inputs count
    as zero (TDPBF16PS, like vdpbf16ps, treats them so)."""
    packed, state, w32 = make_weight(rng, 40, 128, 64, "nf4", False)
    x = bf16_input(rng, (m, 128))
    x[1, 5] = np.nan
    x[2, 7] = np.inf
    y = q4.gemm_4bit(x, packed, state, out_dtype="float32")
    assert last_kernels()["gemm_4bit"] == fwd_kernel(m, 128)
    assert np.isnan(y[1]).all()
    w_col = bf16_exact(w32)[:, 7]
    assert np.array_equal(np.isnan(y[2]), w_col == 0)  # inf * 0 is NaN
    assert np.isfinite(np.delete(y, [1, 2], axis=0)).all()
    g = bf16_input(rng, (20, 40))
    g[1, 3] = np.nan
    dx = q4.gemm_4bit_grad_input(g, packed, state, out_dtype="float32")
    assert np.isnan(dx[1]).all() and np.isfinite(np.delete(dx, 1, axis=0)).all()
    big, bstate, bw32 = make_weight(rng, 40, 128, 64, "nf4", False, scale=2.0**100)
    xd = (rng.standard_normal((m, 128)) * 1e-39).astype(np.float32).astype(BF16)
    assert np.all(np.abs(xd.astype(np.float64)) < TINY) and np.any(xd.astype(np.float64) != 0)
    yd = forward(xd, big, bstate, bw32, "float32", what="denormal x", kernel=fwd_kernel(m, 128))
    assert np.array_equal(yd, np.zeros_like(yd))
    gd = (rng.standard_normal((9, 40)) * 1e-39).astype(np.float32).astype(BF16)
    assert np.array_equal(q4.gemm_4bit_grad_input(gd, big, bstate, out_dtype="float32"), np.zeros((9, 128), np.float32))


@pytest.mark.parametrize("m", [8, 17, 40, 130])
def test_bit_identical_across_thread_counts(rng, m):
    check_thread_counts_agree(rng, m, 203, 1216, (fwd_kernel(m, 1216), GRAD))


@pytest.mark.parametrize("n", [128, 96, 1600])  # dY read in place; in place with a 16-row tail group; packed
def test_gradient_rows_are_independent(rng, n):
    packed, state, _ = make_weight(rng, n, 256, 64, "nf4", True)
    call = lambda g: q4.gemm_4bit_grad_input(g, packed, state, out_dtype="float32")  # noqa: E731
    check_rows_independent(rng, call, bf16_input(rng, (100, n)), 20, "gemm_4bit_grad_input", GRAD)


def test_x_major_rows_are_independent(rng):
    """The x-major forward; a row computed in a batch of 64 has the bytes it
    has in a batch of 100."""
    n, k = 70, 640
    packed, state, _ = make_weight(rng, n, k, 64, "nf4", True)
    bias = bf16_input(rng, (n,))
    call = lambda x: q4.gemm_4bit(x, packed, state, bias=bias, out_dtype="float32")  # noqa: E731
    check_rows_independent(rng, call, bf16_input(rng, (100, k)), 36, "gemm_4bit", ROWS)


def test_misaligned_inputs(rng):
    """Inputs at an address that is 2 mod 4: the same bits as aligned ones."""
    n, k = 64, 128
    packed, state, _ = make_weight(rng, n, k, 64, "nf4", False)
    for m in (20, 70):  # the W-major and the x-major forward
        buf = np.zeros(m * max(n, k) * 2 + 8, np.uint8)
        x = bf16_input(rng, (m, k))
        xm = buf[2 : 2 + x.nbytes].view(BF16).reshape(m, k)
        xm[...] = x
        assert np.array_equal(q4.gemm_4bit(xm, packed, state), q4.gemm_4bit(x, packed, state))
        assert last_kernels()["gemm_4bit"] == fwd_kernel(m, k)
        g = bf16_input(rng, (m, n))
        gm = buf[2 : 2 + g.nbytes].view(BF16).reshape(m, n)
        gm[...] = g
        assert np.array_equal(q4.gemm_4bit_grad_input(gm, packed, state), q4.gemm_4bit_grad_input(g, packed, state))
        assert last_kernels()["gemm_4bit_grad_input"] == GRAD


def test_level_reports_its_chain():
    f = q4.cpu_features()
    assert f["isa"] == "amx" and f["features"]["amx"]
    assert f["kernels"]["gemm_4bit"][:5] == [ROWS, FWD, "amx.gemv_f32", "amx.gemm4_split", "avx512_bf16.gemm4"]
    assert f["kernels"]["gemm_4bit_grad_input"][:3] == [GRAD, "amx.grad4_split", "avx512_bf16.grad4"]


@pytest.mark.parametrize("m, n, k", [(70, 64, 320), (100, 384, 256), (20, 96, 128)])
def test_bf16_outputs_are_the_fp32_sums_rounded_once(rng, m, n, k):
    """Every store path (the x-major forward's rows, the W-major forward's
    transposed tiles, the gradient's strips): a bf16 output is the fp32
    output rounded to nearest even, bit for bit, large and small rows alike;
    NaN stays NaN."""
    packed, state, _ = make_weight(rng, n, k, 64, "nf4", True)
    x = bf16_input(rng, (m, k))
    x[3, 7] = np.nan
    x[5] *= BF16(2.0**100)
    x[8] *= BF16(2.0**-100)
    g = bf16_input(rng, (m, n))
    g[4, 2] = np.nan
    g[6] *= BF16(2.0**100)
    g[9] *= BF16(2.0**-100)
    for out, ref in (
        (q4.gemm_4bit(x, packed, state, out_dtype="bfloat16"), q4.gemm_4bit(x, packed, state, out_dtype="float32")),
        (
            q4.gemm_4bit_grad_input(g, packed, state, out_dtype="bfloat16"),
            q4.gemm_4bit_grad_input(g, packed, state, out_dtype="float32"),
        ),
    ):
        want = ref.astype(BF16)
        nan = np.isnan(ref)
        assert nan.any()
        assert np.array_equal(np.isnan(out.astype(np.float32)), nan)
        assert out[~nan].tobytes() == want[~nan].tobytes()


@pytest.mark.parametrize("m", [20, 70])
def test_bf16_outputs_round_ties_to_even(rng, m):
    """W with two exact 1.0 entries per row and per column: each output is
    the exact sum of two inputs, chosen so that many sums lie halfway between
    two bf16 values; the bf16 outputs are those sums rounded to nearest even
    (the forward's and the gradient's stores)."""
    n = k = 64
    w = np.zeros((n, k), np.float32)
    w[np.arange(n), np.arange(n)] = 1.0
    w[np.arange(n), (np.arange(n) + 1) % k] = 1.0
    packed, absmax = q4.quantize_4bit(w, 64, "nf4")
    state = q4.QuantState("nf4", 64, (n, k), "float32", absmax)
    values = np.array([1.0, -1.0, 2.0**-8, -(2.0**-8), 3 * 2.0**-9, 1.5, 2.0**-7, 3.0], np.float32)
    w64 = w.astype(np.float64)
    cases = (  # (input, its width, the kernel call, the exact product)
        (rng.choice(values, (m, k)).astype(BF16), k, q4.gemm_4bit, lambda a: a.astype(np.float64) @ w64.T),
        (rng.choice(values, (m, n)).astype(BF16), n, q4.gemm_4bit_grad_input, lambda a: a.astype(np.float64) @ w64),
    )
    for a, width, call, product in cases:
        out = call(a, packed, state, out_dtype="bfloat16")
        exact = product(a)
        ties = np.abs(exact.astype(BF16).astype(np.float64) - exact) == 2.0 ** (
            np.floor(np.log2(np.abs(exact) + 1e-300)) - 8
        )
        assert ties.sum() > width  # many sums are halfway cases
        assert out.tobytes() == exact.astype(np.float32).astype(BF16).tobytes()
