"""The Llama decoder in flax.nnx, written once: the same module names as transformers'
LlamaForCausalLM (``model.layers.0.self_attn.q_proj`` ...), so a transformers folder
-- float, or quantized by q4torch / ``q4 quantize`` -- loads by name, and
``q4jax.quantize_model`` / ``q4jax.load_quantized`` give the bytes q4torch holds.

Decoding keeps a fixed-size KV cache [layers][batch, max_len, kv_heads, head_dim]
passed in and out (``init_cache``), so one jitted step serves every position;
``generate`` is greedy, as transformers' ``generate(do_sample=False)``.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import q4
import q4jax


def rope_frequencies(cfg: dict) -> np.ndarray:
    """Inverse frequencies [head_dim / 2], llama3-scaled when the config says so
    (transformers' _compute_llama3_parameters)."""
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    theta = rope.get("rope_theta", cfg.get("rope_theta", 10000.0))
    inv = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.int64).astype(np.float32) / head_dim)
    if rope.get("rope_type") != "llama3":
        return inv.astype(np.float32)
    factor, lo, hi = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
    old = rope["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv
    scaled = np.where(wavelen > old / lo, inv / factor, inv)
    smooth = (old / wavelen - lo) / (hi - lo)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < old / hi) & ~(wavelen > old / lo)
    return np.where(medium, smoothed, scaled).astype(np.float32)


def _rotate(x, cos, sin):
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return (x * cos + rotated * sin).astype(x.dtype)


class RMSNorm(nnx.Module):
    def __init__(self, dim: int, eps: float, dtype):
        self.weight = nnx.Param(jnp.ones((dim,), dtype))
        self.eps = eps

    def __call__(self, x):
        h = x.astype(jnp.float32)
        h = h * jax.lax.rsqrt(jnp.mean(h * h, axis=-1, keepdims=True) + self.eps)
        return self.weight[...] * h.astype(x.dtype)


def _linear(n_in, n_out, dtype, rngs):
    return nnx.Linear(n_in, n_out, use_bias=False, dtype=dtype, param_dtype=dtype, rngs=rngs)


class Attention(nnx.Module):
    def __init__(self, cfg: dict, dtype, rngs):
        d, self.heads, self.kv_heads = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
        self.head_dim = cfg.get("head_dim") or d // self.heads
        self.q_proj = _linear(d, self.heads * self.head_dim, dtype, rngs)
        self.k_proj = _linear(d, self.kv_heads * self.head_dim, dtype, rngs)
        self.v_proj = _linear(d, self.kv_heads * self.head_dim, dtype, rngs)
        self.o_proj = _linear(self.heads * self.head_dim, d, dtype, rngs)

    def __call__(self, x, cos, sin, cache, pos):
        b, t, _ = x.shape
        q = _rotate(self.q_proj(x).reshape(b, t, self.heads, self.head_dim), cos, sin)
        k = _rotate(self.k_proj(x).reshape(b, t, self.kv_heads, self.head_dim), cos, sin)
        v = self.v_proj(x).reshape(b, t, self.kv_heads, self.head_dim)
        ck = jax.lax.dynamic_update_slice(cache[0], k.astype(cache[0].dtype), (0, pos, 0, 0))
        cv = jax.lax.dynamic_update_slice(cache[1], v.astype(cache[1].dtype), (0, pos, 0, 0))
        group = self.heads // self.kv_heads
        qg = q.reshape(b, t, self.kv_heads, group, self.head_dim)
        scores = jnp.einsum("btkgd,bskd->bkgts", qg, ck.astype(q.dtype)).astype(jnp.float32)
        scores = scores / math.sqrt(self.head_dim)
        allowed = jnp.arange(ck.shape[1])[None, :] <= pos + jnp.arange(t)[:, None]  # [t, s]: causal over the cache
        scores = jnp.where(allowed, scores, -jnp.inf)
        probs = jax.nn.softmax(scores, axis=-1).astype(q.dtype)
        out = jnp.einsum("bkgts,bskd->btkgd", probs, cv.astype(q.dtype)).reshape(b, t, self.heads * self.head_dim)
        return self.o_proj(out), (ck, cv)


class MLP(nnx.Module):
    def __init__(self, cfg: dict, dtype, rngs):
        d, f = cfg["hidden_size"], cfg["intermediate_size"]
        self.gate_proj = _linear(d, f, dtype, rngs)
        self.up_proj = _linear(d, f, dtype, rngs)
        self.down_proj = _linear(f, d, dtype, rngs)

    def __call__(self, x):
        return self.down_proj(jax.nn.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nnx.Module):
    def __init__(self, cfg: dict, dtype, rngs):
        eps = cfg.get("rms_norm_eps", 1e-5)
        self.input_layernorm = RMSNorm(cfg["hidden_size"], eps, dtype)
        self.self_attn = Attention(cfg, dtype, rngs)
        self.post_attention_layernorm = RMSNorm(cfg["hidden_size"], eps, dtype)
        self.mlp = MLP(cfg, dtype, rngs)

    def __call__(self, x, cos, sin, cache, pos):
        h, cache = self.self_attn(self.input_layernorm(x), cos, sin, cache, pos)
        x = x + h
        return x + self.mlp(self.post_attention_layernorm(x)), cache


class LlamaModel(nnx.Module):
    def __init__(self, cfg: dict, dtype, rngs):
        self.embed_tokens = nnx.Embed(cfg["vocab_size"], cfg["hidden_size"], dtype=dtype, param_dtype=dtype, rngs=rngs)
        self.layers = nnx.List([DecoderLayer(cfg, dtype, rngs) for _ in range(cfg["num_hidden_layers"])])
        self.norm = RMSNorm(cfg["hidden_size"], cfg.get("rms_norm_eps", 1e-5), dtype)


