"""q4jax quantize/dequantize: same bytes as the C ABI, jit, vmap, errors."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from q4_reference import inputs

import q4
import q4jax


@pytest.mark.parametrize("quant_type", ["nf4", "fp4"])
@pytest.mark.parametrize("dtype", inputs.DTYPES)
@pytest.mark.parametrize("blocksize", [32, 64, 4096])
def test_same_bytes_and_values_as_c_abi(rng, quant_type, dtype, blocksize):
    x = inputs.make(rng, (129, 67), dtype, "special")
    packed, state = q4jax.quantize_4bit(jnp.asarray(x), blocksize, quant_type)
    want_packed, want_absmax = q4.quantize_4bit(x, blocksize, quant_type)
    assert packed.shape == want_packed.shape and packed.dtype == jnp.uint8
    assert np.array_equal(np.asarray(packed), want_packed)
    assert np.array_equal(inputs.bits(np.asarray(state.absmax)), inputs.bits(want_absmax))
    y = q4jax.dequantize_4bit(packed, state)
    assert y.dtype == jnp.dtype(dtype) and y.shape == x.shape
    want = q4.dequantize_4bit(want_packed, want_absmax, x.shape, blocksize, quant_type, dtype)
    assert np.array_equal(inputs.bits(np.asarray(y)), inputs.bits(want))


def test_nested_matches_c_abi(rng):
    x = inputs.make(rng, (300, 257), "float32")
    packed, state = q4jax.quantize_4bit(jnp.asarray(x), 64, "nf4", compress_statistics=True)
    _, absmax = q4.quantize_4bit(x, 64, "nf4")
    codes, absmax2, offset = q4.quantize_nested(absmax)
    assert state.nested and np.array_equal(np.asarray(state.absmax), codes)
    assert np.array_equal(np.asarray(state.nested_absmax), absmax2) and float(state.nested_offset) == offset
    decoded = q4.dequantize_blockwise(codes, absmax2, 256, offset=offset)
    want = q4.dequantize_4bit(np.asarray(packed), decoded, x.shape, 64, "nf4")
    assert np.array_equal(np.asarray(q4jax.dequantize_4bit(packed, state)), want)


def test_vmap_over_stacked_weights_equals_per_item(rng):
    xs = inputs.make(rng, (3, 70, 33), "bfloat16")
    packed, state = jax.vmap(lambda a: q4jax.quantize_4bit(a, 64, "nf4", True))(jnp.asarray(xs))
    assert packed.shape == (3, (70 * 33 + 1) // 2, 1) and state.absmax.shape == (3, 37)
    ys = jax.vmap(q4jax.dequantize_4bit)(packed, state)
    for i in range(3):
        p1, s1 = q4jax.quantize_4bit(jnp.asarray(xs[i]), 64, "nf4", True)
        assert np.array_equal(np.asarray(packed[i]), np.asarray(p1))
        assert np.array_equal(np.asarray(state.nested_absmax[i]), np.asarray(s1.nested_absmax))
        assert np.array_equal(np.asarray(ys[i]), np.asarray(q4jax.dequantize_4bit(p1, s1)))


def test_quant_state_is_a_pytree_through_jit_and_scan(rng):
    x = jnp.asarray(inputs.make(rng, (4, 64, 64), "float32"))
    packed, state = jax.vmap(lambda a: q4jax.quantize_4bit(a, 64, "nf4"))(x)
    leaves = jax.tree_util.tree_leaves(state)
    assert len(leaves) == 1  # only absmax is an array leaf when not nested

    def step(carry, layer):
        p, s = layer
        return carry + q4jax.dequantize_4bit(p, s).sum(), None

    total, _ = jax.jit(lambda p, s: jax.lax.scan(step, 0.0, (p, s)))(packed, state)
    want = sum(
        float(q4jax.dequantize_4bit(packed[i], jax.tree.map(lambda a, i=i: a[i], state)).sum()) for i in range(4)
    )
    assert np.isclose(float(total), want, rtol=1e-6)


def test_blockwise_8bit_matches_c_abi(rng):
    x = inputs.make(rng, (5000,), "float32")
    codes, absmax = q4jax.quantize_blockwise(jnp.asarray(x), 256)
    want_codes, want_absmax = q4.quantize_blockwise(x, 256)
    assert np.array_equal(np.asarray(codes), want_codes) and np.array_equal(np.asarray(absmax), want_absmax)
    y = q4jax.dequantize_blockwise(codes, absmax, 256)
    assert np.array_equal(np.asarray(y), q4.dequantize_blockwise(want_codes, want_absmax, 256))


def test_round_trip_through_numpy_state(rng):
    x = jnp.asarray(inputs.make(rng, (64, 96), "float16"))
    packed, state = q4jax.quantize_4bit(x, 64, "fp4", True)
    entries = state.to_numpy().to_dict()
    restored = q4jax.QuantState.from_numpy(q4.QuantState.from_dict(entries))
    assert np.array_equal(
        np.asarray(q4jax.dequantize_4bit(packed, restored)), np.asarray(q4jax.dequantize_4bit(packed, state))
    )


@pytest.mark.parametrize(
    "call, exc, message",
    [
        (lambda: q4jax.quantize_4bit(jnp.ones(64, jnp.int32)), TypeError, "got int32"),
        (lambda: q4jax.quantize_4bit(jnp.ones(64), blocksize=100), ValueError, "got 100"),
        (lambda: q4jax.quantize_4bit(jnp.ones(64), quant_type="int4"), ValueError, "got 'int4'"),
        (lambda: q4jax.quantize_4bit(jnp.ones((0, 4))), ValueError, r"empty array \(shape \(0, 4\)\)"),
        (
            lambda: q4jax.dequantize_4bit(
                jnp.zeros((32, 1), jnp.uint8), q4jax.QuantState(jnp.ones(2), None, None, "nf4", 64, (64,), "float32")
            ),
            ValueError,
            "absmax has 2 values, shape \\(64,\\) with blocksize 64 needs 1",
        ),
        (
            lambda: q4jax.dequantize_4bit(
                jnp.zeros((31, 1), jnp.uint8), q4jax.QuantState(jnp.ones(1), None, None, "nf4", 64, (64,), "float32")
            ),
            ValueError,
            "packed has 31 bytes",
        ),
        (
            lambda: q4jax.dequantize_4bit(
                jnp.zeros((32, 1), jnp.int8), q4jax.QuantState(jnp.ones(1), None, None, "nf4", 64, (64,), "float32")
            ),
            TypeError,
            "packed must be uint8, got int8",
        ),
    ],
)
def test_bad_input_raises_at_trace_time(call, exc, message):
    with pytest.raises(exc, match=message):
        call()
