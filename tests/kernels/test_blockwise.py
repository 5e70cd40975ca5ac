"""8-bit blockwise kernels and nested absmax: bit-exact with the oracle and with
bitsandbytes 0.50.2 on the CPU (codes, absmax, nested offset, dequantized
values), for every input dtype, block size and the special values."""

import contextlib

import numpy as np
import pytest
import torch
from q4_reference import inputs, oracle

import q4

# The dynamic map as the format defines it bit for bit (checked against
# bitsandbytes' in test_formats); oracle.dynamic_map() is within 2 ulp of it.
DYN = q4.code_table("dynamic")
MIDPOINTS = ((DYN[:-1] + DYN[1:]) * np.float32(0.5)).astype(np.float32)


def _torch(x: np.ndarray) -> torch.Tensor:
    if x.dtype == inputs.NP_DTYPES["bfloat16"]:
        return torch.from_numpy(x.view(np.uint16).copy()).view(torch.bfloat16)
    return torch.from_numpy(x.copy())


@contextlib.contextmanager
def torch_threads(n: int):
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def make8(rng: np.random.Generator, n: int, blocksize: int, kind: str) -> np.ndarray:
    """fp32 inputs for the 8-bit format, beyond inputs.make: huge values, NaN,
    inf, exact code points and code midpoints (scaled by a block absmax of 2.5),
    and values on and next to the bin edges."""
    if kind in ("normal", "special", "zeros", "tiny"):
        return inputs.make(rng, (n,), "float32", kind)
    if kind == "huge":
        return (rng.standard_normal(n) * 1e37).astype(np.float32)
    if kind in ("nan", "inf"):
        x = rng.standard_normal(n).astype(np.float32)
        x[rng.integers(0, n, max(1, n // 10))] = np.nan if kind == "nan" else np.inf
        if kind == "nan" and n >= blocksize:
            x[:blocksize] = np.nan  # a block of NaN only
        return x
    if kind in ("codes", "midpoints"):
        values = DYN if kind == "codes" else MIDPOINTS
        x = (values[rng.integers(0, values.size, n)] * np.float32(2.5)).astype(np.float32)
        x[::blocksize] = 2.5  # every block's absmax is 2.5
        return x
    if kind == "bin-edges":  # s = (k + 0.5) * 2 / 65535 - 1 (where bins round), +-1 ulp
        s = ((rng.integers(0, 65535, n) + 0.5) * 2.0 / 65535.0 - 1.0).astype(np.float32)
        s = np.where(rng.integers(0, 3, n) == 0, s, np.nextafter(s, np.float32(rng.choice([-2, 2]))))
        s[::blocksize] = 1.0
        return s.astype(np.float32)
    raise ValueError(kind)


KINDS8 = ["normal", "special", "zeros", "tiny", "huge", "nan", "inf", "codes", "midpoints", "bin-edges"]


@pytest.mark.parametrize("dtype", inputs.DTYPES)
@pytest.mark.parametrize("blocksize", [32, 256, 4096, 16384])
def test_quantize_blockwise_matches_oracle(rng, dtype, blocksize):
    for shape in [(5000,), (33, 65), (7,)]:
        for kind in ("normal", "special", "zeros", "tiny"):
            x = inputs.make(rng, shape, dtype, kind)
            codes, absmax = q4.quantize_blockwise(x, blocksize)
            ref_codes, ref_absmax = oracle.quantize_blockwise(inputs.to_f32(x), blocksize, DYN)
            assert np.array_equal(codes.reshape(-1), ref_codes), (shape, kind)
            assert np.array_equal(inputs.bits(absmax), inputs.bits(ref_absmax))
            y = q4.dequantize_blockwise(codes, absmax, blocksize)
            assert np.array_equal(
                inputs.bits(y).reshape(-1), inputs.bits(oracle.dequantize_blockwise(codes, absmax, blocksize, DYN))
            )


def test_blockwise_blocksize_limits(rng):
    """8-bit blockwise blocks go up to 16384 (4-bit ones to 4096); past it, the
    value is in the message."""
    x = rng.standard_normal(40000).astype(np.float32)
    codes, absmax = q4.quantize_blockwise(x, 16384)
    assert absmax.size == 3
    with pytest.raises(ValueError, match="power of two in \\[32, 16384\\], got 32768"):
        q4.quantize_blockwise(x, 32768)
    with pytest.raises(ValueError, match="power of two in \\[32, 4096\\], got 16384"):
        q4.quantize_4bit(x, 16384)


@pytest.mark.parametrize("dtype", inputs.DTYPES)
@pytest.mark.parametrize("blocksize", [*inputs.BLOCKSIZES, 16384])
def test_blockwise_equals_bitsandbytes(rng, dtype, blocksize):
    import bitsandbytes.functional as bnbf

    for n in (1, 7, blocksize, 3 * blocksize + 5, 20000):
        for kind in KINDS8:
            with np.errstate(over="ignore"):
                x = make8(rng, n, blocksize, kind).astype(inputs.NP_DTYPES[dtype])
            codes, absmax = q4.quantize_blockwise(x, blocksize)
            bq, bstate = bnbf.quantize_blockwise(_torch(x), blocksize=blocksize)
            assert np.array_equal(codes, bq.numpy()), (n, kind)
            assert np.array_equal(inputs.bits(absmax), inputs.bits(bstate.absmax.numpy())), (n, kind)
            # dequantized in the input dtype (as bitsandbytes does); compared widened to fp32 (exact)
            y = inputs.to_f32(q4.dequantize_blockwise(codes, absmax, blocksize, dtype=dtype))
            yb = bnbf.dequantize_blockwise(bq, bstate).float().numpy()
            assert np.array_equal(inputs.bits(y), inputs.bits(yb)), (n, kind)


def test_blockwise_custom_code_books_equal_bitsandbytes(rng):
    import bitsandbytes.functional as bnbf

    books = [
        np.linspace(-1, 1, 256).astype(np.float32),
        np.sort(rng.uniform(-1, 1, 256)).astype(np.float32),
        np.sort(rng.standard_normal(256) * 0.3).astype(np.float32),  # entries beyond [-1, 1] too
        np.repeat(np.linspace(-1, 1, 128), 2).astype(np.float32),  # repeated entries
        np.linspace(-1e-4, 1e-4, 256).astype(np.float32),  # finer than the bins
    ]
    keep = []  # bitsandbytes caches its table by book address: keep every book alive
    for code in books:
        tcode = torch.from_numpy(code)
        keep.append(tcode)
        for blocksize in (64, 4096):
            for kind in ("normal", "special", "tiny", "bin-edges"):
                x = make8(rng, 9000, blocksize, kind)
                codes, absmax = q4.quantize_blockwise(x, blocksize, code=code)
                bq, bstate = bnbf.quantize_blockwise(torch.from_numpy(x), code=tcode, blocksize=blocksize)
                assert np.array_equal(codes, bq.numpy()), kind
                assert np.array_equal(absmax, bstate.absmax.numpy()), kind
                ref_codes, ref_absmax = oracle.quantize_blockwise(x, blocksize, code)
                assert np.array_equal(codes, ref_codes) and np.array_equal(absmax, ref_absmax), kind


def _absmax_vector(rng: np.random.Generator, n: int, kind: str) -> np.ndarray:
    if kind == "from-weights":  # the absmax of a real 4-bit quantization (block 64)
        _, absmax = q4.quantize_4bit((rng.standard_normal(n * 64) * 0.05).astype(np.float32), 64, "nf4")
        return absmax
    if kind == "lognormal":
        return rng.lognormal(-3.0, 1.0, n).astype(np.float32)
    if kind == "wide-range":
        return np.exp2(rng.uniform(-60.0, 40.0, n)).astype(np.float32)
    if kind == "constant":
        return np.full(n, 0.1, np.float32)
    if kind == "with-zeros":
        a = rng.lognormal(-3.0, 1.0, n).astype(np.float32)
        a[::3] = 0.0
        return a
    raise ValueError(kind)


NESTED_KINDS = ["from-weights", "lognormal", "wide-range", "constant", "with-zeros"]
NESTED_SIZES = [1, 2, 3, 4, 5, 7, 8, 9, 31, 32, 33, 255, 256, 257, 511, 513, 2304, 4095, 4096, 4097, 9216, 32767]


@pytest.mark.parametrize("kind", NESTED_KINDS)
def test_nested_equals_bitsandbytes_and_oracle(rng, kind):
    """offset = torch's float32 mean, codes and absmax2 = bitsandbytes' 8-bit of absmax - offset."""
    import bitsandbytes.functional as bnbf

    for n_blocks in NESTED_SIZES + [int(rng.integers(10, 30000)) for _ in range(8)]:
        absmax = _absmax_vector(rng, n_blocks, kind)
        codes, absmax2, offset = q4.quantize_nested(absmax)
        t = torch.from_numpy(absmax)
        want_offset = t.mean()
        assert inputs.bits(np.float32(offset)) == inputs.bits(want_offset.numpy()), n_blocks
        bq, bstate = bnbf.quantize_blockwise(t - want_offset, blocksize=256)
        assert np.array_equal(codes, bq.numpy()), n_blocks
        assert np.array_equal(inputs.bits(absmax2), inputs.bits(bstate.absmax.numpy())), n_blocks
        ref_codes, ref_absmax2, ref_offset = oracle.quantize_nested(absmax, DYN)
        assert offset == ref_offset and np.array_equal(codes, ref_codes) and np.array_equal(absmax2, ref_absmax2)
        # decoded absmax: fp32(code * absmax2) + offset, bit-exact with the oracle and bitsandbytes
        decoded = q4.dequantize_blockwise(codes, absmax2, 256, offset=offset)
        assert np.array_equal(decoded, oracle.dequantize_blockwise(codes, absmax2, 256, DYN, offset=offset))
        assert np.array_equal(decoded, (bnbf.dequantize_blockwise(bq, bstate) + want_offset).numpy())


@pytest.mark.parametrize("n_blocks", [32768, 65536 + 17, 262144, 300001])
def test_nested_large_equals_bitsandbytes_with_one_torch_thread(rng, n_blocks):
    """From 32768 values on, torch's mean splits across its intra-op threads
    (bitsandbytes' offset then depends on torch.get_num_threads()); q4 gives
    the one-thread result."""
    import bitsandbytes.functional as bnbf

    absmax = _absmax_vector(rng, n_blocks, "lognormal")
    codes, absmax2, offset = q4.quantize_nested(absmax)
    with torch_threads(1):
        t = torch.from_numpy(absmax)
        want_offset = t.mean()
        bq, bstate = bnbf.quantize_blockwise(t - want_offset, blocksize=256)
    assert inputs.bits(np.float32(offset)) == inputs.bits(want_offset.numpy())
    assert np.array_equal(codes, bq.numpy()) and np.array_equal(absmax2, bstate.absmax.numpy())
    assert offset == oracle.torch_mean(absmax)


def test_nested_special_values(rng):
    """NaN in the absmax: NaN offset, every centred value NaN, so absmax2 = 0 and codes 0
    (as bitsandbytes); inf: inf offset."""
    import bitsandbytes.functional as bnbf

    for bad in (np.nan, np.inf):
        absmax = _absmax_vector(rng, 1000, "lognormal")
        absmax[500] = bad
        codes, absmax2, offset = q4.quantize_nested(absmax)
        t = torch.from_numpy(absmax)
        want_offset = t.mean()
        bq, bstate = bnbf.quantize_blockwise(t - want_offset, blocksize=256)
        assert np.isnan(offset) == np.isnan(want_offset.item()) and (np.isnan(offset) or offset == want_offset.item())
        assert np.array_equal(codes, bq.numpy()) and np.array_equal(absmax2, bstate.absmax.numpy())


@pytest.mark.parametrize("shape", [(1536, 384), (384, 1536), (300, 257), (64,), (8, 64), (4097, 3), (1024, 1024)])
def test_nested_4bit_bytes_equal_bitsandbytes(rng, shape):
    """bitsandbytes' quantize_4bit(nf4, block 64, compress_statistics=True) =
    q4.quantize_4bit + q4.quantize_nested, byte for byte."""
    import bitsandbytes.functional as bnbf

    x = (rng.standard_normal(shape) * 0.05).astype(np.float32)
    packed, st = bnbf.quantize_4bit(torch.from_numpy(x), blocksize=64, quant_type="nf4", compress_statistics=True)
    q_packed, absmax = q4.quantize_4bit(x, 64, "nf4")
    codes, absmax2, offset = q4.quantize_nested(absmax)
    assert np.array_equal(q_packed.reshape(-1), packed.numpy().reshape(-1))
    assert np.array_equal(codes, st.absmax.numpy())
    assert np.array_equal(inputs.bits(absmax2), inputs.bits(st.state2.absmax.numpy()))
    assert inputs.bits(np.float32(offset)) == inputs.bits(st.offset.numpy())
    assert np.array_equal(st.state2.code.numpy(), DYN)


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
