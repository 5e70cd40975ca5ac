"""The oracle itself, against brute force from the definitions: so a bug in
the oracle cannot hide a matching bug in the kernels."""

import numpy as np
import pytest

from reference import oracle


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
