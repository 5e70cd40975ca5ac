"""The oracle itself, against brute force from the definitions: so a bug in
the oracle cannot hide a matching bug in the kernels."""

import numpy as np
import pytest

from q4_reference import oracle


@pytest.mark.parametrize("quant_type", ["nf4", "fp4"])
def test_encode4_is_nearest_with_low_tie_break(quant_type):
    table = oracle.TABLES[quant_type]
    rng = np.random.default_rng(0)
    s = np.concatenate([rng.uniform(-1, 1, 5000).astype(np.float32), table, np.float32([0.0, -0.0])])
    codes = oracle.encode4(s, quant_type)
    err = np.abs(table[codes] - s)
    best = np.min(np.abs(table[None, :] - s[:, None]), axis=1)
    assert np.all(err == best)


def test_fp4_table_from_bits():
    # E2M1, bias 2, no inf/nan: bits 1-2 exponent, bit 0 mantissa; exponent 0 is subnormal
    for nibble in range(16):
        sign = -1.0 if nibble & 8 and nibble != 8 else 1.0
        e, m = (nibble >> 1) & 3, nibble & 1
        mags = {(0, 0): 0.0, (0, 1): 0.0625, (1, 0): 8, (1, 1): 12, (2, 0): 4, (2, 1): 6, (3, 0): 2, (3, 1): 3}
        assert oracle.FP4[nibble] == np.float32(sign * mags[(e, m)]) / np.float32(12)


def test_quantize_dequantize_round_trip_error_bound():
    x = np.random.default_rng(1).standard_normal(4096).astype(np.float32)
    for qt, half_gap in (("nf4", 0.1519), ("fp4", 0.1667)):
        packed, absmax = oracle.quantize_4bit(x, 64, qt)
        y = oracle.dequantize_4bit(packed, absmax, x.size, 64, qt)
        assert np.all(np.abs(y - x) <= np.repeat(absmax, 64) * half_gap * (1 + 1e-6))


# ------------------------------------------------------------------ 8-bit and nested


def test_bin_table_is_the_scan():
    """The vectorised table equals the format's construction, a single scan over
    the bins advancing j while mid[j] < pos(k), for sorted, unsorted and
    degenerate books."""
    rng = np.random.default_rng(2)
    books = [
        oracle.dynamic_map(),
        np.linspace(-1, 1, 256).astype(np.float32),
        rng.uniform(-1.5, 1.5, 256).astype(np.float32),  # unsorted
        np.linspace(-1e-6, 1e-6, 256).astype(np.float32),  # far finer than the bins
    ]
    pos = oracle.bin_positions()
    for code in books:
        mids = ((code[:-1] + code[1:]) * np.float32(0.5)).astype(np.float32)
        table = np.empty(oracle.BINS, np.uint8)
        j = 0
        for k in range(oracle.BINS):
            while j < 255 and mids[j] < pos[k]:
                j += 1
            table[k] = j
        assert np.array_equal(oracle.bin_table(code), table)


def test_bin_positions_from_integers():
    k = np.arange(oracle.BINS)
    assert oracle.bin_positions()[0] == -1 and oracle.bin_positions()[-1] == 1
    assert np.all(np.diff(oracle.bin_positions()) >= 0)
    # fp32(2k / 65535) - 1, each step one fp32 rounding (2k and the division are exact in fp64 before rounding)
    want = (np.float32(2.0 * k / 65535.0) - np.float32(1)).astype(np.float32)
    assert np.array_equal(oracle.bin_positions(), want)


def test_bins_of_rounds_once():
    """bins_of against exact rational arithmetic: trunc(round_to_fp32(65535 t + 1/2))."""
    from fractions import Fraction

    rng = np.random.default_rng(3)
    pos_edges = ((np.arange(0, 65535, 97) + 0.5) * 2.0 / 65535.0 - 1.0).astype(np.float32)
    s = np.concatenate(
        [
            rng.uniform(-1.2, 1.2, 3000).astype(np.float32),
            (rng.standard_normal(1000) * 1e-5).astype(np.float32),
            pos_edges,
            np.nextafter(pos_edges, np.float32(2)),
            np.nextafter(pos_edges, np.float32(-2)),
            np.float32([0.0, -0.0, 1.0, -1.0, 2.0, -3.0, np.inf, -np.inf, np.nan, 1e-45, -1e-45]),
        ]
    )
    got = oracle.bins_of(s)
    for v, k in zip(s, got, strict=True):
        if np.isnan(v):
            assert k == 0
            continue
        c = np.float32(-1) if v < -1 else (np.float32(1) if v > 1 else v)
        t = np.float32(np.float32(c + np.float32(1)) * np.float32(0.5))
        y = Fraction(65535) * Fraction(float(t)) + Fraction(1, 2)
        nearest = np.float32(float(y))  # float(y) is exact here (< 53 bits); one rounding to fp32
        assert Fraction(float(y)) == y
        assert k == int(nearest), v


def test_oracle_blockwise_equals_bitsandbytes():
    import bitsandbytes.functional as bnbf
    import torch

    rng = np.random.default_rng(4)
    for blocksize in (64, 256, 4096):
        for kind in range(6):
            x = (rng.standard_normal(9000) * 3).astype(np.float32)
            if kind == 1:
                x[::7] = np.nan
            elif kind == 2:
                x *= np.float32(1e-39)
            elif kind == 3:
                x[::11] = np.inf
            elif kind == 4:
                x[: blocksize * 2] = 0
            elif kind == 5:
                x = ((rng.integers(0, 65535, 9000) + 0.5) * 2.0 / 65535.0 - 1.0).astype(np.float32)
            bq, st = bnbf.quantize_blockwise(torch.from_numpy(x), blocksize=blocksize)
            codes, absmax = oracle.quantize_blockwise(x, blocksize, st.code.numpy())
            assert np.array_equal(codes, bq.numpy()), (blocksize, kind)
            assert np.array_equal(absmax.view(np.uint32), st.absmax.numpy().view(np.uint32)), (blocksize, kind)


MEAN_SIZES = sorted(
    n
    for n in set(
        list(range(1, 70))
        + [2**k + d for k in range(3, 18) for d in (-9, -8, -1, 0, 1, 7, 8, 33)]
        + [511, 512, 513, 4095, 4096, 4097, 8191, 8192, 8193, 16384 * 16 + 5, 300000]
    )
    if n > 0
)


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_torch_mean_equals_torch(threads):
    """The oracle's float32 mean against torch.mean itself, bit for bit, for many
    sizes (around powers of two, the group, level and thread-chunk boundaries)
    and data (from 32768 values on the thread count matters)."""
    import torch

    rng = np.random.default_rng(5)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for n in MEAN_SIZES:
            if threads > 1 and n < 32768:
                continue
            for kind in range(4):
                if kind == 0:
                    x = (np.abs(rng.standard_normal(n)) * 3 + 0.01).astype(np.float32)
                elif kind == 1:
                    x = np.full(n, 0.1, np.float32)
                elif kind == 2:
                    x = (rng.standard_normal(n) * 10.0 ** rng.integers(-30, 30, n)).astype(np.float32)
                else:
                    x = np.exp2(rng.uniform(-60, 40, n)).astype(np.float32)
                t = torch.from_numpy(x)
                assert oracle.torch_sum(x, threads).view(np.uint32) == t.sum().numpy().view(np.uint32), (n, kind)
                assert oracle.torch_mean(x, threads).view(np.uint32) == t.mean().numpy().view(np.uint32), (n, kind)
    finally:
        torch.set_num_threads(before)
