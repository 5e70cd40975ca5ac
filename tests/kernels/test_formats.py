"""The format tables in the kernel library against the definitions and bitsandbytes."""

import numpy as np
import pytest
from q4_reference import oracle

import q4


def test_nf4_table_matches_definition():
    assert np.array_equal(q4.code_table("nf4"), oracle.NF4)


def test_fp4_table_matches_definition_bitwise():
    assert np.array_equal(q4.code_table("fp4").view(np.uint32), oracle.FP4.view(np.uint32))


def test_dynamic_map_matches_definition():
    got = q4.code_table("dynamic")
    want = oracle.dynamic_map()
    assert got.shape == (256,) and np.all(np.diff(got) > 0)
    assert got[127] == 0.0 and got[-1] == 1.0
    # the format's fp32 linspace differs from exact arithmetic by at most 2 ulp (see oracle.dynamic_map)
    assert np.all(np.abs(got - want) <= 2 * np.spacing(np.abs(want)))


def test_tables_equal_bitsandbytes():
    import bitsandbytes.functional as bnbf

    assert np.array_equal(q4.code_table("dynamic"), bnbf.create_dynamic_map().numpy())
    for qt in ("nf4", "fp4"):
        assert np.array_equal(
            q4.code_table(qt).view(np.uint32), bnbf.get_4bit_type(qt, device="cpu").numpy().view(np.uint32)
        )


def test_tables_are_read_only():
    with pytest.raises(ValueError):
        q4.code_table("nf4")[0] = 2.0


@pytest.mark.parametrize("quant_type", ["nf4", "fp4"])
def test_every_code_point_round_trips(quant_type):
    """Each table value (times a power-of-two absmax) encodes to its own nibble
    (or to the other zero for FP4's two zeros) and decodes exactly."""
    table = q4.code_table(quant_type)
    x = np.concatenate([table, np.zeros(48, np.float32)])  # one block of 64: absmax 1
    packed, absmax = q4.quantize_4bit(x * 4, blocksize=64, quant_type=quant_type)
    assert absmax[0] == 4.0
    codes = oracle.unpack(packed, 64)[:16]
    for i, c in enumerate(codes):
        assert table[c] == table[i], (i, c)
    y = q4.dequantize_4bit(packed, absmax, x.shape, 64, quant_type)
    assert np.array_equal(y, x * 4)


def test_nibble_order_even_element_high():
    x = np.zeros(64, np.float32)
    x[0], x[1] = 1.0, -1.0  # nf4 codes 15 and 0
    packed, _ = q4.quantize_4bit(x, 64, "nf4")
    assert packed[0, 0] == 0xF0
    assert packed[1, 0] == 0x77  # zeros encode as code 7 in both nibbles


def test_constants():
    assert (q4.min_blocksize(), q4.max_blocksize(), q4.nested_blocksize()) == (32, 4096, 256)
