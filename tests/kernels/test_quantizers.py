"""The error-minimising 4-bit quantizers (q4/_src/quantizers.py: mse, gptq)
against an independent oracle (tests/q4_reference/oracle.py's encoder and
dequantizer, written from the format), the plain kernel, and bitsandbytes'
decoder: the bytes are the bitsandbytes format, every block's scale is the
best candidate, and GPTQ lowers the calibration error."""

from __future__ import annotations

import numpy as np
import pytest
from q4_reference import oracle

import q4
from q4._src import quantizers as Q
from q4._src.kernels import encode_4bit, quantize_4bit, search_scales_4bit
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
def test_search_scales_equals_the_oracle_on_every_path(rng, isa, quant_type, blocksize):
    """The kernel's scale search (scalar and AVX2 paths) equals the oracle of
    its contract bit for bit, special blocks included."""
    w = weight(rng, (40, 384)).reshape(-1, blocksize)
    w[0] = 0.0  # all zero: keeps 0
    w[1, 3] = np.nan  # NaN: keeps NaN
    w[2, 5] = np.inf
    w[3] *= 1e-30  # tiny
    w[4] *= 1e30  # huge
    w[5, : blocksize // 2] = 0.0
    got = search_scales_4bit(w, quant_type)
    want = np.array([oracle.mse_scale(b, quant_type) for b in w], np.float32)
    np.testing.assert_array_equal(got, want)
    assert q4.cpu_features()["isa"] == isa


@pytest.mark.parametrize("quant_type", TYPES)
@pytest.mark.parametrize("blocksize", [32, 64, 128])
@pytest.mark.parametrize("nested", [False, True], ids=["plain", "nested"])
def test_mse_picks_the_best_candidate_per_block(rng, quant_type, blocksize, nested):
    w = weight(rng, (40, 384))
    packed, state = Q.quantize_mse(w, blocksize, quant_type, nested=False)
    s = state.absmax
    x = w.reshape(-1, blocksize)
    amax = np.abs(x).max(1)
    cands = np.stack([oracle.mse_errors(b, quant_type)[0] for b in x])
    errs = np.stack([oracle.mse_errors(b, quant_type)[1] for b in x])
    first = errs.argmin(1)
    np.testing.assert_array_equal(s, cands[np.arange(len(s)), first])  # the best, ties: the larger scale
    # fp64 errors (independent of the search's own sum): never worse than absmax, clearly better overall
    chosen, plain = block_errors(x, s, quant_type), block_errors(x, amax, quant_type)
    assert (chosen <= plain * (1 + 1e-6)).all() and chosen.sum() < 0.95 * plain.sum()
    # the bytes are the codes for the chosen scales (oracle), bitsandbytes' where absmax stays
    deq = oracle.dequantize_4bit(packed, s, w.size, blocksize, quant_type).reshape(-1, blocksize)
    for b in range(len(s)):
        inv = np.float32(1) / s[b]
        codes = oracle.encode4((x[b] * inv).astype(np.float32), quant_type)
        np.testing.assert_array_equal(deq[b], (oracle.TABLES[quant_type][codes] * s[b]).astype(np.float32))
    plain_bytes = quantize_4bit(w, blocksize, quant_type)[0].reshape(len(s), -1)
    np.testing.assert_array_equal(packed.reshape(len(s), -1)[first == 0], plain_bytes[first == 0])
    if nested:
        packed_n, state_n = Q.quantize_mse(w, blocksize, quant_type, nested=True)
        np.testing.assert_array_equal(packed_n, packed)  # codes from the fp32 scale, as the plain path does
        assert state_n.nested and state_n.absmax.dtype == np.uint8


@pytest.mark.parametrize("quant_type", TYPES)
def test_kernel_encode_equals_the_oracle_on_every_path(rng, isa, quant_type):
    x = weight(rng, (24, 128)).reshape(-1, 64)
    x[0, :5] = [np.nan, np.inf, -np.inf, 0.0, -0.0]
    s = (np.abs(x[:, :8]).max(1) * 0.7 + 0.01).astype(np.float32)
    got = encode_4bit(x, s, quant_type)
    want = Q.pack(Q.encode(x, s[:, None], quant_type)).reshape(-1)
    np.testing.assert_array_equal(got, want)
    for b in range(x.shape[0]):  # and the oracle's encoder
        with np.errstate(invalid="ignore"):
            codes = oracle.encode4((x[b] * (np.float32(1) / s[b])).astype(np.float32), quant_type)
        np.testing.assert_array_equal(got[b * 32 : (b + 1) * 32], (codes[0::2] << 4) | codes[1::2])


def test_search_scales_refuses_bad_input():
    with pytest.raises(ValueError, match="blocksize must be a power of two"):
        search_scales_4bit(np.zeros((2, 48), np.float32), "nf4")
    with pytest.raises(ValueError, match="2-D"):
        search_scales_4bit(np.zeros(64, np.float32), "nf4")
    with pytest.raises(ValueError, match="nf5"):
        search_scales_4bit(np.zeros((1, 64), np.float32), "nf5")
    assert search_scales_4bit(np.zeros((0, 64), np.float32), "nf4").shape == (0,)
    with pytest.raises(ValueError, match=r"got \(2, 64\) and \(3,\)"):
        encode_4bit(np.zeros((2, 64), np.float32), np.ones(3, np.float32), "nf4")


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
