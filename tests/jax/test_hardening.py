"""Bad operands of q4jax's 4-bit ops fail at trace time with a ValueError or
TypeError naming the value (never an XLA abort, a run-time error, or a
silently wrong answer)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from q4_reference import inputs

import q4jax


def _weight(rng, shape=(64, 32), nested=False):
    w = jnp.asarray(inputs.make(rng, shape, "float32"))
    return q4jax.quantize_4bit(w, 64, "nf4", compress_statistics=nested)


def _traced(fn, *args):
    """Trace and lower only: the check must fire before anything runs."""
    return jax.jit(fn).lower(*args)


def test_huge_state_shape_is_a_value_error_not_an_abort(rng):
    packed, state = _weight(rng)
    bad = dataclasses.replace(state, shape=(2**62 + 1, 4))
    x = jnp.ones((2, 4), jnp.float32)
    with pytest.raises(ValueError, match=r"packed has 1024 bytes, shape \(4611686018427387905, 4\) needs"):
        q4jax.matmul_4bit(x, packed, bad)
    with pytest.raises(ValueError, match="packed has 1024 bytes"):
        q4jax.dequantize_4bit(packed, bad)


@pytest.mark.parametrize("nested", [False, True], ids=["plain", "nested"])
def test_two_weights_concatenated_under_one_state_are_refused(rng, nested):
    p1, s1 = _weight(rng, nested=nested)
    p2, s2 = _weight(rng, nested=nested)
    packed = jnp.concatenate([p1, p2])
    state = dataclasses.replace(s1, absmax=jnp.concatenate([s1.absmax, s2.absmax]))
    x = jnp.ones((3, 32), jnp.float32)
    with pytest.raises(ValueError, match=r"packed has 2048 bytes, shape \(64, 32\) needs 1024"):
        q4jax.matmul_4bit(x, packed, state)
    with pytest.raises(ValueError, match="absmax has 64 values, shape \\(64, 32\\) with blocksize 64 needs 32"):
        q4jax.matmul_4bit(x, p1, state)


def test_short_absmax_to_matmul_fails_at_trace_time(rng):
    packed, state = _weight(rng)
    short = dataclasses.replace(state, absmax=state.absmax[:-1])
    x = jnp.ones((2, 32), jnp.float32)
    with pytest.raises(ValueError, match="absmax has 31 values"):
        _traced(q4jax.matmul_4bit, x, packed, short)
    with pytest.raises(ValueError, match="absmax has 31 values"):
        _traced(lambda x: jax.grad(lambda x: q4jax.matmul_4bit(x, packed, short).sum())(x), x)


@pytest.mark.parametrize(
    "change, err, message",
    [
        (dict(blocksize=0), ValueError, "blocksize must be a power of two in \\[32, 4096\\], got 0"),
        (dict(blocksize=48), ValueError, "got 48"),
        (dict(quant_type="int4"), ValueError, "quant_type must be 'nf4' or 'fp4', got 'int4'"),
        (dict(dtype="float64"), ValueError, "dtype must be float32, float16 or bfloat16, got '?float64"),
        (dict(shape=(64, 0)), ValueError, "shape must be a non-empty tuple of positive ints"),
        (dict(shape=(64, -32)), ValueError, "positive ints, got \\(64, -32\\)"),
        (dict(shape=()), ValueError, "non-empty"),
        (dict(nested_offset=jnp.float32(0.5)), ValueError, "nested_offset is set but nested_absmax is None"),
    ],
    ids=["blocksize-0", "blocksize-48", "quant-type", "dtype", "zero-dim", "negative-dim", "scalar", "offset-only"],
)
def test_bad_state_fields_are_named(rng, change, err, message):
    packed, state = _weight(rng)
    bad = dataclasses.replace(state, **change)
    x = jnp.ones((2, 32), jnp.float32)
    for call in (lambda: q4jax.matmul_4bit(x, packed, bad), lambda: q4jax.dequantize_4bit(packed, bad)):
        with pytest.raises(err, match=message):
            call()


def test_nested_state_fields_are_checked(rng):
    packed, state = _weight(rng, nested=True)
    x = jnp.ones((2, 32), jnp.float32)
    cases = [
        (dataclasses.replace(state, nested_offset=None), "needs nested_offset, one float32 value, got None"),
        (dataclasses.replace(state, nested_offset=jnp.zeros(2, jnp.float32)), "got float32\\(2,\\)"),
        (dataclasses.replace(state, nested_absmax=jnp.zeros(3, jnp.float32)), "nested_absmax must be float32\\[1\\]"),
        (dataclasses.replace(state, absmax=state.absmax.astype(jnp.float32)), "absmax must be uint8"),
    ]
    for bad, message in cases:
        with pytest.raises((ValueError, TypeError), match=message):
            q4jax.matmul_4bit(x, packed, bad)
        with pytest.raises((ValueError, TypeError), match=message):
            q4jax.dequantize_4bit(packed, bad)


def test_blockwise_code_book_length_is_checked():
    codes, absmax = q4jax.quantize_blockwise(jnp.linspace(-1, 1, 128), 64)
    with pytest.raises(ValueError, match="code must hold 256 values, got shape \\(16,\\)"):
        q4jax.dequantize_blockwise(codes, absmax, 64, code=jnp.linspace(-1, 1, 16))


def test_valid_state_still_matches_the_dequantized_product(rng):
    # the checks do not change results: fused matmul == x . dequantize(W)^T
    packed, state = _weight(rng, nested=True)
    x = jnp.asarray(np.random.default_rng(3).standard_normal((4, 32)), jnp.float32)
    w = q4jax.dequantize_4bit(packed, state)
    want = np.asarray(x, np.float64) @ np.asarray(w, np.float64).T
    got = np.asarray(q4jax.matmul_4bit(x, packed, state), np.float64)
    bound = 40 * np.finfo(np.float32).eps * (np.abs(np.asarray(x)) @ np.abs(np.asarray(w)).T)
    assert np.all(np.abs(got - want) <= bound + 1e-30)


@pytest.mark.parametrize("value", [np.nan, np.inf])
def test_quantize_model_refuses_a_non_finite_weight_with_nested_statistics(value):
    """The on-device quantizer cannot raise on data: without this check a NaN / Inf weight
    gives a non-finite nested offset and every block of the layer decodes to NaN."""
    from flax import nnx

    class Two(nnx.Module):
        def __init__(self):
            self.a = nnx.Linear(64, 32, rngs=nnx.Rngs(0))
            self.b = nnx.Linear(32, 16, rngs=nnx.Rngs(1))

    def with_bad_weight():
        model = Two()
        k = np.array(model.b.kernel.get_value())
        k[3, 5] = value
        model.b.kernel.set_value(jnp.asarray(k))
        return model

    with pytest.raises(ValueError, match=r"^b: the weight holds NaN or Inf \(in 1 of 8 blocks of 64"):
        q4jax.quantize_model(with_bad_weight(), "nf4")
    # without nested statistics only the bad block's own scale is non-finite: allowed
    plain = q4jax.quantize_model(with_bad_weight(), "nf4", compress_statistics=False)
    assert type(plain.b).__name__ == "Linear4bit"
