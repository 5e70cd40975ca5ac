"""all-MiniLM-L6-v2 as flax.nnx modules laid out like the PyTorch model, so
the dotted module paths (``encoder.layer.0.attention.self.query``) are the
checkpoint's keys: q4jax.load_state_dict loads every Linear (dense, or
quantized by q4 / bitsandbytes) and ``load`` copies the embeddings and
LayerNorms by the same names."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import q4jax

from . import common
from .common import HEADS, HIDDEN, INTERMEDIATE, LAYER_NORM_EPS

# fp32 matmuls stay fp32 on accelerators too (no TF32 / bf16 passes)
_HIGHEST = jax.lax.Precision.HIGHEST


def _linear(n_in: int, n_out: int, rngs: nnx.Rngs) -> nnx.Linear:
    return nnx.Linear(n_in, n_out, precision=_HIGHEST, rngs=rngs)


def _layer_norm(rngs: nnx.Rngs) -> nnx.LayerNorm:
    # two-pass variance, as torch.nn.LayerNorm computes it
    return nnx.LayerNorm(HIDDEN, epsilon=LAYER_NORM_EPS, use_fast_variance=False, rngs=rngs)


def _dense_norm(n_in: int, rngs: nnx.Rngs) -> nnx.Dict:
    return nnx.Dict({"dense": _linear(n_in, HIDDEN, rngs), "LayerNorm": _layer_norm(rngs)})


class Embeddings(nnx.Module):
    """Word + token type 0 + absolute position embeddings, then LayerNorm."""

    def __init__(self, rngs: nnx.Rngs):
        self.word_embeddings = nnx.Embed(common.VOCAB, HIDDEN, rngs=rngs)
        self.position_embeddings = nnx.Embed(common.MAX_POSITIONS, HIDDEN, rngs=rngs)
        self.token_type_embeddings = nnx.Embed(common.TYPE_VOCAB, HIDDEN, rngs=rngs)
        self.LayerNorm = _layer_norm(rngs)

    def __call__(self, ids: jax.Array) -> jax.Array:
        x = self.word_embeddings(ids) + self.token_type_embeddings.embedding[0]
        x = x + self.position_embeddings.embedding[: ids.shape[1]]
        return self.LayerNorm(x)


class Layer(nnx.Module):
    """One post-LayerNorm BERT block: self-attention, then a GELU feed-forward."""

    def __init__(self, rngs: nnx.Rngs):
        self.attention = nnx.Dict(
            {
                "self": nnx.Dict({name: _linear(HIDDEN, HIDDEN, rngs) for name in ("query", "key", "value")}),
                "output": _dense_norm(HIDDEN, rngs),
            }
        )
        self.intermediate = nnx.Dict({"dense": _linear(HIDDEN, INTERMEDIATE, rngs)})
        self.output = _dense_norm(INTERMEDIATE, rngs)

    def __call__(self, x: jax.Array, mask_bias: jax.Array) -> jax.Array:
        b, t, _ = x.shape
        att = self.attention
        q, k, v = (att["self"][n](x).reshape(b, t, HEADS, -1) for n in ("query", "key", "value"))
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k, precision=_HIGHEST) / np.sqrt(HIDDEN // HEADS)
        probs = jax.nn.softmax(scores + mask_bias, axis=-1)
        ctx = jnp.einsum("bhqk,bkhd->bqhd", probs, v, precision=_HIGHEST).reshape(b, t, HIDDEN)
        x = att["output"]["LayerNorm"](att["output"]["dense"](ctx) + x)
        h = jax.nn.gelu(self.intermediate["dense"](x), approximate=False)
        return self.output["LayerNorm"](self.output["dense"](h) + x)


class MiniLM(nnx.Module):
    """The BERT encoder; ``model(ids, mask)`` returns the last hidden state."""

    def __init__(self, rngs: nnx.Rngs):
        self.embeddings = Embeddings(rngs)
        self.encoder = nnx.Dict({"layer": nnx.List([Layer(rngs) for _ in range(common.LAYERS)])})
        # unused by the sentence embedding; kept so that every checkpoint key has a home
        self.pooler = nnx.Dict({"dense": _linear(HIDDEN, HIDDEN, rngs)})

    def __call__(self, ids: jax.Array, mask: jax.Array) -> jax.Array:
        # additive mask: padded keys get the most negative float, so exp() underflows to 0
        mask_bias = (1.0 - mask[:, None, None, :].astype(jnp.float32)) * jnp.finfo(jnp.float32).min
        x = self.embeddings(ids)
        for layer in self.encoder["layer"]:
            x = layer(x, mask_bias)
        return x


def _modules(model: nnx.Module) -> list[tuple[str, nnx.Module]]:
    """(dotted path, module) for every module below ``model``, torch-style."""
    return [(".".join(map(str, path)), node) for path, node in nnx.iter_graph(model) if isinstance(node, nnx.Module)]


def load(tensors: dict[str, np.ndarray]) -> MiniLM:
    """A MiniLM holding ``tensors`` (the PyTorch checkpoint keys): the fp32
    checkpoint, or one whose linear layers q4 / bitsandbytes quantized (each
    such layer is first replaced by q4jax's Linear4bit / Linear8bit)."""
    model = MiniLM(nnx.Rngs(0))
    # every Linear, dense or quantized (replaced first with the file's format); the rest is ours to map
    rest = q4jax.load_quantized(model, tensors)
    rest.pop("embeddings.position_ids", None)  # positions are 0..T-1

    def take(key: str, like: nnx.Param) -> jax.Array:
        if key not in rest:
            raise ValueError(f"missing key '{key}'")
        value = np.asarray(rest.pop(key), np.float32)
        if value.shape != like.shape:
            raise ValueError(f"'{key}' has shape {value.shape}, the model expects {like.shape}")
        return jnp.asarray(value)

    for name, m in _modules(model):
        if isinstance(m, nnx.LayerNorm):
            m.scale.set_value(take(f"{name}.weight", m.scale))
            m.bias.set_value(take(f"{name}.bias", m.bias))
        elif isinstance(m, nnx.Embed):
            m.embedding.set_value(take(f"{name}.weight", m.embedding))
    if rest:
        raise ValueError(f"unexpected keys {sorted(rest)}")
    return model


@functools.partial(jax.jit, static_argnums=0)
def _forward(graphdef, state, ids, mask):
    return nnx.merge(graphdef, state)(ids, mask)


def embed(model: MiniLM, sentences, batch_size: int = 32) -> np.ndarray:
    """Unit-norm sentence embeddings float32 [n, 384] (the forward is jitted;
    batches are padded to power-of-two shapes, so few shapes compile)."""
    graphdef, state = nnx.split(model)
    return common.embed_with(
        lambda ids, mask: _forward(graphdef, state, ids.astype(np.int32), mask.astype(np.int32)),
        sentences,
        batch_size,
    )
