"""LLM.int8 input gradient on the AMX tile unit (the amx level,
kernels/cpu/x86/amx/gemm4.cc), through q4's numpy API: amx.int8_grad for
bf16 dY, amx.int8_grad_split for fp32 dY.

Its contract is the bf16-compute one of the 4-bit weights (README "bf16
compute"): each weight element is its fp32 value fp32(CB * fp32(SCB / 127))
rounded once to bf16, the products with bf16 dY are summed in fp32
(TDPBF16PS: exact products, denormals read as zero), and the sum is rounded
once to the output dtype. The oracle is the fp64 product with those bf16
weights and the fp32 accumulation bound around it.

fp32 dY from SPLIT_MIN_M rows: g = fp32(dY * fp32(SCB / 127)) as the exact
contract computes it, then sum_n g . CB with g split exactly into three bf16
parts and CB exact in bf16, each part product exact, in fp32: within the
fp32 accumulation bound of the fp64 sum (plus 2^-60 max|g row| sum|CB| for
the elements below 2^-60 of their row's largest, which are dropped), each
row at its own power-of-two scale (dY * 2^p gives dX * 2^p bit for bit).
A NaN or infinity in g, fp16 dY, fewer rows and k % 64 != 0 keep the exact
contract (one fp32 multiply and one add per term in n order: test_int8.py).

The shapes reach the gradient walk's blocking (shared with the 4-bit
gradient, test_gemm4_amx.py): strips of 256 dX columns (a narrower last
strip), W decoded in 256-row segments (an odd n: a last row pair with one
row), dY read in place in whole 32-row pairs up to 1536 columns and packed
beyond, dY row blocks split so each thread gets two work units.
"""

from __future__ import annotations

import numpy as np
import pytest
from q4_reference import inputs
from q4_reference import int8_oracle as oracle
from q4_reference.bf16_gemm import BF16, TINY, bf16_input, check_rows_independent, last_kernels
from q4_reference.matmul import check_accumulation_bound

import q4

ISA = "amx"
pytestmark = pytest.mark.usefixtures("module_isa")

MIN_M = 4  # kInt8GradMinM in kernels/cpu/x86/amx/gemm4.cc
SPLIT_MIN_M = 8  # kInt8SplitMinM there
KERNEL, SPLIT = "amx.int8_grad", "amx.int8_grad_split"
OP = "int8_grad_input"


def _weight(rng, n, k):
    w = rng.integers(-127, 128, (n, k)).astype(np.int8)
    scb = rng.uniform(0.05, 3.0, n).astype(np.float32)
    return w, scb


def weight_bf16(w, scb) -> np.ndarray:
    """The contract's weight: fp32(CB * fp32(SCB * fp32(1/127))) rounded once to bf16, as fp64."""
    s = (scb * np.float32(1.0 / 127.0)).astype(np.float32)
    return (w.astype(np.float32) * s[:, None]).astype(np.float32).astype(BF16).astype(np.float64)


def grad(dy, w, scb, out_dtype="float32", kernel=KERNEL):
    dx = q4.int8_grad_input(dy, w, scb, out_dtype=out_dtype)
    assert last_kernels()[OP] == kernel
    return dx


def fp32_input(rng, shape):
    return rng.standard_normal(shape).astype(np.float32)


# each kernel with the dY it serves: (sample(rng, shape), kernel)
KINDS = {"bf16": (bf16_input, KERNEL), "fp32": (fp32_input, SPLIT)}


def scaled_dy(dy, scb) -> np.ndarray:
    """g = fp32(dY * fp32(SCB * fp32(1/127))), the exact contract's first step, as fp64."""
    s = (scb * np.float32(1.0 / 127.0)).astype(np.float32)
    return (dy * s[None, :]).astype(np.float32).astype(np.float64)


def check_split(dx, dy, w, scb, what=""):
    """dX within the fp32 bound of g . CB plus the dropped elements' term."""
    g = scaled_dy(dy, scb)
    w64 = w.astype(np.float64)
    extra = (2.0**-60 * np.abs(g).max(axis=1, keepdims=True)) * np.abs(w64).sum(axis=0, keepdims=True)
    check_accumulation_bound(dx, g, w64, dy.shape[1], "float32", extra=extra, what=what)


# (m, n, k): the fewest rows; partial 16-row groups; a narrower last strip
# (k = 320: 256 + 64); n odd (a last W row pair with one row) and beyond one
# 256-row segment; dY packed (n > 1536, n % 32 != 0); several dY row blocks
SHAPES = [
    (4, 40, 64),
    (16, 77, 128),
    (17, 384, 320),
    (33, 1536, 256),
    (64, 1568, 192),
    (70, 2001, 64),
    (1100, 96, 192),
]


