"""q4jax.optim as optax transformations: with nnx.Optimizer under nnx.jit, the state
bytes of the kernel (same as the oracle's), non-finite gradient blocks counted and
left unchanged, bad arguments named."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from q4_reference import optim8 as oracle
from q4_testing.optim_cases import check_applied_params

from q4._src import optim8
from q4jax import optim as joptim


def test_nnx_optimizer_under_jit_matches_the_oracle(rng):
    model = nnx.Linear(64, 80, rngs=nnx.Rngs(0))  # kernel: 5120 elements, 8-bit; bias: 80, fp32
    optimizer = nnx.Optimizer(model, joptim.adamw_8bit(learning_rate=1e-3), wrt=nnx.Param)
    x = jnp.asarray(rng.standard_normal((8, 64)).astype(np.float32))

    @nnx.jit
    def train_step(model, optimizer, x):
        grads = nnx.grad(lambda m: jnp.mean(m(x) ** 2))(model)
        optimizer.update(model, grads)
        return grads

    kernel0 = np.asarray(model.kernel[...]).copy()
    grads = train_step(model, optimizer, x)
    state = optimizer.opt_state
    g = np.asarray(grads.kernel[...]).reshape(-1)
    s1, a1, s2, a2 = oracle.initial_state(g.size, "adam")
    maps = dict(qmap1=optim8.qmap(True), qmap2=optim8.qmap(False))
    want = oracle.update(
        "adam", g, kernel0, s1, a1, s2, a2, step=1, lr=1e-3, beta1=0.9, beta2=0.999, weight_decay=1e-2, **maps
    )
    leaf = lambda t: jax.tree.leaves(t, is_leaf=lambda v: hasattr(v, "dtype"))  # noqa: E731
    s1_got = [v for v in leaf(state.state1) if getattr(v, "dtype", None) == jnp.uint8]
    assert len(s1_got) == 1
    np.testing.assert_array_equal(np.asarray(s1_got[0]).reshape(-1), want[1])
    check_applied_params(kernel0.reshape(-1), np.asarray(model.kernel[...]).reshape(-1), want[0])
    assert int(state.step) == 1


def test_nonfinite_gradient_blocks_are_counted_and_unchanged(rng):
    params = {"w": jnp.asarray(rng.standard_normal(1024).astype(np.float32))}
    tx = joptim.lion_8bit(learning_rate=1e-2, min_8bit_size=0)
    state = tx.init(params)
    g = rng.standard_normal(1024).astype(np.float32)
    g[700] = np.inf
    updates, state = jax.jit(tx.update)({"w": jnp.asarray(g)}, state, params)
    new = optax.apply_updates(params, updates)
    assert int(state.skipped_blocks) == 1
    np.testing.assert_array_equal(np.asarray(new["w"])[512:768], np.asarray(params["w"])[512:768])
    assert not np.array_equal(np.asarray(new["w"])[:512], np.asarray(params["w"])[:512])
    assert not np.asarray(state.state1["w"])[512:768].any()  # still the fresh state


def test_schedule_and_bad_arguments(rng):
    params = {"w": jnp.ones(4096)}
    tx = joptim.sgd_8bit(optax.linear_schedule(1e-2, 0.0, 10), momentum=0.9)
    state = tx.init(params)
    updates, state = tx.update({"w": jnp.ones(4096)}, state, params)
    np.testing.assert_allclose(np.asarray(updates["w"]), -1e-2, rtol=1e-6)
    with pytest.raises(ValueError, match="b1 must be in \\[0, 1\\), got 1.0"):
        joptim.adamw_8bit(b1=1.0)
    with pytest.raises(ValueError, match="sgd_8bit needs momentum > 0"):
        joptim.sgd_8bit(1e-2, momentum=0)
    with pytest.raises(ValueError, match="rmsprop_8bit needs decay > 0"):
        joptim.rmsprop_8bit(decay=0)
    with pytest.raises(ValueError, match="decay must be in \\(0, 1\\), got 1.5"):
        joptim.rmsprop_8bit(decay=1.5)
    with pytest.raises(ValueError, match="needs params"):
        tx.update({"w": jnp.ones(4096)}, state)


def test_empty_leaves_take_fp32_state():
    tx = joptim.adamw_8bit(min_8bit_size=0)
    params = {"e": jnp.zeros((0, 4)), "w": jnp.ones(300)}
    state = tx.init(params)
    _, state = tx.update(params, state, params)
    assert state.state1["e"].dtype == jnp.float32 and state.state1["w"].dtype == jnp.uint8
