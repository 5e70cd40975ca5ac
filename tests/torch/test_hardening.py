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


# ------------------------------------------------------------ issue 52: storage, meta, 0-d


def test_bool_storage_is_refused_everywhere(rng, tmp_path):
    """A copy of a bool tensor turns every non-zero byte into 1: a packed
    weight stored or requested as bool is refused, never decoded."""
    w = torch.from_numpy(inputs.make(rng, (64, 32), "float32"))
    with pytest.raises(ValueError, match="quant_storage must be one of .* got torch.bool"):
        F.quantize_4bit(w, quant_storage=torch.bool)
    with pytest.raises(ValueError, match="got torch.bool"):
        q4torch.nn.Linear4bit(32, 64, quant_storage=torch.bool)
    layer = q4torch.nn.Linear4bit(32, 64, quant_type="nf4")
    layer.weight.data = w
    layer = layer.to("cpu")
    sd = layer.state_dict()
    sd["weight"] = sd["weight"].bool()
    fresh = q4torch.nn.Linear4bit(32, 64, quant_type="nf4").to("cpu")
    with pytest.raises(Exception, match="'weight' is stored as torch.bool"):
        fresh.load_state_dict(sd)
    packed, state = _weight(rng, nested=True)
    for call in _both(packed.bool(), state):
        with pytest.raises(ValueError, match="torch.bool"):
            call()
    # the framework-neutral check (load_quantized, q4 inspect) too
    from q4._src.checkpoint import CheckpointError, validate

    entries = {k: v.numpy() for k, v in sd.items() if k != "bias"}
    with pytest.raises(CheckpointError, match="tensor 'weight' is bool"):
        validate(entries)


@pytest.mark.parametrize("where", ["weight", "absmax", "nested_absmax"])
def test_meta_tensors_are_refused_not_read(rng, where):
    """A weight or statistic on the meta device has no data: computing with
    it beside real tensors raises instead of returning leftover memory."""
    packed, state = _weight(rng, nested=True)
    if where == "weight":
        packed = packed.to("meta")
    elif where == "absmax":
        state = copy.copy(state)
        state.absmax = state.absmax.to("meta")
    else:
        state = copy.deepcopy(state)
        state.state2.absmax = state.state2.absmax.to("meta")
    for call in _both(packed, state):
        with pytest.raises(ValueError, match="on the meta device"):
            call()


def test_zero_d_inputs_are_named(rng):
    packed, state = _weight(rng, nested=False)
    with pytest.raises(ValueError, match="0-d"):
        q4torch.matmul_4bit(torch.tensor(1.0), packed, state)
    layer = q4torch.nn.Linear4bit(32, 64, quant_type="nf4").to("cpu")
    with pytest.raises(ValueError, match="0-d input"):
        layer(torch.tensor(1.0))


@pytest.mark.parametrize(
    "call",
    [
        lambda: F.int8_vectorwise_quant(torch.tensor(1.0)),
        lambda: F.int8_vectorwise_quant(torch.zeros(0)),
        lambda: F.int8_double_quant(torch.tensor(1.0)),
        lambda: F.int8_vectorwise_dequant(torch.ones(4, 3, dtype=torch.int8), torch.ones(2)),
        lambda: F.int8_mm_dequant(torch.ones(4, 3, dtype=torch.int32), torch.ones(2), torch.ones(3)),
        lambda: F.int8_mm_dequant(torch.ones(4, 3, dtype=torch.int32), torch.ones(4), torch.ones(2)),
    ],
    ids=["quant-0d", "quant-empty", "double-0d", "dequant-short", "mm-short-rows", "mm-short-cols"],
)
def test_int8_helpers_name_bad_shapes(call):
    with pytest.raises(ValueError, match=r"int8_\w+: "):
        call()


# ------------------------------------------------------------ issue 52: values


def test_non_finite_weights_with_nested_statistics_are_refused_naming_the_layer():
    net = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 64))
    with torch.no_grad():
        net[1].weight[5, 5] = float("inf")
    with pytest.raises(ValueError, match=r"^1: the weight holds NaN or Inf"):
        q4torch.replace_linear(net, "nf4")
    w = torch.zeros(64, 64)
    w[0, 0] = float("nan")
    with pytest.raises(ValueError, match="NaN or Inf"):
        F.quantize_4bit(w, quant_type="nf4", compress_statistics=True)
    F.quantize_4bit(w, quant_type="nf4", compress_statistics=False)  # its own block only, as bitsandbytes


def test_weights_near_the_float32_limit_round_trip_through_the_state_dict():
    w = torch.full((64, 64), 3e37)
    w[0, 0] = -3.3e38
    layer = q4torch.nn.Linear4bit(64, 64, bias=False, quant_type="nf4")
    layer.weight.data = w.clone()
    layer = layer.to("cpu")
    assert torch.isfinite(layer.weight.quant_state.offset)
    fresh = q4torch.nn.Linear4bit(64, 64, bias=False, quant_type="nf4").to("cpu")
    fresh.load_state_dict(layer.state_dict())
    got = F.dequantize_4bit(fresh.weight, fresh.weight.quant_state)
    assert torch.isfinite(got).all() and (got - w).abs().max() <= 0.15 * w.abs().max()


def test_gptq_damping_must_be_finite():
    net = torch.nn.Sequential(torch.nn.Linear(64, 64))
    with pytest.raises(ValueError, match="gptq_damp must be finite, got inf"):
        q4torch.replace_linear(net, "nf4", method="gptq", calibration=[torch.randn(4, 64)], gptq_damp=float("inf"))
