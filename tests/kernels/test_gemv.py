"""Batch-1 fused 4-bit gemv on every CPU level (the AVX-512 unit has its own
128- and 64-element chunk paths): against the fp64 product with the
dequantized weight, within the fp32 rounding bound (k+2) u sum|x||w|, over
block sizes that split a chunk into 1, 2 or 4 scales and blocks larger than
a row (rows start inside a block)."""

import numpy as np
import pytest
from q4_reference.matmul import quantized_weight

import q4

U32 = np.finfo(np.float32).eps / 2


def _weight(rng, n, k, blocksize, quant_type, nested):
    packed, state, w = quantized_weight(rng, n, k, blocksize, quant_type, nested, scale=0.05)
    return packed, state, w.astype(np.float64)


@pytest.mark.parametrize("k", [64, 128, 192, 384, 1024])
@pytest.mark.parametrize("blocksize", [32, 64, 128, 256, 4096])
@pytest.mark.parametrize("quant_type, nested", [("nf4", True), ("fp4", False)])
def test_gemv_within_fp32_bound(isa_all, rng, k, blocksize, quant_type, nested):
    n = 37  # odd: a single-row tail
    packed, state, w = _weight(rng, n, k, blocksize, quant_type, nested)
    x = rng.standard_normal((1, k)).astype(np.float32)
    bias = rng.standard_normal(n).astype(np.float32)
    y = q4.gemm_4bit(x, packed, state, bias=bias).astype(np.float64)
    want = x.astype(np.float64) @ w.T + bias
    bound = (k + 2) * U32 * (np.abs(x).astype(np.float64) @ np.abs(w).T + np.abs(bias))
    assert np.all(np.abs(y - want) <= bound), (np.abs(y - want) / bound).max()


def test_gemv_thread_count_does_not_change_bits(rng):
    packed, state, _ = _weight(rng, 301, 1024, 64, "nf4", True)
    x = rng.standard_normal((1, 1024)).astype(np.float32)
    outs = []
    for t in (1, 2, 3):
        q4.set_num_threads(t)
        try:
            outs.append(q4.gemm_4bit(x, packed, state).tobytes())
        finally:
            q4.set_num_threads(0)
    assert outs[0] == outs[1] == outs[2]


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_gemv_every_row_count(isa_all, rng, threads):
    """Each row within the bound whatever the row count and thread count: the
    AVX-512 gemv cuts each thread's rows into four equal runs read side by side
    and takes the rows left over one at a time, so every count from 1 to 9, and
    counts that leave 1-3 rows over in a thread's last chunk, are checked row by
    row; and the bytes do not depend on the thread count."""
    q4.set_num_threads(threads)
    try:
        for n in (*range(1, 10), 37, 66, 131, 301):
            packed, state, w = _weight(rng, n, 256, 64, "nf4", True)
            x = rng.standard_normal((1, 256)).astype(np.float32)
            y = q4.gemm_4bit(x, packed, state).astype(np.float64)
            want = x.astype(np.float64) @ w.T
            bound = 258 * U32 * (np.abs(x).astype(np.float64) @ np.abs(w).T)
            assert np.all(np.abs(y - want) <= bound), (n, np.abs(y - want) / bound)
            q4.set_num_threads(1)
            assert q4.gemm_4bit(x, packed, state).tobytes() == y.astype(np.float32).tobytes(), n
            q4.set_num_threads(threads)
    finally:
        q4.set_num_threads(0)
