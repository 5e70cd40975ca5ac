"""The same input through the C ABI, the PyTorch op and the JAX op gives the
same bytes, the same statistics and the same dequantized values."""

import jax.numpy as jnp
import numpy as np
import pytest
import torch
from q4_reference import inputs

import q4
import q4jax
import q4torch.functional as F


def _torch(x: np.ndarray) -> torch.Tensor:
    if x.dtype == inputs.NP_DTYPES["bfloat16"]:
        return torch.from_numpy(x.view(np.uint16).copy()).view(torch.bfloat16)
    return torch.from_numpy(x.copy())


def _torch_bits(t: torch.Tensor) -> np.ndarray:
    return (
        t.view({4: torch.int32, 2: torch.int16}[t.element_size()])
        .numpy()
        .view({4: np.uint32, 2: np.uint16}[t.element_size()])
    )


@pytest.mark.parametrize("quant_type", ["nf4", "fp4"])
@pytest.mark.parametrize("dtype", inputs.DTYPES)
@pytest.mark.parametrize("blocksize", [64, 4096])
@pytest.mark.parametrize("nested", [False, True])
def test_c_abi_torch_jax_same_bytes(rng, quant_type, dtype, blocksize, nested):
    # (special values include NaN/inf, whose blocks make a nested mean meaningless)
    x = inputs.make(rng, (257, 129), dtype, "normal" if nested else "special")
    pt, st = F.quantize_4bit(_torch(x), blocksize=blocksize, quant_type=quant_type, compress_statistics=nested)
    pj, sj = q4jax.quantize_4bit(jnp.asarray(x), blocksize, quant_type, nested)
    pc, ac = q4.quantize_4bit(x, blocksize, quant_type)
    assert np.array_equal(pt.numpy(), pc) and np.array_equal(np.asarray(pj), pc)
    if nested:
        codes, absmax2, offset = q4.quantize_nested(ac)
        for absmax, nested_absmax, off in (
            (st.absmax.numpy(), st.state2.absmax.numpy(), float(st.offset)),
            (np.asarray(sj.absmax), np.asarray(sj.nested_absmax), float(sj.nested_offset)),
        ):
            assert np.array_equal(absmax, codes) and np.array_equal(nested_absmax, absmax2) and off == offset
        ac = q4.dequantize_blockwise(codes, absmax2, 256, offset=offset)
    else:
        assert np.array_equal(inputs.bits(st.absmax.numpy()), inputs.bits(ac))
        assert np.array_equal(inputs.bits(np.asarray(sj.absmax)), inputs.bits(ac))
    yc = q4.dequantize_4bit(pc, ac, x.shape, blocksize, quant_type, dtype)
    assert np.array_equal(_torch_bits(F.dequantize_4bit(pt, st)), inputs.bits(yc))
    assert np.array_equal(inputs.bits(np.asarray(q4jax.dequantize_4bit(pj, sj))), inputs.bits(yc))
    # and the checkpoint entries of the two states are identical
    dt = st.to_numpy().to_dict()
    dj = sj.to_numpy().to_dict()
    assert sorted(dt) == sorted(dj)
    for key in dt:
        assert np.array_equal(dt[key], dj[key]), key
