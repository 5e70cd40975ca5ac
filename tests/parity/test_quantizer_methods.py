"""method='mse' / 'gptq' through both front ends (q4torch.replace_linear,
q4jax.quantize_model): the same float weights (and, for gptq, the same
calibration inputs reaching a layer) give the same bytes in both, equal to
q4's framework-neutral quantizers; a layer built so is an ordinary quantized
layer (its state dict is the bitsandbytes format, bitsandbytes decodes it);
gptq lowers the calibration-set output error against absmax; bad requests
are refused with the value named."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx
from torch import nn

import q4jax
import q4torch
from q4._src import quantizers as Q
from q4._src.weights import dequantize_weight_4bit

D, H = 128, 256


def weights():
    rng = np.random.default_rng(21)
    w = {name: (rng.standard_normal(shape) / np.sqrt(shape[1])).astype(np.float32) for name, shape in
         (("a", (H, D)), ("b", (H, D)), ("c", (D, H)))}  # fmt: skip
    for v in w.values():  # outliers, where the scale choice matters
        v.reshape(-1)[rng.integers(0, v.size, v.size // 40)] *= 5
    mix = rng.standard_normal((D, D)) / np.sqrt(D)
    calib = [(rng.standard_normal((4, 16, D)) @ (np.eye(D) + 2 * mix)).astype(np.float32) for _ in range(4)]
    return w, calib


class TorchNet(nn.Module):
    """a and b both read the input (the same calibration activations in both
    frameworks); c reads a's output."""

    def __init__(self, w):
        super().__init__()
        for name, v in w.items():
            lin = nn.Linear(v.shape[1], v.shape[0], bias=False)
            lin.weight.data = torch.from_numpy(v.copy())
            setattr(self, name, lin)

    def forward(self, x):
        return self.c(torch.relu(self.a(x))) + self.b(x).sum(-1, keepdim=True)


class JaxNet(nnx.Module):
    def __init__(self, w):
        for name, v in w.items():
            lin = nnx.Linear(v.shape[1], v.shape[0], use_bias=False, rngs=nnx.Rngs(0))
            lin.kernel.set_value(jnp.asarray(v.T))
            setattr(self, name, lin)

    def __call__(self, x):
        return self.c(jax.nn.relu(self.a(x))) + self.b(x).sum(-1, keepdims=True)


def torch_bytes(model, name):
    layer = getattr(model, name)
    return {k: v.numpy() for k, v in layer.state_dict().items()}


def jax_bytes(model, name):
    return {k: np.asarray(v) for k, v in getattr(model, name)._state_entries().items()}


@pytest.mark.parametrize("method", ["mse", "gptq"])
@pytest.mark.parametrize("quant_type", ["nf4", "fp4"])
def test_both_front_ends_give_the_same_bytes(method, quant_type):
    w, calib = weights()
    kw = dict(method=method, calibration=calib if method == "gptq" else None)
    tm = q4torch.quantize_model(TorchNet(w), quant_type, **{**kw, "calibration": (
        None if method != "gptq" else [torch.from_numpy(x) for x in calib])})  # fmt: skip
    jm = q4jax.quantize_model(JaxNet(w), quant_type, **{**kw, "calibration": (
        None if method != "gptq" else [jnp.asarray(x) for x in calib])})  # fmt: skip
    # a and b see the same inputs in both frameworks (c sees each framework's own a)
    for name in ("a", "b") if method == "gptq" else ("a", "b", "c"):
        t, j = torch_bytes(tm, name), jax_bytes(jm, name)
        assert sorted(t) == sorted(j)
        for k in t:
            assert t[k].tobytes() == j[k].tobytes(), (name, k)
    # and equal to the framework-neutral quantizer's
    if method == "mse":
        packed, st = Q.quantize_mse(w["a"], 64, quant_type, True)
    else:
        x = np.concatenate([c.reshape(-1, D) for c in calib]).astype(np.float64)
        packed, st = Q.gptq(w["a"], x.T @ x, 64, quant_type, True)
    t = torch_bytes(tm, "a")
    assert t["weight"].tobytes() == packed.tobytes()
    assert t["weight.absmax"].tobytes() == st.absmax.tobytes()