@pytest.mark.parametrize("m,n,k", SHAPES, ids=[f"{m}x{n}x{k}" for m, n, k in SHAPES])
def test_matches_the_bf16_oracle(rng, m, n, k):
    dy = bf16_input(rng, (m, n))
    w, scb = _weight(rng, n, k)
    dx = grad(dy, w, scb)
    assert dx.dtype == np.float32 and dx.shape == (m, k)
    check_accumulation_bound(dx, dy.astype(np.float64), weight_bf16(w, scb), n, "float32", tiny=TINY, what="dX")
    # the exact contract's result is another one (the weight not rounded to bf16)
    assert not np.array_equal(dx, oracle.grad_input_f32(dy.astype(np.float32), w, scb))


def test_single_terms_are_exact(rng):
    """One nonzero weight per dX column: each dX element is one product of a
    bf16 dY value and a bf16 weight, exact in fp32, so the result is exact."""
    m, n, k = 35, 64, 192
    w = np.zeros((n, k), np.int8)
    rows = rng.integers(0, n, k)
    w[rows, np.arange(k)] = rng.integers(-127, 128, k).astype(np.int8)
    scb = rng.uniform(0.05, 3.0, n).astype(np.float32)
    dy = bf16_input(rng, (m, n))
    dx = grad(dy, w, scb)
    want = dy.astype(np.float64) @ weight_bf16(w, scb)
    assert np.array_equal(dx.astype(np.float64), want)


def test_kernel_choice():
    """bf16 dY from MIN_M rows with k % 64 == 0 runs the tile kernel; fewer
    rows, another k or an fp32 dY keep the exact contract's kernels (their
    bytes: the documented fp32 order)."""
    rng = np.random.default_rng(3)
    w, scb = _weight(rng, 48, 128)
    for m, k, dtype, kernel in [
        (MIN_M, 128, "bfloat16", KERNEL),
        (MIN_M - 1, 128, "bfloat16", "avx2.int8_grad"),
        (64, 96, "bfloat16", "avx512.int8_grad"),
        (SPLIT_MIN_M, 128, "float32", SPLIT),
        (SPLIT_MIN_M - 1, 128, "float32", "avx2.int8_grad"),
        (64, 96, "float32", "avx512.int8_grad"),
        (64, 128, "float16", "avx512.int8_grad"),
    ]:
        dy = bf16_input(rng, (m, 48)) if dtype == "bfloat16" else rng.standard_normal((m, 48)).astype(dtype)
        wk = np.ascontiguousarray(w[:, :k])
        dx = q4.int8_grad_input(dy, wk, scb, out_dtype="float32")
        assert last_kernels()[OP] == kernel, (m, k, dtype)
        if kernel not in (KERNEL, SPLIT):
            want = oracle.grad_input_f32(dy.astype(np.float32), wk, scb)
            assert np.array_equal(inputs.bits(dx), inputs.bits(want)), (m, k, dtype)


def test_special_values(rng):
    """NaN and infinities in dY reach their dX columns as a dense product
    would; denormal dY values are read as zero (the tile unit's contract)."""
    m, n, k = 8, 64, 64
    dy = bf16_input(rng, (m, n))
    w, scb = _weight(rng, n, k)
    w[w == 0] = 1  # every weight nonzero: each dY element reaches every dX column of its row
    dy[1, 5] = np.nan
    dy[2, 7] = np.inf
    dy[3, :] = np.float32(2.0**-130)  # denormal in bf16
    dx = grad(dy, w, scb)
    assert np.isnan(dx[1]).all()
    assert np.all(np.isinf(dx[2]) | np.isnan(dx[2]))
    assert np.array_equal(dx[3], np.zeros(k, np.float32))
    ok = [0, 4, 5, 6, 7]
    check_accumulation_bound(
        dx[ok], dy[ok].astype(np.float64), weight_bf16(w, scb), n, "float32", tiny=TINY, what="finite rows"
    )


# ------------------------------------------------------------ fp32 dY: the split

SPLIT_SHAPES = [
    (8, 40, 64),
    (17, 77, 320),
    (48, 1536, 256),
    (70, 2001, 128),
    (1100, 96, 192),
]


@pytest.mark.parametrize("m,n,k", SPLIT_SHAPES, ids=[f"{m}x{n}x{k}" for m, n, k in SPLIT_SHAPES])
def test_split_within_the_fp32_bound(rng, m, n, k):
    dy = fp32_input(rng, (m, n))
    w, scb = _weight(rng, n, k)
    dx = grad(dy, w, scb, kernel=SPLIT)
    assert dx.dtype == np.float32 and dx.shape == (m, k)
    check_split(dx, dy, w, scb, "dX")
    # as accurate as the exact contract's sequential sum, or more
    exact = scaled_dy(dy, scb) @ w.astype(np.float64)
    seq = oracle.grad_input_f32(dy, w, scb).astype(np.float64)
    assert np.abs(dx - exact).max() <= np.abs(seq - exact).max()


