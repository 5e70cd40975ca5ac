"""q4jax.matmul_4bit: custom_vjp over the fused kernels under jit, vmap,
grad, checkpoint and scan."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from q4_reference import inputs
from q4_reference.matmul import check_against_baseline, rel_err

import q4jax


def _weight(rng, n, k, nested, quant_type="nf4"):
    w = jnp.asarray(inputs.make(rng, (n, k), "float32"))
    packed, state = q4jax.quantize_4bit(w, 64, quant_type, nested)
    return packed, state, np.asarray(q4jax.dequantize_4bit(packed, state))


@pytest.mark.parametrize("dtype", inputs.DTYPES)
@pytest.mark.parametrize("nested", [False, True])
@pytest.mark.parametrize("m", [1, 7, 64])
def test_forward_and_gradients(rng, dtype, nested, m):
    n, k = 72, 160
    packed, state, w = _weight(rng, n, k, nested)
    x = jnp.asarray(inputs.make(rng, (m, k), dtype))
    bias = jnp.asarray(inputs.make(rng, (n,), dtype))
    y = jax.jit(q4jax.matmul_4bit)(x, packed, state, bias)
    assert y.dtype == x.dtype and y.shape == (m, n)
    x32 = np.asarray(x, np.float32)
    check_against_baseline(np.asarray(y, np.float32) - np.asarray(bias, np.float32), x32, w.T, dtype)
    g = jnp.asarray(inputs.make(rng, (m, n), dtype))
    _, vjp = jax.vjp(lambda a, b: q4jax.matmul_4bit(a, packed, state, b), x, bias)
    dx, db = vjp(g)
    check_against_baseline(np.asarray(dx, np.float32), np.asarray(g, np.float32), w, dtype)
    np.testing.assert_allclose(np.asarray(db, np.float32), np.asarray(g, np.float32).sum(0), rtol=2e-2, atol=1e-2)


def test_vmap_over_inputs_and_stacked_weights(rng):
    packed, state, w = _weight(rng, 40, 64, True)
    xs = jnp.asarray(inputs.make(rng, (5, 3, 64), "float32"))
    y = jax.vmap(lambda x: q4jax.matmul_4bit(x, packed, state))(xs)
    # fp32 sums of 64 products: relative (norm) error within a few ulp
    assert rel_err(y, np.asarray(xs, np.float64) @ w.T.astype(np.float64)) < 1e-6
    ws = jnp.asarray(inputs.make(rng, (3, 40, 64), "float32"))
    ps, ss = jax.vmap(lambda a: q4jax.quantize_4bit(a, 64, "nf4", True))(ws)
    x = jnp.asarray(inputs.make(rng, (2, 64), "float32"))
    ys = jax.vmap(lambda p, s: q4jax.matmul_4bit(x, p, s))(ps, ss)
    for i in range(3):
        wi = np.asarray(q4jax.dequantize_4bit(ps[i], jax.tree.map(lambda a, i=i: a[i], ss)))
        assert rel_err(ys[i], np.asarray(x, np.float64) @ wi.T.astype(np.float64)) < 1e-6


@pytest.mark.parametrize(
    "policy",
    [
        None,
        jax.checkpoint_policies.nothing_saveable,
        jax.checkpoint_policies.dots_saveable,
        jax.checkpoint_policies.everything_saveable,
    ],
)
def test_grad_under_checkpoint_and_scan(rng, policy):
    layers = 3
    ws = jnp.asarray(inputs.make(rng, (layers, 64, 64), "float32")) * 0.2
    ps, ss = jax.vmap(lambda a: q4jax.quantize_4bit(a, 64, "nf4", True))(ws)
    x0 = jnp.asarray(inputs.make(rng, (4, 64), "float32"))

    def layer(h, weights):
        p, s = weights
        return jnp.tanh(q4jax.matmul_4bit(h, p, s)), None

    body = layer if policy is None else jax.checkpoint(layer, policy=policy)

    def loss(x):
        h, _ = jax.lax.scan(body, x, (ps, ss))
        return (h**2).sum()

    def loss_unrolled(x):
        h = x
        for i in range(layers):
            h, _ = layer(h, (ps[i], jax.tree.map(lambda a, i=i: a[i], ss)))
        return (h**2).sum()

    g = jax.jit(jax.grad(loss))(x0)
    g_ref = jax.grad(loss_unrolled)(x0)
    assert np.linalg.norm(np.asarray(g) - np.asarray(g_ref)) <= 1e-5 * np.linalg.norm(np.asarray(g_ref))


def test_bad_input(rng):
    packed, state, _ = _weight(rng, 32, 64, False)
    with pytest.raises(ValueError, match="x has 63 features, the weight expects 64"):
        q4jax.matmul_4bit(jnp.ones((2, 63)), packed, state)
    with pytest.raises(TypeError, match="got int32"):
        q4jax.matmul_4bit(jnp.ones((2, 64), jnp.int32), packed, state)
    with pytest.raises(ValueError, match=r"bias must have shape \(32,\)"):
        q4jax.matmul_4bit(jnp.ones((2, 64)), packed, state, jnp.ones(5))
    with pytest.raises(TypeError, match="packed must be uint8"):
        q4jax.matmul_4bit(jnp.ones((2, 64)), packed.astype(jnp.int8), state)