def test_quantize_model_is_replace_linear():
    """q4torch.quantize_model is the same function as replace_linear (the
    name q4jax uses), not a copy that could drift."""
    assert q4torch.quantize_model is q4torch.replace_linear


def test_gptq_damping_reaches_both_front_ends():
    w, calib = weights()
    tm = q4torch.replace_linear(
        TorchNet(w), "nf4", method="gptq", calibration=[torch.from_numpy(x) for x in calib], gptq_damp=0.3
    )
    jm = q4jax.quantize_model(
        JaxNet(w), "nf4", method="gptq", calibration=[jnp.asarray(x) for x in calib], gptq_damp=0.3
    )
    x = np.concatenate([c.reshape(-1, D) for c in calib]).astype(np.float64)
    packed, st = Q.gptq(w["a"], x.T @ x, 64, "nf4", True, damp=0.3)
    default, _ = Q.gptq(w["a"], x.T @ x, 64, "nf4", True)
    assert packed.tobytes() != default.tobytes()
    assert torch_bytes(tm, "a")["weight"].tobytes() == packed.tobytes() == jax_bytes(jm, "a")["weight"].tobytes()
    with pytest.raises(ValueError, match="gptq_damp must be > 0, got 0"):
        q4torch.replace_linear(TorchNet(w), "nf4", method="gptq", calibration=[], gptq_damp=0)


def test_gptq_lowers_the_output_error_on_the_calibration_set():
    w, calib = weights()
    x = np.concatenate([c.reshape(-1, D) for c in calib]).astype(np.float64)
    errs = {}
    for method in ("absmax", "mse", "gptq"):
        m = q4torch.replace_linear(
            TorchNet(w),
            "nf4",
            method=method,
            calibration=[torch.from_numpy(c) for c in calib] if method == "gptq" else None,
        )
        layer = m.a
        deq = dequantize_weight_4bit(layer.weight.data.numpy(), layer.weight.quant_state.to_numpy())
        errs[method] = np.linalg.norm((w["a"].astype(np.float64) - deq) @ x.T)
    assert errs["gptq"] < 0.8 * errs["mse"] and errs["mse"] < errs["absmax"], errs


def test_the_layers_are_ordinary_quantized_layers():
    """A q4torch layer built by mse reloads from its own state dict, and its
    forward equals x @ dequantized W^T within fp32 rounding."""
    w, _ = weights()
    m = q4torch.replace_linear(TorchNet(w), "nf4", method="mse")
    sd = {k: v.clone() for k, v in m.state_dict().items()}
    again = q4torch.replace_linear(TorchNet(w), "nf4")
    again.load_state_dict(sd)
    x = torch.from_numpy(weights()[1][0])
    with torch.no_grad():
        assert torch.equal(again(x), m(x))
        deq = torch.from_numpy(dequantize_weight_4bit(m.a.weight.data.numpy(), m.a.weight.quant_state.to_numpy()))
        torch.testing.assert_close(m.a(x), x @ deq.T, rtol=1e-5, atol=1e-5)


def test_bad_requests_are_refused():
    w, calib = weights()
    with pytest.raises(ValueError, match="method must be one of absmax, mse, gptq, got 'best'"):
        q4torch.replace_linear(TorchNet(w), "nf4", method="best")
    with pytest.raises(ValueError, match="needs calibration"):
        q4torch.replace_linear(TorchNet(w), "nf4", method="gptq")
    with pytest.raises(ValueError, match="only it takes calibration"):
        q4jax.quantize_model(JaxNet(w), "nf4", method="mse", calibration=calib)
    with pytest.raises(ValueError, match="not to 'int8'"):
        q4jax.quantize_model(JaxNet(w), "int8", method="mse")
    with pytest.raises(ValueError, match=r"multiple of the block size 256: \['a', 'b'\]"):
        q4torch.replace_linear(TorchNet(w), "nf4", blocksize=256, method="gptq", calibration=[torch.zeros(1, D)])
    with pytest.raises(ValueError, match=r"saw no calibration input: \['c'\]"):
        q4jax.quantize_model(JaxNet(w), "nf4", method="gptq", calibration=[], skip=("a", "b"))
