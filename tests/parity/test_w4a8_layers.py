"""W4A8 layers (activation_quant='int8') in both front ends: q4torch
Linear4bit / LinearNF4 / replace_linear and q4jax Linear4bit / quantize_model
give the same bytes, keep the setting through copies and checkpoint reloads
(where it is not stored: a checkpoint is the bitsandbytes format), train with
the exact gradient, and refuse what they cannot do with the value in the
message."""

from __future__ import annotations

import copy
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx
from q4_reference import inputs

import q4jax
import q4torch
from q4jax import nn as qnn

IN, OUT = 192, 40


class TorchNet(torch.nn.Module):
    def __init__(self, w1, b1, w2):
        super().__init__()
        self.fc1 = torch.nn.Linear(IN, OUT)
        self.fc2 = torch.nn.Linear(OUT, 8, bias=False)  # in_features 40: not a multiple of 64
        with torch.no_grad():
            self.fc1.weight.copy_(torch.from_numpy(w1))
            self.fc1.bias.copy_(torch.from_numpy(b1))
            self.fc2.weight.copy_(torch.from_numpy(w2))

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


class JaxNet(nnx.Module):
    def __init__(self, w1, b1, w2):
        self.fc1 = nnx.Linear(IN, OUT, rngs=nnx.Rngs(0))
        self.fc2 = nnx.Linear(OUT, 8, use_bias=False, rngs=nnx.Rngs(1))
        self.fc1.kernel.set_value(jnp.asarray(w1.T))
        self.fc1.bias.set_value(jnp.asarray(b1))
        self.fc2.kernel.set_value(jnp.asarray(w2.T))

    def __call__(self, x):
        return self.fc2(jax.nn.relu(self.fc1(x)))


def _weights(rng):
    return (
        inputs.make(rng, (OUT, IN), "float32"),
        inputs.make(rng, (OUT,), "float32"),
        inputs.make(rng, (8, OUT), "float32"),
    )


def test_replace_linear_and_quantize_model_agree(rng):
    w1, b1, w2 = _weights(rng)
    x = inputs.make(rng, (9, IN), "float32")
    tnet = q4torch.replace_linear(TorchNet(w1, b1, w2), "nf4", skip=("fc2",), activation_quant="int8")
    jnet = q4jax.quantize_model(JaxNet(w1, b1, w2), "nf4", skip=("fc2",), activation_quant="int8")
    assert tnet.fc1.activation_quant == "int8" and jnet.fc1.activation_quant == "int8"
    yt = tnet.fc1(torch.from_numpy(x)).detach().numpy()
    yj = np.asarray(jax.jit(lambda m, a: m.fc1(a))(jnet, jnp.asarray(x)))
    assert yt.tobytes() == yj.tobytes()
    # the same model without W4A8 computes something else, close to it
    plain = q4torch.replace_linear(TorchNet(w1, b1, w2), "nf4", skip=("fc2",))
    yp = plain.fc1(torch.from_numpy(x)).detach().numpy()
    assert yp.tobytes() != yt.tobytes()
    assert np.linalg.norm(yp - yt) / np.linalg.norm(yp) < 3e-2


