"""q4jax's LLM.int8 weight quantization runs through the kernels' XLA op:
bytes identical to bitsandbytes (the format's oracle), under jit and vmap too,
so a Linear8bit can be built inside jit; a weight row that overflows float16
is refused with its index outside a trace."""

from __future__ import annotations

import bitsandbytes.functional as bnbf
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx
from q4_reference import inputs

import q4jax
from q4jax import quantize_int8_weight  # the public name (README: the producer of matmul_8bit's cb, scb)


def _bnb(w: np.ndarray):
    cb, scb, _ = bnbf.int8_vectorwise_quant(torch.from_numpy(w).to(torch.float16), 0.0)
    return cb.numpy(), scb.numpy()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_bytes_match_bitsandbytes(rng, dtype):
    w = inputs.make(rng, (37, 130), dtype, "special")
    w32 = inputs.to_f32(w)
    w32 = np.where(np.isfinite(w32), np.clip(w32, -6e4, 6e4), 0).astype(np.float32)  # finite after fp16
    xd = inputs.to_dtype(w32, dtype)
    want_cb, want_scb = _bnb(inputs.to_f32(xd))  # the same values, through float16 as bitsandbytes takes them
    x = jnp.asarray(xd)
    for fn in (quantize_int8_weight, jax.jit(quantize_int8_weight)):
        cb, scb = fn(x)
        assert cb.dtype == jnp.int8 and scb.dtype == jnp.float32
        assert np.array_equal(np.asarray(cb), want_cb) and np.asarray(scb).tobytes() == want_scb.tobytes()


def test_vmap_over_stacked_weights(rng):
    ws = np.stack([inputs.make(rng, (16, 64), "float32") * s for s in (1.0, 3.0, 0.01)])
    cb, scb = jax.vmap(quantize_int8_weight)(jnp.asarray(ws))
    for i, w in enumerate(ws):
        want_cb, want_scb = _bnb(w)
        assert np.array_equal(np.asarray(cb[i]), want_cb) and np.array_equal(np.asarray(scb[i]), want_scb)


@pytest.mark.parametrize("cls", ["Linear8bit", "Linear4bit"])
def test_layers_built_under_jit_equal_eager(cls):
    layer_cls = getattr(q4jax.nn, cls)

    @jax.jit
    def build(key):
        return nnx.state(layer_cls(64, 24, rngs=nnx.Rngs(params=key)))

    key = jax.random.key(3)
    traced = build(key)
    eager = nnx.state(layer_cls(64, 24, rngs=nnx.Rngs(params=key)))
    for a, b in zip(jax.tree.leaves(traced), jax.tree.leaves(eager), strict=True):
        assert np.asarray(a).tobytes() == np.asarray(b).tobytes()


def test_row_overflowing_float16_is_named():
    w = np.ones((5, 8), np.float32)
    w[3, 2] = 7e4  # inf in float16
    with pytest.raises(ValueError, match=r"rows \[3\]"):
        quantize_int8_weight(jnp.asarray(w))
    layer = q4jax.nn.Linear8bit(8, 5, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match=r"rows \[3\]"):
        layer.set_weight(w)
