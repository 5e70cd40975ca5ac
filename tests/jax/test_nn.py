"""q4jax.nn (flax.nnx): same bytes as q4torch, checkpoint interchange, copying,
reload, gradients through nnx.grad, and errors."""

from __future__ import annotations

import copy
import gc
import logging
import weakref

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx
from q4_reference import inputs
from q4_reference.matmul import check_against_baseline, rel_err

import q4jax
import q4torch
from q4jax import nn as qnn

IN, OUT = 128, 48


def _linear(rng, in_f=IN, out_f=OUT, bias=True):
    """An nnx.Linear holding W [out, in] (as kernel W.T) and a bias, from the seeded rng."""
    w = inputs.make(rng, (out_f, in_f), "float32")
    b = inputs.make(rng, (out_f,), "float32")
    lin = nnx.Linear(in_f, out_f, use_bias=bias, rngs=nnx.Rngs(0))
    lin.kernel.set_value(jnp.asarray(w.T))
    if bias:
        lin.bias.set_value(jnp.asarray(b))
    return lin, w, b


def _torch_sd(module) -> dict[str, np.ndarray]:
    return {k: v.detach().cpu().numpy().copy() for k, v in module.state_dict().items()}


def _assert_same_entries(got: dict, want: dict) -> None:
    assert sorted(got) == sorted(want)
    for k in want:
        g, w = np.asarray(got[k]), np.asarray(want[k])
        assert g.dtype == w.dtype and g.shape == w.shape, (k, g.dtype, g.shape, w.dtype, w.shape)
        assert g.tobytes() == w.tobytes(), k


# ------------------------------------------------------------------ parity with q4torch


@pytest.mark.parametrize("nested", [True, False], ids=["nested", "flat"])
@pytest.mark.parametrize("quant_type", ["nf4", "fp4"])
def test_linear4bit_same_bytes_and_outputs_as_q4torch(rng, quant_type, nested):
    lin, w, b = _linear(rng)
    layer = qnn.Linear4bit.from_linear(lin, quant_type=quant_type, compress_statistics=nested)
    t = q4torch.nn.Linear4bit(IN, OUT, compress_statistics=nested, quant_type=quant_type)
    with torch.no_grad():
        t.weight.data = torch.from_numpy(w.copy())
        t.bias.copy_(torch.from_numpy(b))
    t.quantize()
    _assert_same_entries(qnn.state_dict(layer), _torch_sd(t))

    x = inputs.make(rng, (5, IN), "float32")
    g = inputs.make(rng, (5, OUT), "float32")
    y, vjp = jax.vjp(layer, jnp.asarray(x))
    (dx,) = vjp(jnp.asarray(g))
    xt = torch.from_numpy(x.copy()).requires_grad_(True)
    yt = t(xt)
    yt.backward(torch.from_numpy(g))
    # both against the fp64 product with the dequantized weight, judged by dense fp32's error
    wq = np.asarray(q4jax.dequantize_4bit(layer.weight.get_value(), layer.quant_state.get_value()))
    for got_y, got_dx in ((np.asarray(y), np.asarray(dx)), (yt.detach().numpy(), xt.grad.numpy())):
        check_against_baseline(got_y - b, x, wq.T, "float32", what="y")
        check_against_baseline(got_dx, g, wq, "float32", what="dx")


def test_linear8bit_same_bytes_and_outputs_as_q4torch(rng):
    lin, w, b = _linear(rng)
    layer = qnn.Linear8bit.from_linear(lin)
    t = q4torch.nn.Linear8bitLt(IN, OUT, has_fp16_weights=False)
    with torch.no_grad():
        t.weight = q4torch.nn.Int8Params(torch.from_numpy(w.copy()), requires_grad=False, has_fp16_weights=False)
        t.bias.copy_(torch.from_numpy(b))
    t = t.to("cpu")
    assert t.weight.dtype == torch.int8
    _assert_same_entries(qnn.state_dict(layer), _torch_sd(t))

    x = inputs.make(rng, (5, IN), "float32")
    g = inputs.make(rng, (5, OUT), "float32")
    y, vjp = jax.vjp(layer, jnp.asarray(x))
    (dx,) = vjp(jnp.asarray(g))
    xt = torch.from_numpy(x.copy()).requires_grad_(True)
    yt = t(xt)
    yt.backward(torch.from_numpy(g))
    # same kernel, same operands: identical up to fp32 summation order
    assert rel_err(y, yt.detach().numpy()) < 1e-6
    assert rel_err(dx, xt.grad.numpy()) < 1e-6


