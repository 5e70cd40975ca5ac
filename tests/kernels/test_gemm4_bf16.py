"""bf16-compute fused 4-bit matmuls (the avx512_bf16 kernels), through q4's
numpy API, against an fp64 oracle of their contract.

The contract (kernels/cpu/x86/avx512_bf16/gemm4.cc): each W element is its
fp32 value decode(nibble) * scale(block) -- what dequantize_4bit returns --
rounded once to bf16 (round to nearest even); products of the bf16 input and
bf16 W are summed in fp32; the bias is added in fp32; the sum is rounded once
to the output dtype. The oracle below is written from that definition and
tests/q4_reference/oracle.py's dequantize, not from the kernels.

Error bound, derived: every product of two bf16 values is exact in fp32 (8 + 8
significand bits), so the fp32 result is a sum of L exact terms (L = the
reduction length, plus the bias) in some order, at most L - 1 roundings on
any path: |acc - exact| <= gamma_L * sum|terms|, gamma_L = L u / (1 - L u),
u = 2^-24; (L + 2) u covers gamma_L for every L used here. vdpbf16ps and
the bf16 conversion treat denormal inputs as zero -- the contract: input and
W values below 2^-126 in magnitude count as zero, which the oracle applies --
and flush denormal results, which moves each of at most L + 2 operations by
less than 2^-126: an absolute (L + 2) * 2^-126. The final rounding to the
output dtype adds at most u_out * |acc| (u_out = 2^-8 for bf16, 2^-11 for
fp16, 0 for fp32, as acc is already fp32).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from q4_reference.bf16_gemm import (
    BF16,
    FORMATS,
    KERNEL_FWD,
    KERNEL_GRAD,
    TINY,
    WIDE_SEGMENTS,
    bf16_exact,
    bf16_input,
    check,
    check_thread_counts_agree,
    forward,
    grad,
    last_kernels,
    wide_weight,
)
from q4_reference.matmul import quantized_weight as make_weight

import q4

# every test on the avx512_bf16 level (whatever Q4_ISA says), all threads; not run,
# named, on a processor without it
ISA = "avx512_bf16"
pytestmark = pytest.mark.usefixtures("module_isa")


# m covers the gemv path (m <= 24: one pass for m <= 4, W row pairs against 5-8
# x rows, else x groups of <= 4 rows, up to the largest) and the tiled path
# (panels of 16 rows, partial panels; m <= 32 decodes the next W tile inside
# the dot products); n and k are not multiples of any tile size (but k % 64 ==
# 0, the kernels' condition).
BATCHES = (1, 2, 3, 5, 8, 17, 24, 25, 64, 130)


@pytest.mark.parametrize("quant_type, nested, blocksize", FORMATS)
@pytest.mark.parametrize("out_dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("k", [320, 384])  # one or two x rows: 64-element chunks, or 128 (k % 128 == 0)
def test_forward_matches_oracle(rng, quant_type, nested, blocksize, out_dtype, k):
    n = 77  # k % blocksize != 0 for 256 / 4096: blocks straddle rows
    packed, state, w32 = make_weight(rng, n, k, blocksize, quant_type, nested)
    for i, m in enumerate(BATCHES):
        x = bf16_input(rng, (m, k))
        bias = None
        if i % 3 == 1:
            bias = bf16_input(rng, (n,))
        elif i % 3 == 2:
            bias = (rng.standard_normal(n) * 3).astype(np.float32)
        forward(
            x, packed, state, w32, out_dtype, bias, what=f"forward m={m} bias={None if bias is None else bias.dtype}"
        )


@pytest.mark.parametrize("quant_type, nested, blocksize", FORMATS)
@pytest.mark.parametrize("out_dtype", ["float32", "bfloat16"])
def test_grad_input_matches_oracle(rng, quant_type, nested, blocksize, out_dtype):
    n, k = 77, 320  # n odd: the last pair of W rows is padded with zeros
    packed, state, w32 = make_weight(rng, n, k, blocksize, quant_type, nested)
    for m in BATCHES:
        g = bf16_input(rng, (m, n))
        grad(g, packed, state, w32, out_dtype, what=f"grad m={m}")


@pytest.mark.parametrize(
    "m, n, k, blocksize",
    [
        (1, 130, 4160, 64),  # one x row, k = 65 chunks
        (1, 130, 4224, 64),  # one x row by 128-element chunks (two blocks each), a last partial W row group
        (1, 45, 640, 128),  # one x row by 128-element chunks, one block each
        (1, 29, 1408, 256),  # one x row by 128-element chunks, blocks straddle rows
        (2, 130, 4224, 64),  # two x rows by 128-element chunks, a last partial W row group
        (2, 29, 1408, 256),  # two x rows by 128-element chunks, blocks straddle rows
        (8, 300, 1088, 32),  # gemv, 8 x rows: W row pairs against all of them, one k segment anywhere
        (7, 61, 4160, 32),  # gemv, 7 x rows (48 KiB L1D: k segments 2304 + 1856), two scales per chunk
        (6, 45, 5696, 256),  # gemv, 6 x rows (48 KiB L1D: k segments 2688 x 2 + 320), blocks straddle rows
        (5, 130, 6592, 64),  # gemv, 5 x rows (48 KiB L1D: k segments 3264 x 2 + 64), a last partial W row group
        (16, 67, 2112, 128),  # gemv, four x groups
        (29, 300, 1088, 64),  # tiled, two panels: the next W tile decoded inside the dot products
        (130, 300, 1088, 64),  # tiled: partial row tile, partial k tile, panel groups 3 + 3 + 3
        (40, 129, 576, 4096),  # tiled, one partial panel group
        (33, 5, 192, 32),  # tiled, fewer W rows than a register tile
        (3, 1, 64, 64),  # one output column; grad: a single, padded pair of W rows
        (130, 2, 64, 32),  # grad: more dY rows than a register tile, one pair
    ],
)
def test_larger_shapes(rng, m, n, k, blocksize):
    packed, state, w32 = make_weight(rng, n, k, blocksize, "nf4", True)
    x = bf16_input(rng, (m, k))
    bias = bf16_input(rng, (n,))
    forward(x, packed, state, w32, "bfloat16", bias, what=f"forward {(m, n, k)}")
    forward(x, packed, state, w32, "float32", None, what=f"forward {(m, n, k)} fp32 out")
    g = bf16_input(rng, (m, n))
    grad(g, packed, state, w32, "float32", what=f"grad {(m, n, k)}")
    grad(g, packed, state, w32, "bfloat16", what=f"grad {(m, n, k)} bf16 out")


def test_fp16_output(rng):
    packed, state, w32 = make_weight(rng, 40, 192, 64, "nf4", False)
    x = bf16_input(rng, (5, 192), scale=1.0)
    forward(x, packed, state, w32, "float16", what="forward fp16 out")
    g = bf16_input(rng, (70, 40), scale=1.0)
    grad(g, packed, state, w32, "float16", what="grad fp16 out")


def test_large_weight_values(rng):
    """Scales far from 1: W up to ~1e30 and ~1e-30 (bf16 has fp32's range)."""
    for scale in (1e30, 1e-30):
        packed, state, w32 = make_weight(rng, 50, 128, 64, "fp4", False, scale=scale)
        x = bf16_input(rng, (20, 128), scale=1.0)
        forward(x, packed, state, w32, "float32", what=f"forward W scale {scale}")
        grad(bf16_input(rng, (3, 50), scale=1.0), packed, state, w32, "float32", what=f"grad W scale {scale}")


def test_exact_cases(rng):
    """W = identity (codes +-1 times absmax 1, exact in bf16): y = x and dX = dY
    exactly; a zero weight gives exact zeros."""
    for quant_type in ("nf4", "fp4"):
        for m in (1, 4, 7, 33):
            k = 128
            packed, absmax = q4.quantize_4bit(np.eye(k, dtype=np.float32), 64, quant_type)
            state = q4.QuantState(quant_type, 64, (k, k), "float32", absmax)
            x = bf16_input(rng, (m, k))
            assert np.array_equal(q4.gemm_4bit(x, packed, state, out_dtype="float32"), x.astype(np.float32))
            assert np.array_equal(q4.gemm_4bit(x, packed, state), x)
            assert np.array_equal(q4.gemm_4bit_grad_input(x, packed, state), x)
    packed, absmax = q4.quantize_4bit(np.zeros((48, 64), np.float32), 64, "nf4")
    state = q4.QuantState("nf4", 64, (48, 64), "float32", absmax)
    y = q4.gemm_4bit(bf16_input(rng, (20, 64)), packed, state, out_dtype="float32")
    assert np.array_equal(y, np.zeros((20, 48), np.float32))


def test_nan_and_inf_inputs_propagate(rng):
    packed, state, w32 = make_weight(rng, 40, 128, 64, "nf4", False)
    for m in (3, 20):  # gemv and tiled
        x = bf16_input(rng, (m, 128))
        x[1, 5] = np.nan
        x[2, 7] = np.inf
        y = q4.gemm_4bit(x, packed, state, out_dtype="float32")
        assert np.isnan(y[1]).all()
        w_col = bf16_exact(w32)[:, 7]
        assert np.array_equal(np.isnan(y[2]), w_col == 0)  # inf * 0 is NaN
        assert np.array_equal(np.sign(y[2][w_col != 0]), np.sign(w_col[w_col != 0]))
        assert np.isfinite(np.delete(y, [1, 2], axis=0)).all()
        g = bf16_input(rng, (m, 40))
        g[1, 3] = np.nan
        dx = q4.gemm_4bit_grad_input(g, packed, state, out_dtype="float32")
        assert np.isnan(dx[1]).all() and np.isfinite(np.delete(dx, 1, axis=0)).all()


def test_denormal_inputs_count_as_zero(rng):
    """bf16 denormals (|x| < 2^-126) count as zero, whatever W is (vdpbf16ps
    treats denormal inputs as zero): with W ~ 2^100 the exact product would be
    ~2^-27, the kernels give exactly 0; the oracle (which flushes them) holds."""
    packed, state, w32 = make_weight(rng, 40, 128, 64, "nf4", False, scale=2.0**100)
    x = (rng.standard_normal((6, 128)) * 1e-39).astype(np.float32).astype(BF16)
    assert np.all(np.abs(x.astype(np.float64)) < TINY) and np.any(x.astype(np.float64) != 0)
    y = forward(x, packed, state, w32, "float32", what="denormal x")
    assert np.array_equal(y, np.zeros_like(y))
    xm = bf16_input(rng, (6, 128))
    xm[:, ::2] = x[:, ::2]  # mixed: the normal half is still summed exactly as specified
    forward(xm, packed, state, w32, "float32", what="mixed denormal x")
    g = (rng.standard_normal((3, 40)) * 1e-39).astype(np.float32).astype(BF16)
    assert np.array_equal(
        q4.gemm_4bit_grad_input(g, packed, state, out_dtype="float32"), np.zeros((3, 128), np.float32)
    )


@pytest.mark.parametrize("m", [1, 2, 3, 8, 16, 17, 29, 130])
def test_bit_identical_across_thread_counts(rng, m):
    # 1-2 rows: 128-element chunks; 8: two k segments on a 48 KiB L1D
    check_thread_counts_agree(rng, m, 203, {1: 1280, 2: 1280, 8: 4288}.get(m, 1216), (KERNEL_FWD, KERNEL_GRAD))


# 5-8 x rows ("wide") split k into segments of x only on a processor with a
# 48 KiB L1D (gemm4.cc kWideSegmentL1d); Q4_L1D_BYTES stands in for the cache
# size, so both ways run on any processor: (m, n, k) and the segments they make.
def wide_outputs(l1d_bytes: int, inputs: Path, tmp_path: Path) -> dict:
    """The wide shapes' forward outputs for the bf16 x rows saved in `inputs`
    (x0, x1, ... as their uint16 bits: npz keeps no bf16 dtype), from a fresh
    process that takes the L1D to be l1d_bytes (the size is read once per
    process)."""
    out = tmp_path / f"wide_{l1d_bytes}.npz"
    code = (
        "import numpy as np\n"
        "import q4\n"
        "from q4_reference.bf16_gemm import BF16, WIDE_SEGMENTS, wide_weight\n"
        "q4.set_cpu_isa('avx512_bf16')\n"
        "res = {'l1d': np.int64(q4.cpu_features()['l1d_bytes'])}\n"
        f"xs = np.load({str(inputs)!r})\n"
        "for i in range(len(WIDE_SEGMENTS)):\n"
        "    packed, state, _ = wide_weight(i)\n"
        "    res[f'y{i}'] = q4.gemm_4bit(xs[f'x{i}'].view(BF16), packed, state, out_dtype='float32')\n"
        "    assert q4.cpu_features()['last_kernel']['gemm_4bit'] == 'avx512_bf16.gemm4'\n"
        f"np.savez({str(out)!r}, **res)\n"
    )
    tests_dir = str(Path(__file__).resolve().parents[1])
    env = dict(os.environ, Q4_L1D_BYTES=str(l1d_bytes))
    env["PYTHONPATH"] = os.pathsep.join([tests_dir, *filter(None, [env.get("PYTHONPATH")])])
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    assert result.returncode == 0, result.stderr
    with np.load(out) as f:
        return dict(f)


def test_wide_k_segments_change_no_bit(rng, tmp_path):
    """Batch 5-8 computes the same bits with k in segments (a 48 KiB L1D) and
    in one pass (32 KiB): a segment's partial sums are stored and reloaded
    exactly, the additions stay in order. Both are also checked against the
    oracle here, in this process (as detected)."""
    xs = {f"x{i}": bf16_input(rng, (m, k)) for i, (m, _, k) in enumerate(WIDE_SEGMENTS)}
    inputs = tmp_path / "wide_x.npz"
    np.savez(inputs, **{name: x.view(np.uint16) for name, x in xs.items()})
    seg, one = wide_outputs(48 << 10, inputs, tmp_path), wide_outputs(32 << 10, inputs, tmp_path)
    assert int(seg["l1d"]) == 48 << 10 and int(one["l1d"]) == 32 << 10
    for i, (m, n, k) in enumerate(WIDE_SEGMENTS):
        packed, state, w32 = wide_weight(i)
        y = forward(xs[f"x{i}"], packed, state, w32, "float32", what=f"wide {(m, n, k)}")
        assert seg[f"y{i}"].tobytes() == one[f"y{i}"].tobytes() == y.tobytes(), (m, n, k)


def test_misaligned_inputs(rng):
    """Inputs at an address that is 2 mod 4 (the kernels read pairs of bf16)."""
    n, k = 64, 128
    packed, state, w32 = make_weight(rng, n, k, 64, "nf4", False)
    for m in (2, 20):
        x = bf16_input(rng, (m, k))
        buf = np.zeros(x.nbytes + 8, np.uint8)
        xm = buf[2 : 2 + x.nbytes].view(BF16).reshape(m, k)
        xm[...] = x
        assert xm.ctypes.data % 4 == 2
        assert np.array_equal(q4.gemm_4bit(xm, packed, state), q4.gemm_4bit(x, packed, state))
        g = bf16_input(rng, (m, n))
        gm = buf[2 : 2 + g.nbytes].view(BF16).reshape(m, n)
        gm[...] = g
        assert np.array_equal(q4.gemm_4bit_grad_input(gm, packed, state), q4.gemm_4bit_grad_input(g, packed, state))


def test_declined_shapes_fall_back_to_fp32(rng):
    """k % 64 != 0 is not served by the bf16 kernels: the fp32 kernels run
    (W not rounded to bf16) and keep their fp32 bound."""
    n, k = 70, 96
    packed, state, w32 = make_weight(rng, n, k, 32, "nf4", True)
    w64 = w32.astype(np.float64)
    for m in (1, 9):
        x = bf16_input(rng, (m, k))
        y = q4.gemm_4bit(x, packed, state, out_dtype="float32")
        assert last_kernels()["gemm_4bit"] not in ("", KERNEL_FWD)
        check(y, x.astype(np.float64), w64.T, k, "float32", what=f"declined forward m={m}")
        g = bf16_input(rng, (m, n))
        dx = q4.gemm_4bit_grad_input(g, packed, state, out_dtype="float32")
        assert last_kernels()["gemm_4bit_grad_input"] not in ("", KERNEL_GRAD)
        check(dx, g.astype(np.float64), w64, n, "float32", what=f"declined grad m={m}")


def test_other_input_dtypes_are_not_served(rng):
    packed, state, _ = make_weight(rng, 32, 64, 64, "nf4", False)
    for dtype in (np.float32, np.float16):
        q4.gemm_4bit(np.ones((2, 64), dtype), packed, state)
        assert last_kernels()["gemm_4bit"] != KERNEL_FWD
        q4.gemm_4bit_grad_input(np.ones((2, 32), dtype), packed, state)
        assert last_kernels()["gemm_4bit_grad_input"] != KERNEL_GRAD