class LlamaForCausalLM(nnx.Module):
    """logits, caches = model(ids [b, t], caches, pos): the tokens at positions pos .. pos+t-1."""

    def __init__(self, cfg: dict, dtype=jnp.float32, rngs: nnx.Rngs | None = None):
        rngs = nnx.Rngs(0) if rngs is None else rngs
        self.cfg = cfg
        self.dtype = jnp.dtype(dtype)
        self.model = LlamaModel(cfg, dtype, rngs)
        self.tied = bool(cfg.get("tie_word_embeddings", False))
        self.lm_head = None if self.tied else _linear(cfg["hidden_size"], cfg["vocab_size"], dtype, rngs)
        self.inv_freq = nnx.Variable(jnp.asarray(rope_frequencies(cfg)))

    def init_cache(self, batch: int, max_len: int):
        kv, hd = self.cfg["num_key_value_heads"], self.model.layers[0].self_attn.head_dim
        shape = (batch, max_len, kv, hd)
        return [(jnp.zeros(shape, self.dtype), jnp.zeros(shape, self.dtype)) for _ in self.model.layers]

    def __call__(self, ids, caches, pos):
        t = ids.shape[1]
        angles = (pos + jnp.arange(t, dtype=jnp.float32))[:, None] * self.inv_freq[...][None, :]
        emb = jnp.concatenate([angles, angles], axis=-1)
        cos, sin = (f(emb)[None, :, None, :].astype(self.dtype) for f in (jnp.cos, jnp.sin))
        x = self.model.embed_tokens(ids)
        new = []
        for layer, cache in zip(self.model.layers, caches, strict=True):
            x, cache = layer(x, cos, sin, cache, pos)
            new.append(cache)
        x = self.model.norm(x)
        logits = self.model.embed_tokens.attend(x) if self.tied else self.lm_head(x)
        return logits, new


def load(folder, dtype=jnp.float32) -> LlamaForCausalLM:
    """The decoder of a transformers folder: a float folder loads as float weights; a
    quantized one (q4torch save_pretrained, ``q4 quantize``) as q4jax layers holding its
    bytes (q4jax.load_quantized), the rest (embedding, norms) by name."""
    folder = Path(folder)
    cfg = json.loads((folder / "config.json").read_text())
    # built abstract (shapes only): the folder's tensors are the only weights ever held
    model = nnx.eval_shape(lambda: LlamaForCausalLM(cfg, dtype))
    model.inv_freq.set_value(jnp.asarray(rope_frequencies(cfg)))
    # memory-mapped views: each tensor is copied once, into its jax array
    tensors = q4.checkpoint.load_checkpoint(folder, mapped=True)
    quantized = q4.checkpoint.quantized_groups(tensors)
    rest = q4jax.load_quantized(model, tensors) if quantized else dict(tensors)
    for name, value in rest.items():
        *path, leaf = name.split(".")
        node = model
        for p in path:
            node = node[int(p)] if p.isdigit() else getattr(node, p)
        if isinstance(node, nnx.Linear):
            node.kernel.set_value(jnp.asarray(value.T, node.kernel.get_value().dtype))
        elif isinstance(node, nnx.Embed):
            node.embedding.set_value(jnp.asarray(value, node.embedding.get_value().dtype))
        elif isinstance(node, RMSNorm):
            node.weight.set_value(jnp.asarray(value, node.weight.get_value().dtype))
        elif name != "lm_head.weight" or not model.tied:
            raise ValueError(f"{folder}: tensor {name!r} maps to no parameter of the Flax decoder")
        jax.block_until_ready(nnx.state(node))  # the copy is made asynchronously
        q4.checkpoint.release_pages(value)  # copied: the file's pages back to the system
    unset = [jax.tree_util.keystr(p) for p, v in jax.tree.leaves_with_path(nnx.state(model))
             if isinstance(v, jax.ShapeDtypeStruct)]  # fmt: skip
    if unset:
        raise ValueError(f"{folder}: no tensor for {unset[:8]}")
    return model


def decode_step(model: LlamaForCausalLM):
    """A jitted (graphdef, state) -> step(ids, caches, pos) -> (logits of the last token,
    caches): the model's state split once, the caches donated."""
    graphdef, state = nnx.split(model)

    def run(state, ids, caches, pos):
        logits, caches = nnx.merge(graphdef, state)(ids, caches, pos)
        return logits[:, -1], caches

    jitted = jax.jit(run, donate_argnums=(2,))
    return lambda ids, caches, pos: jitted(state, ids, caches, pos)


def generate(model: LlamaForCausalLM, prompt: np.ndarray, new_tokens: int, max_len: int | None = None) -> np.ndarray:
    """Greedy decoding: prompt [b, t] -> [b, t + new_tokens] (the prompt in one step,
    then a token a step through the KV cache)."""
    prompt = jnp.asarray(prompt, jnp.int32)
    b, t = prompt.shape
    caches = model.init_cache(b, max_len or t + new_tokens)
    step = decode_step(model)
    logits, caches = step(prompt, caches, jnp.int32(0))
    out = [prompt]
    for i in range(new_tokens):
        nxt = jnp.argmax(logits, axis=-1).astype(jnp.int32)[:, None]
        out.append(nxt)
        if i + 1 < new_tokens:
            logits, caches = step(nxt, caches, jnp.int32(t + i))
    return np.asarray(jnp.concatenate(out, axis=1))
