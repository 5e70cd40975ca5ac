"""Every q4torch function that takes a QuantState validates it the same way
(functional.check_quant_state): a malformed state is a ValueError/TypeError
naming the bad field, never a decode that silently drops part of it."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from q4_reference import inputs, oracle

import q4torch
from q4torch import functional as F


def _weight(rng, nested, shape=(64, 32)):
    w = torch.from_numpy(inputs.make(rng, shape, "float32"))
    return F.quantize_4bit(w, blocksize=64, quant_type="nf4", compress_statistics=nested)


def _both(packed, state):
    x = torch.ones(2, 32)
    return (lambda: F.dequantize_4bit(packed, state), lambda: q4torch.matmul_4bit(x, packed, state))


def test_nested_state_without_offset_is_refused_not_decoded_without_it(rng):
    packed, state = _weight(rng, nested=True)
    bad = copy.copy(state)
    bad.offset = None
    for call in _both(packed, bad):
        with pytest.raises(ValueError, match="is nested and needs offset, a one-element float tensor; got None"):
            call()


def test_the_checks_keep_the_exact_decode(rng):
    # positive control: a valid nested state decodes to the oracle's values
    w = inputs.make(rng, (64, 32), "float32")
    packed, state = F.quantize_4bit(torch.from_numpy(w), blocksize=64, quant_type="nf4", compress_statistics=True)
    absmax = oracle.dequantize_blockwise(
        state.absmax.numpy(), state.state2.absmax.numpy(), 256, offset=np.float32(state.offset)
    )
    want = oracle.dequantize_4bit(packed.numpy().reshape(-1), absmax, w.size, 64, "nf4").reshape(w.shape)
    assert np.array_equal(F.dequantize_4bit(packed, state).numpy(), want)


@pytest.mark.parametrize(
    "field, value, err, message",
    [
        ("blocksize", 0, ValueError, "blocksize must be a power of two in \\[32, 4096\\], got 0"),
        ("blocksize", 64.0, ValueError, "got 64.0"),
        ("quant_type", "int4", ValueError, "quant_type must be 'nf4' or 'fp4', got 'int4'"),
        ("dtype", torch.float64, ValueError, "dtype must be torch.float32, float16 or bfloat16, got torch.float64"),
        ("shape", torch.Size([64, 0]), ValueError, "shape must be a non-empty sequence of positive ints"),
        ("shape", None, ValueError, "got None"),
        ("shape", torch.Size([128, 32]), ValueError, "absmax must hold 64 floating-point values"),
        (
            "absmax",
            torch.ones(31),
            ValueError,
            "absmax must hold 32 floating-point values .* got torch.float32\\[31\\]",
        ),
        ("absmax", [1.0] * 32, TypeError, "absmax must be a tensor, got list"),
    ],
    ids=[
        "blocksize-0",
        "blocksize-float",
        "quant-type",
        "dtype",
        "zero-dim",
        "no-shape",
        "shape-vs-absmax",
        "short-absmax",
        "list-absmax",
    ],
)
def test_bad_plain_state_fields_are_named(rng, field, value, err, message):
    packed, state = _weight(rng, nested=False)
    bad = copy.copy(state)
    setattr(bad, field, value)
    for call in _both(packed, bad):
        with pytest.raises(err, match=message):
            call()


def test_bad_nested_state_fields_are_named(rng):
    packed, state = _weight(rng, nested=True)
    short2 = copy.copy(state)
    short2.state2 = copy.copy(state.state2)
    short2.state2.absmax = torch.ones(2)
    float_codes = copy.copy(state)
    float_codes.absmax = state.absmax.float()
    cases = [
        (short2, "state2.absmax must be float32\\[1\\], got torch.float32\\[2\\]"),
        (float_codes, "absmax must hold 32 uint8 codes \\(nested\\)"),
    ]
    for bad, message in cases:
        for call in _both(packed, bad):
            with pytest.raises(ValueError, match=message):
                call()


def test_packed_bytes_must_match_the_state(rng):
    p1, state = _weight(rng, nested=False)
    p2, _ = _weight(rng, nested=False)
    packed = torch.cat([p1, p2])
    for call in _both(packed, state):
        with pytest.raises(ValueError, match="packed weight has 2048 bytes, quant_state.shape \\(64, 32\\) needs 1024"):
            call()


def test_state_of_the_wrong_type_is_named(rng):
    packed, state = _weight(rng, nested=False)
    with pytest.raises(TypeError, match="quant_state must be a q4torch.functional.QuantState, got dict"):
        F.dequantize_4bit(packed, state.as_dict())
    with pytest.raises(TypeError, match="B must be a torch.Tensor, got ndarray"):
        q4torch.matmul_4bit(torch.ones(2, 32), packed.numpy(), state)
