"""8-bit blockwise kernels and nested absmax against the oracle; reconstruction
error never above bitsandbytes' on the same input."""

import numpy as np
import pytest
import torch
from reference import inputs, oracle

import q4

# The dynamic map as the format defines it bit for bit (checked against
# bitsandbytes' in test_formats); oracle.dynamic_map() is within 2 ulp of it.
DYN = q4.code_table("dynamic")


@pytest.mark.parametrize("dtype", inputs.DTYPES)
@pytest.mark.parametrize("blocksize", [32, 256, 4096])
def test_quantize_blockwise_matches_oracle(rng, dtype, blocksize):
    for shape in [(5000,), (33, 65), (7,)]:
        for kind in ("normal", "special"):
            x = inputs.make(rng, shape, dtype, kind)
            codes, absmax = q4.quantize_blockwise(x, blocksize)
            ref_codes, ref_absmax = oracle.quantize_blockwise(inputs.to_f32(x), blocksize, DYN)
            assert np.array_equal(codes.reshape(-1), ref_codes), (shape, kind)
            assert np.array_equal(inputs.bits(absmax), inputs.bits(ref_absmax))
            y = q4.dequantize_blockwise(codes, absmax, blocksize)
            assert np.array_equal(
                inputs.bits(y).reshape(-1), inputs.bits(oracle.dequantize_blockwise(codes, absmax, blocksize, DYN))
            )


@pytest.mark.parametrize("blocksize", [64, 256, 4096])
def test_blockwise_error_never_above_bitsandbytes(rng, blocksize):
    import bitsandbytes.functional as bnbf

    x = inputs.make(rng, (20000,), "float32")
    codes, absmax = q4.quantize_blockwise(x, blocksize)
    ours = q4.dequantize_blockwise(codes, absmax, blocksize)
    bq, bstate = bnbf.quantize_blockwise(torch.from_numpy(x), blocksize=blocksize)
    theirs = bnbf.dequantize_blockwise(bq, bstate).numpy()
    assert np.array_equal(absmax, bstate.absmax.numpy())
    assert np.all(np.abs(ours - x) <= np.abs(theirs - x))


def test_nested_matches_oracle_and_bitsandbytes(rng):
    import bitsandbytes.functional as bnbf

    for n_blocks in (1, 255, 256, 257, 4096 * 4 + 3):
        absmax = np.abs(rng.standard_normal(n_blocks)).astype(np.float32) * 3 + 0.01
        codes, absmax2, offset = q4.quantize_nested(absmax)
        ref_codes, ref_absmax2, ref_offset = oracle.quantize_nested(absmax, DYN)
        assert offset == ref_offset
        assert np.array_equal(codes, ref_codes) and np.array_equal(absmax2, ref_absmax2)
        # decoded absmax: fp32(code*absmax2) + offset, bit-exact with the oracle
        decoded = q4.dequantize_blockwise(codes, absmax2, 256, offset=offset)
        assert np.array_equal(decoded, oracle.dequantize_blockwise(codes, absmax2, 256, DYN, offset=offset))
        # reconstruction error of the centred values never above bitsandbytes' on the same input
        centred = (absmax - offset).astype(np.float32)
        bq, bstate = bnbf.quantize_blockwise(torch.from_numpy(centred), blocksize=256)
        theirs = bnbf.dequantize_blockwise(bq, bstate).numpy()
        ours = q4.dequantize_blockwise(codes, absmax2, 256)
        assert np.all(np.abs(ours - centred) <= np.abs(theirs - centred))
        # the offset is the fp32 mean (bitsandbytes' fp32 reduction may differ in the last bits)
        assert abs(offset - float(torch.from_numpy(absmax).mean())) <= 4 * np.spacing(offset)


def test_nested_4bit_decodes_like_bitsandbytes(rng):
    """A nested state written by bitsandbytes dequantizes to its exact values in q4."""
    import bitsandbytes.functional as bnbf

    x = torch.from_numpy(inputs.make(rng, (300, 257), "float32"))
    packed, st = bnbf.quantize_4bit(x, blocksize=64, quant_type="nf4", compress_statistics=True)
    want = bnbf.dequantize_4bit(packed, st).numpy()
    absmax = q4.dequantize_blockwise(
        st.absmax.numpy(), st.state2.absmax.numpy(), 256, code=st.state2.code.numpy(), offset=float(st.offset)
    )
    got = q4.dequantize_4bit(packed.numpy(), absmax, x.shape, 64, "nf4")
    assert np.array_equal(got, want)


def test_custom_code_book_must_be_sorted(rng):
    code = np.linspace(-1, 1, 256).astype(np.float32)[::-1].copy()
    with pytest.raises(q4.KernelError, match="sorted ascending"):
        q4.quantize_blockwise(np.ones(64, np.float32), 64, code=code)
