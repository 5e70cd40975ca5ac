"""LoRA over q4jax layers (flax.nnx): q4jax.add_lora, quantize_model over
nnx.LoRALinear, and training where only the adapters (nnx.LoRAParam) move.
The oracle for the adapted layer is its definition: base(x) + x A B, with the
base the same quantized layer (bytes compared) and A, B read back."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import q4jax
from q4jax import nn as qnn


class Net(nnx.Module):
    def __init__(self, rngs: nnx.Rngs, d=128, h=256, lora_rank=None):
        if lora_rank is None:
            self.up = nnx.Linear(d, h, rngs=rngs)
        else:
            self.up = nnx.LoRALinear(d, h, lora_rank=lora_rank, rngs=rngs)
        self.down = nnx.Linear(h, d, rngs=rngs)
        self.head = nnx.Linear(d, 4, rngs=rngs)

    def __call__(self, x):
        return self.head(jax.nn.relu(self.down(jax.nn.relu(self.up(x)))))


def data(n=64):
    rng = np.random.default_rng(1)
    return jnp.asarray(rng.standard_normal((n, 128)), jnp.float32), jnp.asarray(rng.integers(0, 4, n))


def quantized(kind="nf4", **kw):
    return q4jax.quantize_model(Net(nnx.Rngs(0), **kw), kind, skip=("head",))


def loss_fn(model, x, y):
    return optax.softmax_cross_entropy_with_integer_labels(model(x), y).mean()


@pytest.mark.parametrize("kind", ["nf4", "int8"])
def test_add_lora_wraps_quantized_layers_and_keeps_the_function(kind):
    model = quantized(kind)
    x, _ = data(8)
    before = model(x)
    q4jax.add_lora(model, 8, rngs=nnx.Rngs(3))
    assert isinstance(model.up, nnx.LoRA) and isinstance(model.down, nnx.LoRA)
    assert type(model.up.base_module) is (qnn.Linear8bit if kind == "int8" else qnn.Linear4bit)
    assert type(model.head) is nnx.Linear  # skipped by quantize_model: not quantized, not adapted
    np.testing.assert_array_equal(np.asarray(model(x)), np.asarray(before))  # B = 0


def test_adapted_layer_is_base_plus_x_a_b():
    model = q4jax.add_lora(quantized(), 4, rngs=nnx.Rngs(3))
    rng = np.random.default_rng(5)
    model.up.lora_b.set_value(jnp.asarray(rng.standard_normal((4, 256)) * 0.1, jnp.float32))
    x, _ = data(8)
    a, b = np.asarray(model.up.lora_a.get_value(), np.float64), np.asarray(model.up.lora_b.get_value(), np.float64)
    want = np.asarray(model.up.base_module(x), np.float64) + np.asarray(x, np.float64) @ a @ b
    np.testing.assert_allclose(np.asarray(model.up(x)), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kind", ["nf4", "int8"])
def test_only_adapters_train(kind):
    model = q4jax.add_lora(quantized(kind), 8, rngs=nnx.Rngs(3))
    adapters = nnx.state(model, nnx.LoRAParam)
    assert len(jax.tree.leaves(adapters)) == 4  # A and B of up and down
    frozen = jax.tree.map(np.asarray, nnx.state(model, nnx.Not(nnx.LoRAParam)))
    opt = nnx.Optimizer(model, optax.adamw(1e-2), wrt=nnx.LoRAParam)

    @nnx.jit
    def step(model, opt, x, y):
        loss, grads = nnx.value_and_grad(loss_fn, argnums=nnx.DiffState(0, nnx.LoRAParam))(model, x, y)
        opt.update(model, grads)
        return loss

    x, y = data()
    losses = [float(step(model, opt, x, y)) for _ in range(15)]
    assert losses[-1] < 0.8 * losses[0], losses
    after = jax.tree.map(np.asarray, nnx.state(model, nnx.Not(nnx.LoRAParam)))
    jax.tree.map(np.testing.assert_array_equal, after, frozen)  # quantized bytes, biases, head: unchanged


def test_quantize_model_quantizes_a_lora_linear_base_and_keeps_its_adapters():
    dense = Net(nnx.Rngs(0), lora_rank=4)
    rng = np.random.default_rng(7)
    dense.up.lora.lora_b.set_value(jnp.asarray(rng.standard_normal((4, 256)) * 0.1, jnp.float32))
    a0, b0 = np.asarray(dense.up.lora.lora_a.get_value()), np.asarray(dense.up.lora.lora_b.get_value())
    want_base = qnn.Linear4bit.from_linear(dense.up)
    model = q4jax.quantize_model(dense, "nf4", skip=("head",))
    assert isinstance(model.up, nnx.LoRA) and type(model.up.base_module) is qnn.Linear4bit
    assert (
        np.asarray(model.up.base_module.weight.get_value()).tobytes()
        == np.asarray(want_base.weight.get_value()).tobytes()
    )
    np.testing.assert_array_equal(np.asarray(model.up.lora_a.get_value()), a0)
    np.testing.assert_array_equal(np.asarray(model.up.lora_b.get_value()), b0)
    x, _ = data(4)
    want = np.asarray(want_base(x), np.float64) + np.asarray(x, np.float64) @ a0 @ b0
    np.testing.assert_allclose(np.asarray(model.up(x)), want, rtol=1e-5, atol=1e-5)
    assert len(jax.tree.leaves(nnx.state(model, nnx.LoRAParam))) == 2


def test_targets_select_layers():
    model = q4jax.add_lora(quantized(), 2, targets=("down",))
    assert isinstance(model.down, nnx.LoRA) and type(model.up) is qnn.Linear4bit


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="rank must be a positive int, got 0"):
        q4jax.add_lora(quantized(), 0)
    with pytest.raises(ValueError, match="quantize it first"):
        q4jax.add_lora(Net(nnx.Rngs(0)), 4)
    with pytest.raises(ValueError, match=r"targets \['nope'\] match none"):
        q4jax.add_lora(quantized(), 4, targets=("nope",))
    with pytest.raises(TypeError, match="nnx.Module"):
        q4jax.add_lora({"a": 1}, 4)