@pytest.mark.parametrize("p", [-140, -100, -60, 60, 100])
def test_split_rows_scale_by_powers_of_two(rng, p):
    """Each row is computed at its own power-of-two scale: dY * 2^p gives dX *
    2^p bit for bit, rows of denormals (p = -140, compared with one rounding
    of the scaled-up result) included; the other rows' bytes do not move."""
    m, n, k = 16, 96, 128
    dy = fp32_input(rng, (m, n))
    w, scb = _weight(rng, n, k)
    base = grad(dy, w, scb, kernel=SPLIT)
    scaled = dy.copy()
    scaled[3] = (dy[3].astype(np.float64) * 2.0**p).astype(np.float32)
    if p == -140:  # dY and g denormal: compare with the exact product's bound instead
        got = grad(scaled, w, scb, kernel=SPLIT)
        check_split(got[3:4], scaled[3:4], w, scb, "denormal row")
    else:
        got = grad(scaled, w, scb, kernel=SPLIT)
        want = (base[3].astype(np.float64) * 2.0**p).astype(np.float32)
        assert np.array_equal(inputs.bits(got[3]), inputs.bits(want))
    assert np.array_equal(inputs.bits(np.delete(got, 3, 0)), inputs.bits(np.delete(base, 3, 0)))


@pytest.mark.parametrize("value", [1e-40, 1e-35, 2.0**-61, 2.0**-59, 3e36, 0.0])
def test_split_single_extreme_elements(rng, value):
    """Tiny and huge single elements (the tails of GELU and SiLU gradients)
    stay on the split, within the bound plus the dropped term; the other
    rows' bytes are those of the call without the element."""
    m, n, k = 12, 64, 128
    dy = fp32_input(rng, (m, n))
    w, scb = _weight(rng, n, k)
    base = grad(dy, w, scb, kernel=SPLIT)
    dy2 = dy.copy()
    dy2[5, 9] = np.float32(value)
    got = grad(dy2, w, scb, kernel=SPLIT)
    check_split(got, dy2, w, scb, f"element {value}")
    assert np.array_equal(inputs.bits(np.delete(got, 5, 0)), inputs.bits(np.delete(base, 5, 0)))


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_split_declines_non_finite_rows(rng, bad):
    """A NaN or infinity in dY: the exact contract's kernel computes the call (its bytes)."""
    m, n, k = 64, 48, 128
    dy = fp32_input(rng, (m, n))
    dy[7, 3] = bad
    w, scb = _weight(rng, n, k)
    dx = grad(dy, w, scb, kernel="avx512.int8_grad")
    assert np.array_equal(inputs.bits(dx), inputs.bits(oracle.grad_input_f32(dy, w, scb)))


# ------------------------------------------------------------ both kernels


@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("out_dtype", ["bfloat16", "float16"])
def test_narrow_outputs_are_the_fp32_result_rounded_once(rng, kind, out_dtype):
    sample, kernel = KINDS[kind]
    dy = sample(rng, (40, 200))
    w, scb = _weight(rng, 200, 128)
    want = inputs.to_dtype(grad(dy, w, scb, kernel=kernel), out_dtype)
    got = grad(dy, w, scb, out_dtype, kernel=kernel)
    assert got.dtype == want.dtype and np.array_equal(inputs.bits(got), inputs.bits(want))


# dY read in place; in place with a 16-row tail group; packed (the bf16 kernel; the split always packs)
@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("n", [128, 96, 1600])
def test_rows_are_independent(rng, kind, n):
    sample, kernel = KINDS[kind]
    w, scb = _weight(rng, n, 256)
    call = lambda g: q4.int8_grad_input(g, w, scb, out_dtype="float32")  # noqa: E731
    check_rows_independent(rng, call, sample(rng, (100, n)), 20, OP, kernel)


@pytest.mark.parametrize("kind", list(KINDS))
def test_thread_counts_give_the_same_bytes(rng, kind):
    sample, kernel = KINDS[kind]
    dy = sample(rng, (300, 400))
    w, scb = _weight(rng, 400, 576)
    outs = []
    try:
        for threads in (1, 2, 3):
            q4.set_num_threads(threads)
            outs.append(grad(dy, w, scb, kernel=kernel))
    finally:
        q4.set_num_threads(0)
    assert all(np.array_equal(inputs.bits(o), inputs.bits(outs[0])) for o in outs[1:])
