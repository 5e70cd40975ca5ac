"""The bf16-compute matmul contract as checks (kernels/cpu/x86/avx512_bf16/gemm4.cc,
the tile unit's kernels): W decoded to fp32 (oracle.py's dequantize) and rounded once to
bf16, products summed in fp32, denormals as zero, one rounding to the output dtype.
tests/kernels/test_gemm4_bf16.py's docstring derives the bound `check` applies; the
kernel test modules share these helpers through this package, never through each other."""

from __future__ import annotations

import ml_dtypes
import numpy as np

import q4

from .matmul import check_accumulation_bound
from .matmul import quantized_weight as make_weight

BF16 = ml_dtypes.bfloat16
TINY = 2.0**-126
NP_DTYPE = {"float32": np.float32, "bfloat16": BF16, "float16": np.float16}
KERNEL_FWD, KERNEL_GRAD = "avx512_bf16.gemm4", "avx512_bf16.grad4"


def last_kernels() -> dict:
    return q4.cpu_features()["last_kernel"]


def flush(a64: np.ndarray) -> np.ndarray:
    """Values below 2^-126 in magnitude (denormals) as zero."""
    return np.where(np.abs(a64) < TINY, 0.0, a64)


def bf16_exact(a) -> np.ndarray:
    """fp32 values rounded once to bf16 (nearest even), as fp64, denormals as zero."""
    return flush(np.asarray(a, np.float32).astype(BF16).astype(np.float64))


def check(got, a64, b64, length, out_dtype, bias=None, what=""):
    """got ~ a64 @ b64 (+ bias) within the contract's bound (module docstring)."""
    check_accumulation_bound(got, a64, b64, length, out_dtype, bias, TINY, what)


def forward(x, packed, state, w32, out_dtype, bias=None, what="", kernel=KERNEL_FWD):
    y = q4.gemm_4bit(x, packed, state, bias=bias, out_dtype=out_dtype)
    assert y.dtype == NP_DTYPE[out_dtype]
    assert last_kernels()["gemm_4bit"] == kernel, what
    check(y, flush(x.astype(np.float64)), bf16_exact(w32).T, x.shape[1], out_dtype, bias, what)
    return y


def grad(g, packed, state, w32, out_dtype, what="", kernel=KERNEL_GRAD):
    dx = q4.gemm_4bit_grad_input(g, packed, state, out_dtype=out_dtype)
    assert dx.dtype == NP_DTYPE[out_dtype]
    assert last_kernels()["gemm_4bit_grad_input"] == kernel, what
    check(dx, flush(g.astype(np.float64)), bf16_exact(w32), g.shape[1], out_dtype, None, what)
    return dx


def bf16_input(rng, shape, scale=3.0):
    return (rng.standard_normal(shape) * scale).astype(np.float32).astype(BF16)


FORMATS = [(qt, nested, bs) for qt in ("nf4", "fp4") for nested in (False, True) for bs in (32, 64, 256, 4096)]


def check_thread_counts_agree(rng, m, n, k, kernels=None, sample=bf16_input):
    """The forward (fp32 and the input's dtype out, with a bias) and the input
    gradient on 1, 2 and 3 threads: the same bytes each time; `kernels`
    (forward, gradient), when given, are the kernels that must have run;
    sample(rng, shape) makes the inputs (bf16 by default)."""
    packed, state, _ = make_weight(rng, n, k, 64, "nf4", True)
    x = sample(rng, (m, k))
    g = sample(rng, (m, n))
    bias = sample(rng, (n,))
    outs = []
    for threads in (1, 2, 3):
        q4.set_num_threads(threads)
        outs.append(
            (
                q4.gemm_4bit(x, packed, state, bias=bias, out_dtype="float32"),
                q4.gemm_4bit(x, packed, state),
                q4.gemm_4bit_grad_input(g, packed, state, out_dtype="float32"),
            )
        )
        if kernels is not None:
            assert (last_kernels()["gemm_4bit"], last_kernels()["gemm_4bit_grad_input"]) == kernels
    for other in outs[1:]:
        for a, b in zip(outs[0], other, strict=True):
            assert a.tobytes() == b.tobytes()


WIDE_SEGMENTS = [(8, 67, 4288), (7, 61, 4160), (5, 130, 6592)]  # 2048 x 2 + 192; 2304 + 1856; 3264 x 2 + 64


def wide_weight(i: int):
    """Weight i of WIDE_SEGMENTS (packed, state, w32), the same in every process."""
    _, n, k = WIDE_SEGMENTS[i]
    return make_weight(np.random.default_rng(100 + i), n, k, 64, "nf4", True)


def check_rows_independent(rng, call, a, cut, op, kernel):
    """call(a) computes each output row from its row of a alone, in one
    order, wherever the row sits (read in place, or in the packed rows after
    the last whole 32-row pair): permuting the rows permutes the output
    bytes, and the rows from `cut` on have the same bytes in a shorter batch;
    `kernel` ran op each time."""

    def run(b):
        out = call(b)
        assert last_kernels()[op] == kernel, len(b)
        return out

    y = run(a)
    perm = rng.permutation(len(a))
    assert run(a[perm]).tobytes() == y[perm].tobytes()
    assert run(a[cut:]).tobytes() == y[cut:].tobytes()