# ------------------------------------------------------------------ checkpoints


class _Stack(nnx.Module):
    def __init__(self, seed: int, quant_type: str = "nf4"):
        r = np.random.default_rng(seed)
        self.layers = nnx.List([_linear(r, IN, IN)[0], _linear(r, IN, IN)[0]])
        self.proj = _linear(r, IN, OUT)[0]
        self.lm_head = _linear(r, OUT, 8)[0]
        qnn.quantize_model(self, quant_type)

    def __call__(self, x):
        for layer in self.layers:
            x = jax.nn.gelu(layer(x))
        return self.lm_head(self.proj(x))


class _TorchStack(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList([q4torch.nn.LinearNF4(IN, IN), q4torch.nn.LinearFP4(IN, IN)])
        self.proj = q4torch.nn.Linear8bitLt(IN, OUT, has_fp16_weights=False)
        self.lm_head = torch.nn.Linear(OUT, 8)


def test_checkpoint_interchange_q4torch_to_q4jax_to_q4torch():
    torch.manual_seed(0)
    src = _TorchStack()
    src.layers[0].quantize()
    src.layers[1].quantize()
    src.proj = src.proj.to("cpu")
    ckpt = _torch_sd(src)
    assert "layers.1.weight.quant_state.bitsandbytes__fp4" in ckpt and "proj.SCB" in ckpt

    # a JAX model with other weights and other layer settings (fp4/flat, nf4) takes the checkpoint's
    model = _Stack(seed=5, quant_type="nf4")
    model.proj = qnn.Linear8bit(IN, OUT, rngs=nnx.Rngs(1))
    model.layers[1] = qnn.Linear4bit(IN, IN, quant_type="nf4", compress_statistics=False, rngs=nnx.Rngs(2))
    qnn.load_state_dict(model, ckpt)
    assert model.layers[1].quant_type == "fp4"
    _assert_same_entries(qnn.state_dict(model), ckpt)

    dst = _TorchStack()
    dst.load_state_dict({k: torch.from_numpy(v.copy()) for k, v in qnn.state_dict(model).items()})
    _assert_same_entries(_torch_sd(dst), ckpt)
    x = np.random.default_rng(3).standard_normal((4, IN)).astype(np.float32)
    with torch.no_grad():
        h = torch.from_numpy(x)
        for layer in dst.layers:
            h = torch.nn.functional.gelu(layer(h), approximate="tanh")
        want = dst.lm_head(dst.proj(h)).numpy()
    got = np.asarray(model(jnp.asarray(x)))
    assert rel_err(got, want) < 1e-5  # same kernels; gelu and the dense head differ by fp32 rounding only


def test_reload_after_forward_switching_checkpoints():
    x = jnp.asarray(np.random.default_rng(7).standard_normal((3, IN)), jnp.float32)
    ck1, ck2 = qnn.state_dict(_Stack(1)), qnn.state_dict(_Stack(2, "fp4"))
    ck1_before = copy.deepcopy(ck1)

    def fresh(seed, kind):  # eager and jitted outputs of a freshly built model (XLA fuses jit differently)
        m = _Stack(seed, kind)
        return np.asarray(m(x)), np.asarray(nnx.jit(lambda m, x: m(x))(m, x))

    ref1, ref2 = fresh(1, "nf4"), fresh(2, "fp4")
    assert not np.array_equal(ref1[0], ref2[0])

    model = _Stack(3, "int8")
    model.layers[0] = qnn.Linear4bit(IN, IN, rngs=nnx.Rngs(0))
    model.layers[1] = qnn.Linear4bit(IN, IN, rngs=nnx.Rngs(0))
    model.proj = qnn.Linear4bit(IN, OUT, rngs=nnx.Rngs(0))
    fwd = nnx.jit(lambda m, x: m(x))
    fwd(model, x)  # ran (and compiled) before any load
    model(x)
    for ck, (eager, jitted) in ((ck1, ref1), (ck2, ref2), (ck1, ref1)):
        qnn.load_state_dict(model, ck)
        np.testing.assert_array_equal(np.asarray(fwd(model, x)), jitted)
        np.testing.assert_array_equal(np.asarray(model(x)), eager)
    _assert_same_entries(ck1, ck1_before)

    # the dict state_dict returns is a copy: writing into it changes nothing
    out = qnn.state_dict(model)
    for v in out.values():
        v[...] = 0
    np.testing.assert_array_equal(np.asarray(fwd(model, x)), ref1[1])


def test_reload_linear8bit_from_torch_after_forward(rng):
    lin, w, b = _linear(rng)
    layer = qnn.Linear8bit(IN, OUT, rngs=nnx.Rngs(4))
    x = jnp.asarray(inputs.make(rng, (2, IN), "float32"))
    layer(x)
    t = q4torch.nn.Linear8bitLt(IN, OUT, has_fp16_weights=False)
    t.weight = q4torch.nn.Int8Params(torch.from_numpy(w.copy()), requires_grad=False, has_fp16_weights=False)
    t = t.to("cpu")
    ck = _torch_sd(t)
    qnn.load_state_dict(layer, ck)
    lin.bias.set_value(jnp.asarray(ck["bias"]))  # torch's own initial bias
    np.testing.assert_array_equal(np.asarray(layer(x)), np.asarray(qnn.Linear8bit.from_linear(lin)(x)))


# ------------------------------------------------------------------ copying


class _Tied(nnx.Module):
    def __init__(self, rng):
        self.a = qnn.Linear4bit.from_linear(_linear(rng, IN, IN)[0])
        self.b = qnn.Linear4bit.from_linear(_linear(rng, IN, IN)[0])
        self.b.weight, self.b.quant_state = self.a.weight, self.a.quant_state  # shared 4-bit state
        self.c = qnn.Linear8bit.from_linear(_linear(rng, IN, OUT)[0])

    def __call__(self, x):
        return self.c(self.b(jax.nn.relu(self.a(x))))


def _loss_grads(model, x):
    def loss(m, x):
        return jnp.sum(m(x) ** 2)

    return nnx.grad(loss, argnums=(0, 1))(model, x)


@pytest.mark.parametrize("how", ["clone", "deepcopy"])
def test_copy_is_independent(rng, how):
    x = jnp.asarray(inputs.make(rng, (4, IN), "float32"))
    model = _Tied(rng)
    before = qnn.state_dict(model)
    y0 = np.asarray(model(x))
    g0 = _loss_grads(model, x)
    dup = nnx.clone(model) if how == "clone" else copy.deepcopy(model)

    assert dup.b.weight is dup.a.weight and dup.b.quant_state is dup.a.quant_state
    assert dup.a.weight is not model.a.weight and dup.c.SCB is not model.c.SCB
    np.testing.assert_array_equal(np.asarray(dup(x)), y0)
    g1 = _loss_grads(dup, x)
    for a, b in zip(jax.tree.leaves(g0), jax.tree.leaves(g1), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))

    # re-quantizing / mutating the copy leaves the original untouched
    dup.a.set_weight(jnp.asarray(inputs.make(rng, (IN, IN), "float32")))
    dup.c.set_weight(inputs.make(rng, (OUT, IN), "float32"))
    dup.a.bias.set_value(dup.a.bias.get_value() + 1)
    _assert_same_entries(qnn.state_dict(model), before)
    np.testing.assert_array_equal(np.asarray(model(x)), y0)
    assert np.asarray(dup.b.weight.get_value()).tobytes() == np.asarray(dup.a.weight.get_value()).tobytes()

    # the copy holds no reference to the original
    ref = weakref.ref(model)
    del model, g0
    gc.collect()
    assert ref() is None
    dup(x)


