"""Remat and streaming in JAX: layers run with lax.scan over stacked weights,
each step copying its layer's packed bytes into a small recycled pool carried
through the scan and reading the weight back from the pool. Gradients of the
upstream parameter must equal, bit for bit, those of the same scan where each
layer reads its own weights, and the unrolled Python loop within fp32
rounding — with remat off, on, and under the nothing/dots saveable policies.
A control that reads a stale pool slot must fail the same comparison."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from q4_reference import inputs

import q4jax

LAYERS, WIDTH = 4, 64
POLICIES = {
    "off": None,
    "on": "default",
    "nothing_saveable": jax.checkpoint_policies.nothing_saveable,
    "dots_saveable": jax.checkpoint_policies.dots_saveable,
}


def _weights(rng):
    ws = jnp.asarray(inputs.make(rng, (LAYERS, WIDTH, WIDTH), "float32")) * 0.2
    return jax.vmap(lambda w: q4jax.quantize_4bit(w, 64, "nf4", True))(ws)


def _wrap(body, policy):
    if policy is None:
        return body
    return jax.checkpoint(body) if policy == "default" else jax.checkpoint(body, policy=policy)


def _loss_owned(upstream, x, packed, state, policy):
    def body(h, layer):
        p, s = layer
        return jnp.tanh(q4jax.matmul_4bit(h, p, s)), None

    h, _ = jax.lax.scan(_wrap(body, policy), x * upstream, (packed, state))
    return (h**2).sum()


def _loss_streamed(upstream, x, packed, state, policy, pool_size, stale=False):
    pool = jnp.zeros((pool_size,) + packed.shape[1:], packed.dtype)

    def body(carry, layer):
        h, pool, step = carry
        p, s = layer
        slot = step % pool_size
        pool = jax.lax.dynamic_update_index_in_dim(pool, p, slot, 0)  # the streaming copy
        read = (slot + 1) % pool_size if stale else slot
        weight = jax.lax.dynamic_index_in_dim(pool, read, 0, keepdims=False)
        return (jnp.tanh(q4jax.matmul_4bit(h, weight, s)), pool, step + 1), None

    (h, _, _), _ = jax.lax.scan(_wrap(body, policy), (x * upstream, pool, 0), (packed, state))
    return (h**2).sum()


def _loss_unrolled(upstream, x, packed, state):
    h = x * upstream
    for i in range(LAYERS):
        h = jnp.tanh(q4jax.matmul_4bit(h, packed[i], jax.tree.map(lambda a, i=i: a[i], state)))
    return (h**2).sum()


@pytest.mark.parametrize("policy", list(POLICIES))
@pytest.mark.parametrize("pool_size", [1, 2, 3])
def test_streamed_scan_gradients(rng, policy, pool_size):
    packed, state = _weights(rng)
    x = jnp.asarray(inputs.make(rng, (4, WIDTH), "float32"))
    upstream = jnp.asarray(inputs.make(rng, (WIDTH,), "float32"))
    pol = POLICIES[policy]
    owned = jax.jit(jax.grad(_loss_owned), static_argnums=4)(upstream, x, packed, state, pol)
    streamed = jax.jit(jax.grad(_loss_streamed), static_argnums=(4, 5))(upstream, x, packed, state, pol, pool_size)
    assert np.array_equal(np.asarray(owned), np.asarray(streamed))
    unrolled = jax.grad(_loss_unrolled)(upstream, x, packed, state)
    # XLA fuses a scan and an unrolled loop differently: fp32 rounding only
    assert np.linalg.norm(np.asarray(owned) - np.asarray(unrolled)) <= 1e-5 * np.linalg.norm(np.asarray(unrolled))


def test_stale_slot_control_fails(rng):
    """Reading the slot the step did not write (another layer's bytes, or zeros)
    gives different gradients: the comparison above can fail."""
    packed, state = _weights(rng)
    x = jnp.asarray(inputs.make(rng, (4, WIDTH), "float32"))
    upstream = jnp.asarray(inputs.make(rng, (WIDTH,), "float32"))
    owned = jax.grad(_loss_owned)(upstream, x, packed, state, None)
    for pool_size in (2, 3):
        stale = jax.grad(_loss_streamed)(upstream, x, packed, state, None, pool_size, True)
        assert not np.allclose(np.asarray(owned), np.asarray(stale))
