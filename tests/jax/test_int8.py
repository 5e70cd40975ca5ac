"""q4jax.matmul_8bit (LLM.int8) through the shared kernel."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from q4_reference import inputs
from q4_reference.matmul import rel_err

import q4
import q4jax


def _weight(rng, n, k):
    w = inputs.make(rng, (n, k), "float32") * 0.1
    cb, scb, _ = q4.int8_quantize_rows(w)
    return jnp.asarray(cb), jnp.asarray(scb)


@pytest.mark.parametrize("threshold", [0.0, 6.0])
def test_forward_equals_c_abi_and_gradients(rng, threshold):
    cb, scb = _weight(rng, 96, 128)
    x = inputs.make(rng, (7, 128), "float32")
    x[:, 3] = 20.0
    bias = inputs.make(rng, (96,), "float32")
    y = jax.jit(q4jax.matmul_8bit, static_argnames="threshold")(
        jnp.asarray(x), cb, scb, jnp.asarray(bias), threshold=threshold
    )
    want = q4.int8_linear(x, np.asarray(cb), np.asarray(scb), threshold, bias)
    assert np.array_equal(np.asarray(y), want)
    g = inputs.make(rng, (7, 96), "float32")
    _, vjp = jax.vjp(lambda a, b: q4jax.matmul_8bit(a, cb, scb, b, threshold), jnp.asarray(x), jnp.asarray(bias))
    dx, db = vjp(jnp.asarray(g))
    w_deq = np.asarray(cb, np.float64) * np.asarray(scb, np.float64)[:, None] / 127
    assert rel_err(dx, g.astype(np.float64) @ w_deq) < 1e-6
    assert rel_err(db, g.sum(0)) < 1e-6


def test_vmap_over_inputs(rng):
    cb, scb = _weight(rng, 40, 64)
    xs = jnp.asarray(inputs.make(rng, (4, 3, 64), "float32"))
    y = jax.vmap(lambda x: q4jax.matmul_8bit(x, cb, scb))(xs)
    for i in range(4):
        assert np.array_equal(np.asarray(y[i]), q4.int8_linear(np.asarray(xs[i]), np.asarray(cb), np.asarray(scb)))


def test_bad_input(rng):
    cb, scb = _weight(rng, 32, 64)
    with pytest.raises(ValueError, match="x has 63 features, the weight expects 64"):
        q4jax.matmul_8bit(jnp.ones((2, 63)), cb, scb)
    with pytest.raises(TypeError, match="weight must be a 2-D int8 array"):
        q4jax.matmul_8bit(jnp.ones((2, 64)), cb.astype(jnp.float32), scb)
    with pytest.raises(ValueError, match=r"weight_scale must be float32 of shape \(32,\)"):
        q4jax.matmul_8bit(jnp.ones((2, 64)), cb, scb[:-1])
    with pytest.raises(ValueError, match="threshold must be >= 0"):
        q4jax.matmul_8bit(jnp.ones((2, 64)), cb, scb, threshold=-1.0)