# ------------------------------------------------------------------ training


class _LoRA(nnx.Module):
    def __init__(self, rng, rank=4):
        self.base = qnn.Linear4bit.from_linear(_linear(rng)[0])
        self.lora_a = nnx.Param(jnp.asarray(inputs.make(rng, (IN, rank), "float32") * 0.1))
        self.lora_b = nnx.Param(jnp.asarray(inputs.make(rng, (rank, OUT), "float32") * 0.1))

    def __call__(self, x):
        return self.base(x) + (x @ self.lora_a) @ self.lora_b


def test_nnx_grad_under_jit_reaches_params_only(rng):
    model = _LoRA(rng)
    x = jnp.asarray(inputs.make(rng, (6, IN), "float32"))

    @nnx.jit
    def step(m, x):
        return nnx.grad(lambda m: jnp.mean(m(x) ** 2))(m)

    grads = step(model, x)
    assert not jax.tree.leaves(nnx.state(grads, qnn.QuantStateVar))
    kinds = {type(v) for _, v in nnx.to_flat_state(grads)}
    assert kinds == {nnx.Param}

    # the same loss with the dequantized weight in a dense fp32 matmul
    w = q4jax.dequantize_4bit(model.base.weight.get_value(), model.base.quant_state.get_value())
    params = nnx.state(model, nnx.Param)

    def dense(p):
        y = x @ w.T + p["base"]["bias"][...] + (x @ p["lora_a"][...]) @ p["lora_b"][...]
        return jnp.mean(y**2)

    want = jax.grad(dense)(params)
    for name in ("lora_a", "lora_b"):
        assert rel_err(grads[name][...], want[name][...]) < 1e-5
    assert rel_err(grads["base"]["bias"][...], want["base"]["bias"][...]) < 1e-5

    quant, rest = nnx.split(model, qnn.QuantStateVar, ...)[1:]
    assert {type(v) for _, v in nnx.to_flat_state(quant)} == {qnn.QuantStateVar}
    assert {type(v) for _, v in nnx.to_flat_state(rest)} == {nnx.Param}


