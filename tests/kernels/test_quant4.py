"""4-bit kernels (through the numpy entry points of q4, i.e. the C ABI)
against the reference oracle and bitsandbytes 0.50.2: exact bytes and values."""

import numpy as np
import pytest
import torch
from q4_reference import inputs, oracle

import q4

SHAPES = [(4096 * 2 + 64,), (77, 129), (33, 1000), (5,), (1, 1), (3, 4097)]


def _torch(x: np.ndarray) -> torch.Tensor:
    if x.dtype == inputs.NP_DTYPES["bfloat16"]:
        return torch.from_numpy(x.view(np.uint16).copy()).view(torch.bfloat16)
    return torch.from_numpy(x.copy())


def _bnb_quantize(x: np.ndarray, blocksize: int, quant_type: str):
    import bitsandbytes.functional as bnbf

    packed, state = bnbf.quantize_4bit(_torch(x), blocksize=blocksize, quant_type=quant_type)
    return packed.numpy().reshape(-1), state.absmax.numpy()


@pytest.mark.parametrize("quant_type", ["nf4", "fp4"])
@pytest.mark.parametrize("dtype", inputs.DTYPES)
@pytest.mark.parametrize("blocksize", inputs.BLOCKSIZES)
def test_quantize_matches_oracle_and_bitsandbytes(isa, rng, quant_type, dtype, blocksize):
    for shape in SHAPES:
        for kind in ("normal", "special"):
            x = inputs.make(rng, shape, dtype, kind)
            packed, absmax = q4.quantize_4bit(x, blocksize, quant_type)
            ref_packed, ref_absmax = oracle.quantize_4bit(inputs.to_f32(x), blocksize, quant_type)
            assert np.array_equal(packed.reshape(-1), ref_packed), (shape, kind)
            assert np.array_equal(inputs.bits(absmax), inputs.bits(ref_absmax)), (shape, kind)
            if kind == "normal" and shape[0] != 4096 * 2 + 64 or blocksize in (64, 4096):
                bnb_packed, bnb_absmax = _bnb_quantize(x, blocksize, quant_type)
                assert np.array_equal(packed.reshape(-1), bnb_packed), (shape, kind)
                assert np.array_equal(inputs.bits(absmax), inputs.bits(bnb_absmax)), (shape, kind)


@pytest.mark.parametrize("quant_type", ["nf4", "fp4"])
@pytest.mark.parametrize("out_dtype", inputs.DTYPES)
@pytest.mark.parametrize("blocksize", [32, 64, 256, 4096])
def test_dequantize_matches_oracle_and_bitsandbytes(isa, rng, quant_type, out_dtype, blocksize):
    import bitsandbytes.functional as bnbf

    for shape in SHAPES:
        x = inputs.make(rng, shape, "float32", "special")
        packed, absmax = q4.quantize_4bit(x, blocksize, quant_type)
        y = q4.dequantize_4bit(packed, absmax, shape, blocksize, quant_type, out_dtype)
        ref = inputs.to_dtype(oracle.dequantize_4bit(packed, absmax, x.size, blocksize, quant_type), out_dtype)
        assert np.array_equal(inputs.bits(y).reshape(-1), inputs.bits(ref)), shape
        if len(shape) == 2 and shape[1] % 2 == 0 or shape == SHAPES[0]:
            # (bitsandbytes' CPU kernel for odd last dimensions is its generic torch fallback)
            _, state = bnbf.quantize_4bit(_torch(x), blocksize=blocksize, quant_type=quant_type)
            state.dtype = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}[out_dtype]
            yb = bnbf.dequantize_4bit(torch.from_numpy(packed), state).float().numpy()
            # equal values (bitsandbytes' CPU kernel decodes FP4 nibble 8 as -0.0, its table as +0.0)
            assert np.array_equal(inputs.to_f32(y).reshape(-1), yb.reshape(-1), equal_nan=True), shape


@pytest.mark.parametrize("quant_type", ["nf4", "fp4"])
def test_special_blocks(quant_type):
    """All-zero blocks, NaN and Inf, per the documented behaviour."""
    zero_code = oracle.encode4(np.zeros(1, np.float32), quant_type)[0]
    top_code = {"nf4": 15, "fp4": 3}[quant_type]  # the code of +1.0, which NaN encodes to
    # all-zero full block: absmax 0, every nibble the code of 0.0
    packed, absmax = q4.quantize_4bit(np.zeros(64, np.float32), 64, quant_type)
    assert absmax.tolist() == [0.0] and set(packed.reshape(-1)) == {zero_code * 17}
    # all-zero partial last block stores the 1e-38 floor
    _, absmax = q4.quantize_4bit(np.zeros(70, np.float32), 64, quant_type)
    assert absmax[0] == 0.0 and absmax[1] == np.float32(1e-38)
    # NaN: the block's absmax is NaN and every nibble is the top code; other blocks unaffected
    x = np.ones(128, np.float32)
    x[3] = np.nan
    packed, absmax = q4.quantize_4bit(x, 64, quant_type)
    assert np.isnan(absmax[0]) and absmax[1] == 1.0
    assert set(packed.reshape(-1)[:32]) == {top_code * 17}
    assert np.isnan(q4.dequantize_4bit(packed, absmax, x.shape, 64, quant_type)[:64]).all()
    # Inf: absmax inf; the inf element scales to NaN (top code), finite ones to 0.0
    x = np.zeros(64, np.float32)
    x[0], x[1] = 1.0, np.inf
    packed, absmax = q4.quantize_4bit(x, 64, quant_type)
    assert np.isinf(absmax[0])
    assert packed[0, 0] == (zero_code << 4 | top_code)


def test_odd_element_count_pads_with_zero_code():
    for quant_type in ("nf4", "fp4"):
        packed, _ = q4.quantize_4bit(np.ones(5, np.float32), 64, quant_type)
        zero_code = oracle.encode4(np.zeros(1, np.float32), quant_type)[0]
        assert packed.shape == (3, 1) and packed[2, 0] & 15 == zero_code


def test_scalar_and_avx2_identical(rng):
    if not q4.cpu_has_avx2():
        pytest.skip("processor lacks AVX2")
    x = inputs.make(rng, (257, 515), "float32", "special")
    results = {}
    before = q4.cpu_isa()
    for isa in ("scalar", "avx2"):
        q4.set_cpu_isa(isa)
        try:
            results[isa] = [q4.quantize_4bit(x, 64, qt) for qt in ("nf4", "fp4")]
            results[isa] += [q4.dequantize_4bit(*results[isa][0], x.shape, 64, "nf4", "bfloat16")]
        finally:
            q4.set_cpu_isa(before)  # the level the session runs (avx512_bf16 on such CPUs), not "avx2"
    assert q4.cpu_isa() == before
    (a, b) = results["scalar"], results["avx2"]
    for (pa, ma), (pb, mb) in zip(a[:2], b[:2], strict=True):
        assert np.array_equal(pa, pb) and np.array_equal(ma, mb)
    assert np.array_equal(inputs.bits(a[2]), inputs.bits(b[2]))


def test_threads_do_not_change_results(rng):
    x = inputs.make(rng, (1024, 1024), "float32")
    before = q4.num_threads()
    outs = []
    try:
        for t in (1, 2, 3):
            q4.set_num_threads(t)
            outs.append(q4.quantize_4bit(x, 64, "nf4"))
    finally:
        q4.set_num_threads(0)
    assert q4.num_threads() == before
    for p, m in outs[1:]:
        assert np.array_equal(p, outs[0][0]) and np.array_equal(m, outs[0][1])
