"""q4torch.functional: the custom ops against the C ABI and bitsandbytes,
opcheck, and errors for bad input."""

import bitsandbytes.functional as bnbf
import numpy as np
import pytest
import torch
from q4_reference import inputs

import q4
import q4torch.functional as F
from q4torch._src import ops

TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def _tensor(x: np.ndarray, device="cpu") -> torch.Tensor:
    if x.dtype == inputs.NP_DTYPES["bfloat16"]:
        return torch.from_numpy(x.view(np.uint16).copy()).view(torch.bfloat16).to(device)
    return torch.from_numpy(x.copy()).to(device)


def _bits(t: torch.Tensor) -> np.ndarray:
    """Raw bit patterns of a float tensor."""
    return (
        t.cpu()
        .view({4: torch.int32, 2: torch.int16}[t.element_size()])
        .numpy()
        .view({4: np.uint32, 2: np.uint16}[t.element_size()])
    )


@pytest.mark.parametrize("quant_type", ["nf4", "fp4"])
@pytest.mark.parametrize("dtype", inputs.DTYPES)
@pytest.mark.parametrize("compress_statistics", [False, True])
def test_quantize_4bit_same_bytes_as_c_abi_and_bitsandbytes(device, rng, quant_type, dtype, compress_statistics):
    x = inputs.make(rng, (129, 67), dtype)
    packed, state = F.quantize_4bit(
        _tensor(x, device), blocksize=64, quant_type=quant_type, compress_statistics=compress_statistics
    )
    want_packed, want_absmax = q4.quantize_4bit(x, 64, quant_type)
    assert packed.shape == (x.size // 2 + 1, 1) and packed.dtype == torch.uint8
    assert np.array_equal(packed.cpu().numpy(), want_packed)
    bpacked, bstate = bnbf.quantize_4bit(
        _tensor(x), blocksize=64, quant_type=quant_type, compress_statistics=compress_statistics
    )
    assert torch.equal(packed.cpu(), bpacked)
    if compress_statistics:
        codes, absmax2, offset = q4.quantize_nested(want_absmax)
        assert np.array_equal(state.absmax.cpu().numpy(), codes)
        assert np.array_equal(state.state2.absmax.cpu().numpy(), absmax2) and float(state.offset) == offset
    else:
        assert np.array_equal(state.absmax.cpu().numpy(), want_absmax)
        assert torch.equal(state.absmax.cpu(), bstate.absmax)
    # dequantize: the exact values of the C ABI, in the input dtype
    y = F.dequantize_4bit(packed, state)
    assert y.dtype == TORCH_DTYPES[dtype] and y.shape == x.shape
    if compress_statistics:
        codes, absmax2, offset = q4.quantize_nested(want_absmax)
        want_absmax = q4.dequantize_blockwise(codes, absmax2, 256, offset=offset)
    want = q4.dequantize_4bit(want_packed, want_absmax, x.shape, 64, quant_type, dtype)
    assert np.array_equal(_bits(y), inputs.bits(want))
    # and bitsandbytes reads q4's state to the same values
    qs = {k: v.cpu() for k, v in state.as_dict(packed=True).items()}
    assert torch.equal(bnbf.dequantize_4bit(packed.cpu(), bnbf.QuantState.from_dict(qs, "cpu")), y.cpu())


def test_defaults_follow_bitsandbytes(rng):
    x = _tensor(inputs.make(rng, (64, 64), "float32"))
    packed, state = F.quantize_4bit(x)
    assert state.quant_type == "fp4" and state.blocksize == 64 and not state.nested
    bpacked, _ = bnbf.quantize_4bit(x)
    assert torch.equal(packed, bpacked)
    codes, st8 = F.quantize_blockwise(x)
    assert st8.blocksize == 4096 and codes.dtype == torch.uint8


def test_dequantize_into_out(rng):
    x = _tensor(inputs.make(rng, (96, 64), "float32"))
    packed, state = F.quantize_4bit(x, quant_type="nf4")
    want = F.dequantize_4bit(packed, state)
    out = torch.full((96, 64), 7.0)
    assert F.dequantize_4bit(packed, state, out=out) is out and torch.equal(out, want)
    strided = torch.full((64, 96), 7.0).t()  # not contiguous: written through a copy
    assert torch.equal(F.dequantize_4bit(packed, state, out=strided), want) and torch.equal(strided, want)
    with pytest.raises(ValueError, match="out must be contiguous"):
        ops.dequantize_4bit_out(packed.reshape(-1), state.absmax, 64, "nf4", strided)


def test_non_contiguous_input_is_copied(rng):
    x = _tensor(inputs.make(rng, (96, 64), "float32")).t()
    assert not x.is_contiguous()
    p1, s1 = F.quantize_4bit(x, quant_type="nf4")
    p2, s2 = F.quantize_4bit(x.contiguous(), quant_type="nf4")
    assert torch.equal(p1, p2) and torch.equal(s1.absmax, s2.absmax)


@pytest.mark.parametrize("storage", [torch.bfloat16, torch.float16, torch.float32, torch.int8])
def test_quant_storage_views_the_same_bytes(rng, storage):
    x = _tensor(inputs.make(rng, (128, 64), "bfloat16"))
    packed, state = F.quantize_4bit(x, quant_type="nf4", quant_storage=storage)
    bpacked, _ = bnbf.quantize_4bit(x, quant_type="nf4", quant_storage=storage)
    assert packed.dtype == storage and packed.shape == bpacked.shape
    assert torch.equal(packed.view(torch.uint8), bpacked.view(torch.uint8))
    assert torch.equal(F.dequantize_4bit(packed, state), F.dequantize_4bit(packed.view(torch.uint8), state))


def test_blockwise_8bit_round_trip(rng):
    x = _tensor(inputs.make(rng, (5000,), "float32"))
    codes, state = F.quantize_blockwise(x, blocksize=256)
    want_codes, want_absmax = q4.quantize_blockwise(x.numpy(), 256)
    assert np.array_equal(codes.numpy(), want_codes) and np.array_equal(state.absmax.numpy(), want_absmax)
    y = F.dequantize_blockwise(codes, state)
    assert np.array_equal(y.numpy(), q4.dequantize_blockwise(want_codes, want_absmax, 256))
    bcodes, bstate = bnbf.quantize_blockwise(x, blocksize=256)
    assert (y - x).abs().le((bnbf.dequantize_blockwise(bcodes, bstate) - x).abs()).all()


def test_quant_state_dict_round_trip_and_bitsandbytes_interchange(rng):
    # (last dimension a multiple of the block size: bitsandbytes 0.50.2's CPU dequantize kernel
    # mis-decodes blocks that straddle rows, see test_bitsandbytes_cpu_dequantize_straddling_rows)
    x = _tensor(inputs.make(rng, (96, 128), "bfloat16"))
    packed, state = F.quantize_4bit(x, quant_type="nf4", compress_statistics=True)
    d = state.as_dict(packed=True)
    bpacked, bstate = bnbf.quantize_4bit(x, quant_type="nf4", compress_statistics=True)
    bd = bstate.as_dict(packed=True)
    assert sorted(d) == sorted(bd)
    assert torch.equal(d["quant_state.bitsandbytes__nf4"], bd["quant_state.bitsandbytes__nf4"]) or bytes(
        d["quant_state.bitsandbytes__nf4"].numpy()
    ).replace(str(float(state.offset)).encode(), b"") == bytes(bd["quant_state.bitsandbytes__nf4"].numpy()).replace(
        str(float(bstate.offset)).encode(), b""
    )
    assert torch.equal(F.dequantize_4bit(packed, F.QuantState.from_dict(d, "cpu")), F.dequantize_4bit(packed, state))
    # q4's state loads in bitsandbytes and bitsandbytes' in q4, with identical values
    assert torch.equal(
        bnbf.dequantize_4bit(packed, bnbf.QuantState.from_dict(dict(d), "cpu")), F.dequantize_4bit(packed, state)
    )
    assert torch.equal(
        F.dequantize_4bit(bpacked, F.QuantState.from_dict(dict(bd), "cpu")), bnbf.dequantize_4bit(bpacked, bstate)
    )


def test_corrupted_quant_state_is_rejected(rng):
    x = _tensor(inputs.make(rng, (64, 64), "float32"))
    _, state = F.quantize_4bit(x, quant_type="nf4")
    d = state.as_dict(packed=True)
    bad = dict(d)
    bad["quant_state.bitsandbytes__nf4"] = d["quant_state.bitsandbytes__nf4"][:-5]
    with pytest.raises(q4.QuantStateError, match="not valid UTF-8 JSON"):
        F.QuantState.from_dict(bad, "cpu")
    bad = dict(d)
    bad["absmax"] = d["absmax"][:-1]
    with pytest.raises(q4.QuantStateError, match=r"absmax must be float32\[64\].*got float32\[63\]"):
        F.QuantState.from_dict(bad, "cpu")
    bad = {k: v for k, v in d.items() if k != "quant_map"}
    with pytest.raises(q4.QuantStateError, match="missing checkpoint entry 'quant_map'"):
        F.QuantState.from_dict(bad, "cpu")


@pytest.mark.parametrize(
    "call, exc, message",
    [
        (lambda: F.quantize_4bit(torch.ones(64, dtype=torch.int32)), TypeError, "got torch.int32"),
        (lambda: F.quantize_4bit(torch.ones(64), blocksize=100), ValueError, "got 100"),
        (lambda: F.quantize_4bit(torch.ones(64), blocksize=8192), ValueError, "got 8192"),
        (lambda: F.quantize_4bit(torch.ones(0)), ValueError, r"empty tensor .*shape \(0,\)"),
        (lambda: F.quantize_4bit(torch.ones(64), quant_type="int4"), ValueError, "got 'int4'"),
        (lambda: F.quantize_4bit([1.0, 2.0]), TypeError, "got list"),
        (
            lambda: ops.dequantize_4bit(
                torch.zeros(32, dtype=torch.uint8), torch.ones(2), 64, "nf4", [64], torch.float32
            ),
            ValueError,
            "absmax has 2 values, shape \\[64\\] with blocksize 64 needs 1",
        ),
        (
            lambda: ops.dequantize_4bit(
                torch.zeros(31, dtype=torch.uint8), torch.ones(1), 64, "nf4", [64], torch.float32
            ),
            ValueError,
            "packed has 31 bytes",
        ),
        (
            lambda: ops.dequantize_4bit(torch.zeros(32, dtype=torch.uint8), torch.ones(1), 64, "nf4", [64], torch.int8),
            TypeError,
            "got torch.int8",
        ),
        (lambda: F.quantize_blockwise(torch.ones(64), code=torch.ones(10)), ValueError, "256 values, got 10"),
    ],
)
def test_bad_input_raises_with_value(call, exc, message):
    with pytest.raises(exc, match=message):
        call()


@pytest.mark.parametrize("compress_statistics", [False, True])
def test_opcheck(compress_statistics):
    x = torch.randn(48, 40, generator=torch.Generator().manual_seed(0))
    torch.library.opcheck(ops.quantize_4bit, (x, 64, "nf4"))
    torch.library.opcheck(ops.quantize_4bit, (x.bfloat16(), 32, "fp4"))
    packed, absmax = ops.quantize_4bit(x, 64, "nf4")
    torch.library.opcheck(ops.dequantize_4bit, (packed, absmax, 64, "nf4", [48, 40], torch.bfloat16))
    torch.library.opcheck(ops.dequantize_4bit_out, (packed, absmax, 64, "nf4", torch.empty(48, 40)))
    code = F.create_dynamic_map()
    torch.library.opcheck(ops.quantize_blockwise, (x, code, 256))
    codes, am = ops.quantize_blockwise(x, code, 256)
    torch.library.opcheck(ops.dequantize_blockwise, (codes, am, code, 256, torch.float32))
    torch.library.opcheck(ops.quantize_nested, (absmax,))
    c, a2, off = ops.quantize_nested(absmax)
    torch.library.opcheck(ops.dequantize_blockwise, (c, a2, code, 256, torch.float32, off))


def test_compiles_without_graph_breaks(rng):
    x = _tensor(inputs.make(rng, (64, 64), "float32"))

    def roundtrip(t):
        packed, absmax = ops.quantize_4bit(t, 64, "nf4")
        return ops.dequantize_4bit(packed, absmax, 64, "nf4", list(t.shape), t.dtype)

    compiled = torch.compile(roundtrip, fullgraph=True)
    assert torch.equal(compiled(x), roundtrip(x))


def test_dequantize_blocks_straddling_rows_exact(rng):
    """Blocks that straddle rows (last dim not a multiple of the block size)
    decode to exactly table[code] * absmax. (bitsandbytes 0.50.2's CPU kernel on
    AVX-512 machines returns wrong values here for its own data; see README.)"""
    x = _tensor(inputs.make(rng, (96, 80), "float32"))
    packed, state = F.quantize_4bit(x, quant_type="nf4")
    ours = F.dequantize_4bit(packed, state)
    want = q4.dequantize_4bit(packed.numpy(), state.absmax.numpy(), (96, 80), 64, "nf4")
    assert np.array_equal(ours.numpy(), want)
    assert (ours - x).abs().max() <= state.absmax.max() * 0.25  # NF4's largest gap is 0.30 of absmax


def test_flush_denormal_mode_does_not_change_bytes(rng):
    """Denormal inputs quantize by IEEE rules even when the caller's thread
    flushes denormals (torch.set_flush_denormal, or XLA's threads)."""
    x = np.full(64, 1e-40, np.float32)
    x[1::2] = -3e-41
    want_packed, want_absmax = q4.quantize_4bit(x, 64, "nf4")
    assert want_absmax[0] == np.float32(1e-40)
    assert torch.set_flush_denormal(True)
    try:
        packed, state = F.quantize_4bit(torch.from_numpy(x), quant_type="nf4")
    finally:
        torch.set_flush_denormal(False)
    assert np.array_equal(packed.numpy(), want_packed) and np.array_equal(state.absmax.numpy(), want_absmax)