# ------------------------------------------------------------------ quantize_model


def test_quantize_model_replaces_in_place_and_logs(rng, caplog):
    class Net(nnx.Module):
        def __init__(self):
            shared = _linear(rng, IN, IN)[0]
            self.blocks = nnx.List([shared, _linear(rng, IN, IN)[0]])
            self.heads = nnx.Dict({"mid": _linear(rng, IN, IN)[0]})
            self.tied = shared
            self.lm_head = _linear(rng, IN, 8)[0]

    net = Net()
    with caplog.at_level(logging.INFO, logger="q4jax"):
        assert qnn.quantize_model(net, "int8") is net
    assert type(net.blocks[1]) is qnn.Linear8bit and type(net.heads["mid"]) is qnn.Linear8bit
    assert net.tied is net.blocks[0] and type(net.tied) is qnn.Linear8bit
    assert type(net.lm_head) is nnx.Linear
    text = caplog.text
    assert "blocks.1" in text and "heads.mid" in text and "lm_head" in text


# ------------------------------------------------------------------ errors


def test_bad_inputs_raise_clear_errors(rng):
    layer = qnn.Linear4bit(IN, OUT, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="in_features=128"):
        layer(jnp.ones((2, IN + 1)))
    with pytest.raises(TypeError, match="int32"):
        layer(jnp.ones((2, IN), jnp.int32))
    with pytest.raises(ValueError, match="48"):
        qnn.Linear4bit(IN, OUT, blocksize=48, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="'nf5'"):
        qnn.Linear4bit(IN, OUT, quant_type="nf5", rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="in_features"):
        qnn.Linear4bit(0, OUT, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="in_features=128"):
        qnn.Linear8bit(IN, OUT, rngs=nnx.Rngs(0))(jnp.ones((2, 3)))
    with pytest.raises(ValueError, match="threshold"):
        qnn.Linear8bit(IN, OUT, threshold=-1.0, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="'int4'"):
        qnn.quantize_model(_Stack(0), "int4")

    good = qnn.state_dict(layer)
    before = qnn.state_dict(layer)

    def bad(mutate, match):
        d = dict(good)
        mutate(d)
        with pytest.raises(ValueError, match=match):
            qnn.load_state_dict(layer, d)
        _assert_same_entries(qnn.state_dict(layer), before)  # nothing changed

    bad(lambda d: d.pop("weight.absmax"), "absmax")
    bad(lambda d: d.pop("bias"), "'bias'")
    bad(lambda d: d.pop("weight.quant_state.bitsandbytes__nf4"), "weight")
    bad(lambda d: d.update({"weight": good["weight"][:-1]}), "'weight' holds")
    bad(lambda d: d.update({"bias": np.zeros(OUT + 1, np.float32)}), "'bias'")
    bad(lambda d: d.update({"extra.weight": np.zeros(3)}), "extra.weight")
    bad(lambda d: d.update({"weight.absmax": good["weight.absmax"][:-1]}), "absmax")
    bad(lambda d: d.update({"weight.quant_state.bitsandbytes__nf4": np.frombuffer(b"{oops", np.uint8)}), "JSON")

    other = qnn.state_dict(qnn.Linear4bit(IN, IN, rngs=nnx.Rngs(0)))
    with pytest.raises(ValueError, match=r"quant_state shape \(128, 128\)"):
        qnn.load_state_dict(layer, other)

    l8 = qnn.Linear8bit(IN, OUT, rngs=nnx.Rngs(0))
    ck8 = qnn.state_dict(l8)
    with pytest.raises(ValueError, match="'SCB'"):
        qnn.load_state_dict(l8, {k: v for k, v in ck8.items() if k != "SCB"})
    with pytest.raises(ValueError, match="weight_format"):
        qnn.load_state_dict(l8, {**ck8, "weight_format": np.array(1, np.uint8)})
