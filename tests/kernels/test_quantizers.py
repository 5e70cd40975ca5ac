"""The error-minimising 4-bit quantizers (q4/_src/quantizers.py: mse, gptq)
against an independent oracle (tests/reference/oracle.py's encoder and
dequantizer, written from the format), the plain kernel, and bitsandbytes'
decoder: the bytes are the bitsandbytes format, every block's scale is the
best candidate, and GPTQ lowers the calibration error."""

from __future__ import annotations

import numpy as np
import pytest
from reference import oracle

from q4._src import quantizers as Q
from q4._src.kernels import quantize_4bit
from q4._src.weights import dequantize_weight_4bit

TYPES = ["nf4", "fp4"]


def weight(rng, shape, heavy=True):
    w = rng.standard_normal(shape).astype(np.float32)
    if heavy:  # a few outliers per row, where clipping pays
        idx = rng.integers(0, w.size, w.size // 50)
        w.reshape(-1)[idx] *= 6
    return w


def block_errors(x, s, quant_type):
    """fp64 squared error of each block row of x [nb, bs] encoded with scale s [nb] (oracle)."""
    out = []
    for row, sc in zip(x, s, strict=True):
        inv = np.float32(1) / max(np.float32(sc), np.float32(1e-38))
        codes = oracle.encode4((row * inv).astype(np.float32), quant_type)
        deq = (oracle.TABLES[quant_type][codes] * np.float32(sc)).astype(np.float32)
        out.append(float(((row.astype(np.float64) - deq) ** 2).sum()))
    return np.array(out)


@pytest.mark.parametrize("quant_type", TYPES)
def test_encode_is_the_formats_rule(rng, quant_type):
    x = rng.standard_normal((64, 64)).astype(np.float32) * 3
    x[0, :6] = [0.0, -0.0, np.nan, np.inf, -np.inf, 1e-30]
    s = np.abs(x[:, :1]) + 0.5
    got = Q.encode(x, s, quant_type)
    inv = (np.float32(1) / s).astype(np.float32)
    for r in range(x.shape[0]):
        with np.errstate(invalid="ignore"):
            want = oracle.encode4((x[r] * inv[r]).astype(np.float32), quant_type)
        np.testing.assert_array_equal(got[r], want)


@pytest.mark.parametrize("quant_type", TYPES)
@pytest.mark.parametrize("blocksize", [32, 64, 256])
def test_encode_with_absmax_gives_the_kernels_bytes(rng, quant_type, blocksize):
    w = weight(rng, (48, 512))
    packed, absmax = quantize_4bit(w, blocksize, quant_type)
    blocks = w.reshape(-1, blocksize)
    mine = Q.pack(Q.encode(blocks, np.abs(blocks).max(1, keepdims=True), quant_type))
    np.testing.assert_array_equal(mine.reshape(-1), packed.reshape(-1))


@pytest.mark.parametrize("quant_type", TYPES)
@pytest.mark.parametrize("blocksize", [32, 64, 128])
@pytest.mark.parametrize("nested", [False, True], ids=["plain", "nested"])
def test_mse_picks_the_best_candidate_per_block(rng, quant_type, blocksize, nested):
    w = weight(rng, (40, 384))
    packed, state = Q.quantize_mse(w, blocksize, quant_type, nested=False)
    s = state.absmax
    x = w.reshape(-1, blocksize)
    amax = np.abs(x).max(1)
    cands = (amax[:, None] * Q.MSE_CANDIDATES[None, :]).astype(np.float32)
    assert all(s[b] in cands[b] for b in range(len(s)))
    errs = np.stack([block_errors(x, cands[:, j], quant_type) for j in range(cands.shape[1])], 1)
    chosen = block_errors(x, s, quant_type)
    np.testing.assert_array_equal(chosen, errs.min(1))
    # ties keep the larger scale
    first = errs.argmin(1)
    np.testing.assert_array_equal(s, cands[np.arange(len(s)), first])
    # the bytes decode (oracle) to the chosen values, and never lose to the plain absmax
    deq = oracle.dequantize_4bit(packed, s, w.size, blocksize, quant_type)
    plain = block_errors(x, amax, quant_type)
    assert (chosen <= plain).all() and chosen.sum() < 0.95 * plain.sum()
    assert np.array_equal(deq.reshape(-1, blocksize)[first == 0], oracle.dequantize_4bit(
        *quantize_4bit(w, blocksize, quant_type), w.size, blocksize, quant_type
    ).reshape(-1, blocksize)[first == 0])  # fmt: skip
    if nested:
        packed_n, state_n = Q.quantize_mse(w, blocksize, quant_type, nested=True)
        np.testing.assert_array_equal(packed_n, packed)  # codes from the fp32 scale, as the plain path does
        assert state_n.nested and state_n.absmax.dtype == np.uint8


def test_mse_partial_block_and_odd_sizes_follow_the_kernel(rng):
    w = weight(rng, (7, 37))  # 259 elements: blocks of 64 and a partial block, odd count
    packed, state = Q.quantize_mse(w, 64, "nf4", nested=False)
    kp, ka = quantize_4bit(w, 64, "nf4")
    assert packed.shape == kp.shape
    np.testing.assert_array_equal(packed.reshape(-1)[-2:], kp.reshape(-1)[-2:])  # partial block: plain
    assert state.absmax[-1] == ka[-1]


def test_bitsandbytes_decodes_mse_bytes(rng):
    import torch
    from bitsandbytes.functional import QuantState as BnbState
    from bitsandbytes.functional import dequantize_4bit as bnb_dequantize

    w = weight(rng, (64, 256))
    packed, state = Q.quantize_mse(w, 64, "nf4", nested=False)
    bstate = BnbState(
        absmax=torch.from_numpy(state.absmax), shape=torch.Size(w.shape), blocksize=64, quant_type="nf4",
        dtype=torch.float32, code=torch.from_numpy(oracle.TABLES["nf4"]),
    )  # fmt: skip
    got = bnb_dequantize(torch.from_numpy(packed), bstate).numpy()
    np.testing.assert_array_equal(got, dequantize_weight_4bit(packed, state))


@pytest.mark.parametrize("quant_type", TYPES)
@pytest.mark.parametrize("scales", ["mse", "absmax"])
def test_gptq_with_an_uncorrelated_hessian_is_blockwise_rounding(rng, quant_type, scales):
    """H = c I: no error is fed forward, so GPTQ is the per-block quantizer."""
    w = weight(rng, (32, 256))
    packed, state = Q.gptq(w, np.eye(256) * 3.0, 64, quant_type, nested=False, scales=scales)
    want = Q.quantize_mse(w, 64, quant_type, False) if scales == "mse" else quantize_4bit(w, 64, quant_type)
    want_absmax = want[1].absmax if scales == "mse" else want[1]
    np.testing.assert_array_equal(packed.reshape(-1), want[0].reshape(-1))
    np.testing.assert_array_equal(state.absmax, want_absmax)


@pytest.mark.parametrize("quant_type", TYPES)
def test_gptq_lowers_the_calibration_error(rng, quant_type):
    n_in = 256
    mix = rng.standard_normal((n_in, n_in)) / np.sqrt(n_in)
    x = rng.standard_normal((2048, n_in)) @ (np.eye(n_in) + 2 * mix)  # correlated inputs
    w = weight(rng, (64, n_in), heavy=False)
    h = x.T @ x

    def out_err(packed, state):
        return np.linalg.norm((w.astype(np.float64) - dequantize_weight_4bit(packed, state)) @ x.T)

    plain = (
        out_err(*Q.quantize_mse(w, 64, quant_type, False)),
        out_err(*Q.gptq(w, np.eye(n_in), 64, quant_type, False, scales="absmax")),
    )
    got = out_err(*Q.gptq(w, h, 64, quant_type, nested=True))
    assert got < 0.8 * min(plain), (got, plain)


def test_gptq_refuses_bad_input(rng):
    w = weight(rng, (8, 96))
    with pytest.raises(ValueError, match="multiple of the block size 64, got 96"):
        Q.gptq(w, np.eye(96), 64, "nf4", False)
    with pytest.raises(ValueError, match=r"\[96, 96\] matrix, got shape \(4, 4\)"):
        Q.gptq(w, np.eye(4), 32, "nf4", False)
    h = np.eye(96)
    h[3, 3] = np.nan
    with pytest.raises(ValueError, match="finite"):
        Q.gptq(w, h, 32, "nf4", False)
    with pytest.raises(ValueError, match="scales must be 'mse' or 'absmax', got 'l1'"):
        Q.gptq(w, np.eye(96), 32, "nf4", False, scales="l1")
    with pytest.raises(ValueError, match="damp must be > 0, got 0"):
        Q.gptq(w, np.eye(96), 32, "nf4", False, damp=0)
    with pytest.raises(ValueError, match="method must be one of absmax, mse, gptq, got 'best'"):
        Q.check_method("best")