def test_every_layer_must_fit_the_block(rng):
    """A layer whose in_features is not a multiple of its block stays float, named in
    both frameworks' report (strict=True: an error naming it)."""
    w1, b1, w2 = _weights(rng)
    _, rt = q4torch.replace_linear(TorchNet(w1, b1, w2), "nf4", activation_quant="int8", return_report=True)
    _, rj = q4jax.quantize_model(JaxNet(w1, b1, w2), "nf4", activation_quant="int8", return_report=True)
    for report in (rt, rj):
        assert [r.path for r in report.quantized] == ["fc1"]
        (row,) = report.left_float
        assert row.path == "fc2" and re.search(r"multiple of 64 .*got in_features 40", row.detail), row
    with pytest.raises(ValueError, match=r"strict=True.*fc2 .*multiple of 64 .*got in_features 40"):
        q4torch.replace_linear(TorchNet(w1, b1, w2), "nf4", activation_quant="int8", strict=True)
    with pytest.raises(ValueError, match=r"strict=True.*fc2 .*multiple of 64 .*got in_features 40"):
        q4jax.quantize_model(JaxNet(w1, b1, w2), "nf4", activation_quant="int8", strict=True)
    for bad in ("int4", 8, True):
        with pytest.raises(ValueError, match="activation_quant must be None or 'int8'"):
            q4torch.nn.Linear4bit(IN, OUT, activation_quant=bad)
        with pytest.raises(ValueError, match="activation_quant must be None or 'int8'"):
            qnn.Linear4bit(IN, OUT, activation_quant=bad, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="not to 'int8'"):
        q4torch.replace_linear(TorchNet(w1, b1, w2), "int8", activation_quant="int8")
    with pytest.raises(ValueError, match="not to 'int8'"):
        q4jax.quantize_model(JaxNet(w1, b1, w2), "int8", activation_quant="int8")
    with pytest.raises(ValueError, match="multiple of 64 .*got in_features 40"):
        q4torch.nn.LinearNF4(40, 8, activation_quant="int8")
    layer = qnn.Linear4bit(IN, OUT, activation_quant="int8", rngs=nnx.Rngs(0))
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("model",))
    with pytest.raises(ValueError, match="W4A8 layer .* cannot be sharded"):
        layer.shard(q4jax.LinearSharding(mesh, "column", "model"))


def test_copies_and_reloads_keep_the_setting(rng):
    """The setting belongs to the layer: deepcopy keeps it, the checkpoint (the
    bitsandbytes format) does not hold it, and reloading into a W4A8 layer
    computes W4A8 on the loaded weight."""
    w1, b1, w2 = _weights(rng)
    x = torch.from_numpy(inputs.make(rng, (4, IN), "float32"))
    tnet = q4torch.replace_linear(TorchNet(w1, b1, w2), "nf4", skip=("fc2",), activation_quant="int8")
    y = tnet(x).detach()
    twin = copy.deepcopy(tnet)
    assert twin.fc1.activation_quant == "int8" and torch.equal(twin(x), y)
    sd = tnet.state_dict()
    assert not any("activation" in k for k in sd)
    other = q4torch.replace_linear(TorchNet(*_weights(rng)), "nf4", skip=("fc2",), activation_quant="int8")
    other(x)  # a forward first: the reload must still take
    other.load_state_dict(sd)
    assert torch.equal(other(x), y)


def test_training_step_uses_the_exact_gradient(rng):
    """Gradients of a W4A8 layer's input and bias are those of the exact
    product (straight through the activation rounding), in both front ends."""
    w1, b1, _ = _weights(rng)
    x = inputs.make(rng, (6, IN), "float32")
    for aq in (None, "int8"):
        layer = q4torch.nn.Linear4bit(IN, OUT, quant_type="nf4", activation_quant=aq)
        layer.weight = q4torch.nn.Params4bit(torch.from_numpy(w1), requires_grad=False, quant_type="nf4")
        layer.bias = torch.nn.Parameter(torch.from_numpy(b1.copy()))
        layer = layer.to("cpu")
        xt = torch.from_numpy(x).requires_grad_()
        layer(xt).square().sum().backward()
        jl = qnn.Linear4bit(IN, OUT, quant_type="nf4", activation_quant=aq, rngs=nnx.Rngs(0))
        jl.set_weight(jnp.asarray(w1))
        jl.bias.set_value(jnp.asarray(b1))
        y = jl(jnp.asarray(x))
        dx = jax.grad(lambda a, layer=jl: jnp.sum(jnp.square(layer(a))))(jnp.asarray(x))
        # d/dx sum(y^2) = 2 y W: y is the W4A8 output, the W-product the exact one
        assert xt.grad.numpy().tobytes() == np.asarray(dx).tobytes()
        if aq == "int8":
            # the cotangent 2 y (y: the W4A8 output) through the exact product's vjp
            packed, state = jl.weight.get_value(), jl.quant_state.get_value()
            _, vjp = jax.vjp(lambda a, p=packed, s=state: q4jax.matmul_4bit(a, p, s), jnp.asarray(x))
            assert np.asarray(vjp(2 * y)[0]).tobytes() == np.asarray(dx).tobytes()
