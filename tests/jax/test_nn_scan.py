"""q4jax.nn layers under nnx.scan + nnx.remat over stacked layers, and
orbax checkpointing of nnx.state."""

import os
import tempfile

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
from flax import nnx
from q4_reference import inputs

import q4jax
from q4jax.nn import Linear4bit, Linear8bit

LAYERS, WIDTH = 3, 64
POLICIES = {
    "off": None,
    "nothing_saveable": jax.checkpoint_policies.nothing_saveable,
    "dots_saveable": jax.checkpoint_policies.dots_saveable,
    "everything_saveable": jax.checkpoint_policies.everything_saveable,
}


def _stack():
    @nnx.split_rngs(splits=LAYERS)
    @nnx.vmap(in_axes=(0,), out_axes=0)
    def make(rngs):
        return Linear4bit(WIDTH, WIDTH, quant_type="nf4", rngs=rngs)

    return make(nnx.Rngs(0))


def _loss_scan(stack, x, policy):
    @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
    @nnx.remat(policy=policy)
    def body(h, layer):
        return jnp.tanh(layer(h))

    return (body(x, stack) ** 2).sum()


def _loss_unrolled(stack, x):
    h = x
    for i in range(LAYERS):
        state = jax.tree.map(lambda a, i=i: a[i], stack.quant_state.get_value())
        h = jnp.tanh(q4jax.matmul_4bit(h, stack.weight.get_value()[i], state, stack.bias.get_value()[i]))
    return (h**2).sum()


@pytest.mark.parametrize("policy", list(POLICIES))
def test_nnx_scan_remat_matches_unrolled(rng, policy):
    stack = _stack()
    x = jnp.asarray(inputs.make(rng, (4, WIDTH), "float32"))
    want = np.asarray(jax.grad(lambda a: _loss_unrolled(stack, a))(x))
    grad = nnx.jit(nnx.grad(_loss_scan, argnums=1), static_argnums=2)
    got = np.asarray(grad(stack, x, POLICIES[policy]))
    # scan and the unrolled loop are fused differently by XLA: fp32 rounding only
    assert np.linalg.norm(got - want) <= 1e-5 * np.linalg.norm(want)


class _Model(nnx.Module):
    def __init__(self, rngs):
        self.a = Linear4bit(64, 32, quant_type="fp4", rngs=rngs)
        self.b = Linear8bit(32, 16, threshold=6.0, rngs=rngs)

    def __call__(self, x):
        return self.b(jnp.tanh(self.a(x)))


def test_orbax_round_trip(rng):
    source = _Model(nnx.Rngs(0))
    x = jnp.asarray(inputs.make(rng, (3, 64), "float32"))
    want = np.asarray(source(x))
    with tempfile.TemporaryDirectory() as d:
        checkpointer = ocp.StandardCheckpointer()
        checkpointer.save(os.path.join(d, "ckpt"), nnx.state(source))
        checkpointer.wait_until_finished()
        dest = _Model(nnx.Rngs(1))  # different weights until restored
        assert not np.array_equal(np.asarray(dest(x)), want)
        nnx.update(dest, checkpointer.restore(os.path.join(d, "ckpt"), nnx.state(dest)))
    assert np.array_equal(np.asarray(dest(x)), want)
    assert np.array_equal(np.asarray(dest.a.weight.get_value()), np.asarray(source.a.weight.get_value()))
