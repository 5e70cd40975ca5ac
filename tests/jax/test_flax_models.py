"""q4jax.quantize_model on Flax models as they are written: nnx.Einsum and
nnx.LinearGeneral (so nnx.MultiHeadAttention), subclasses of nnx.Linear / nnx.Embed,
scanned layer stacks (nnx.vmap + nnx.scan), every call keyword (out_sharding), and
the report of what was left float.

Oracles: the stored 2-D matrix of each projection is written here by hand for each
einsum (which kernel axes are kept, which contracted, in kernel order) and its bytes
compared with tests/q4_reference/oracle.py's quantizer; outputs are compared with
Flax's own float layer holding the oracle-dequantized kernel (the kernel rebuilt from
the dequantized matrix through the same hand-written index map), within the fp32
accumulation bound of both sides: |y - y_ref| <= 2 (K + 2) 2^-24 sum|terms|.
"""

from __future__ import annotations

import logging

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P
from q4_reference import oracle

import q4jax
from q4._src.weights import quantize_weight_4bit
from q4jax.nn import Linear4bit, Linear8bit, QuantizedEinsum, QuantizedLinearGeneral

BS = 64
U = 2.0**-24


# (id, layer factory, input shape, W(kernel) -> [S, out, in] by hand)
def _einsum(eq, kshape, bshape=None):
    return lambda rngs: nnx.Einsum(eq, kshape, bshape, bias_init=nnx.initializers.normal(1.0), rngs=rngs)


def _general(*args, **kwargs):
    return lambda rngs: nnx.LinearGeneral(*args, bias_init=nnx.initializers.normal(1.0), rngs=rngs, **kwargs)


CASES = [
    ("q-BTD,NDH", _einsum("BTD,NDH->BTNH", (4, 64, 16)), (2, 5, 64), lambda k: k.transpose(0, 2, 1).reshape(1, 64, 64)),
    (
        "kv-BSD,CKDH",
        _einsum("BSD,CKDH->CBSKH", (2, 2, 64, 16)),
        (2, 5, 64),
        lambda k: k.transpose(0, 1, 3, 2).reshape(1, 64, 64),
    ),
    (
        "o-BTNH,NHD",
        _einsum("BTNH,NHD->BTD", (4, 16, 64), (64,)),
        (2, 5, 4, 16),
        lambda k: k.transpose(2, 0, 1).reshape(1, 64, 64),
    ),
    ("ellipsis", _einsum("...d,df->...f", (128, 48), (48,)), (3, 2, 128), lambda k: k.T.reshape(1, 48, 128)),
    (
        "permuted-out",
        _einsum("btd,dnh->bnth", (64, 3, 8), (3, 8)),
        (2, 5, 64),
        lambda k: k.transpose(1, 2, 0).reshape(1, 24, 64),
    ),
    ("shared-n", _einsum("bnd,ndh->bnh", (3, 64, 8), (3, 8)), (2, 3, 64), lambda k: k.transpose(0, 2, 1)),
    ("general-out-heads", _general(64, (4, 16)), (2, 5, 64), lambda k: k.reshape(64, 64).T[None]),
    ("general-in-heads", _general((4, 16), 64, axis=(-2, -1)), (2, 5, 4, 16), lambda k: k.reshape(64, 64).T[None]),
    ("general-batch-axis", _general(64, 32, batch_axis={0: 3}), (3, 2, 64), lambda k: k.transpose(0, 2, 1)),
    ("general-middle-axis", _general(64, 32, axis=1), (2, 64, 5), lambda k: k.T[None]),
]
IDS = [c[0] for c in CASES]


def _case(case_id):
    _, make, xshape, wfn = CASES[IDS.index(case_id)]
    layer = make(nnx.Rngs(0))
    x = jnp.asarray(np.random.default_rng(1).standard_normal(xshape).astype(np.float32))
    return layer, x, wfn


def _kernel_from_matrices(kernel_shape, wfn, w_hat):
    """The kernel whose hand-written matrix (wfn) is w_hat: wfn applied to the kernel's
    flat indices says where each entry of the matrix comes from."""
    idx = wfn(np.arange(int(np.prod(kernel_shape))).reshape(kernel_shape))
    k = np.empty(int(np.prod(kernel_shape)), np.float32)
    k[idx.reshape(-1)] = np.asarray(w_hat, np.float32).reshape(-1)
    return k.reshape(kernel_shape)


def _dequantized_matrices(base: Linear4bit) -> np.ndarray:
    """[S, out, in] from the stored bytes through the numpy oracle (flat absmax)."""
    packed = np.asarray(base.weight.get_value())
    absmax = np.asarray(base.quant_state.get_value().absmax)
    packed = packed.reshape(-1, packed.shape[-2]) if packed.ndim == 3 else packed.reshape(1, -1)
    absmax = absmax.reshape(packed.shape[0], -1)
    n, k = base.out_features, base.in_features
    return np.stack(
        [
            oracle.dequantize_4bit(p, a, n * k, BS, base.quant_type).reshape(n, k)
            for p, a in zip(packed, absmax, strict=True)
        ]
    )


def _float_with_kernel(make, kernel, bias):
    layer = make(nnx.Rngs(0))
    layer.kernel.set_value(jnp.asarray(kernel))
    if bias is not None:
        layer.bias.set_value(jnp.asarray(bias))
    return layer


def _check_close(y, y_ref, terms, k):
    y, y_ref, terms = (np.asarray(a, np.float64) for a in (y, y_ref, terms))
    bound = 2 * (k + 2) * U * terms + 1e-30
    assert y.shape == y_ref.shape
    assert np.all(np.abs(y - y_ref) <= bound), float(np.max(np.abs(y - y_ref) - bound))


class _Holder(nnx.Module):
    def __init__(self, layer):
        self.layer = layer

    def __call__(self, x, **kw):
        return self.layer(x, **kw)


@pytest.mark.parametrize("case_id", IDS)
def test_projection_bytes_and_output_against_the_oracle(case_id):
    layer, x, wfn = _case(case_id)
    make = CASES[IDS.index(case_id)][1]
    kernel = np.asarray(layer.kernel.get_value())
    bias = None if layer.bias is None else np.asarray(layer.bias.get_value())
    m, report = q4jax.quantize_model(_Holder(layer), "nf4", compress_statistics=False, return_report=True)
    q = m.layer
    assert isinstance(q, (QuantizedEinsum, QuantizedLinearGeneral)) and report.left_float == []
    # bytes: each stored matrix is the oracle's quantization of the hand-written one
    w = wfn(kernel)
    packed = np.asarray(q.quantized.weight.get_value()).reshape(w.shape[0], -1)
    for s in range(w.shape[0]):
        want, _ = oracle.quantize_4bit(w[s], BS, "nf4")
        assert packed[s].tobytes() == want.tobytes(), s
    # output: Flax's float layer with the dequantized kernel
    k_hat = _kernel_from_matrices(kernel.shape, wfn, _dequantized_matrices(q.quantized))
    y = q(x)
    y_ref = _float_with_kernel(make, k_hat, bias)(x)
    terms = _float_with_kernel(make, np.abs(k_hat), None if bias is None else np.abs(bias))(jnp.abs(x))
    _check_close(y, y_ref, terms, w.shape[-1])
    # under jit, the same bits
    assert np.array_equal(np.asarray(nnx.jit(lambda m, x: m(x))(m, x)), np.asarray(y))


@pytest.mark.parametrize("case_id", ["q-BTD,NDH", "general-in-heads"])
def test_int8_projection_is_the_int8_linear_on_its_rows(case_id):
    """int8: CB / SCB of the hand-written matrix; the output equals the 2-D int8
    linear on the rows of x (the contracted axes flattened), reshaped back."""
    layer, x, wfn = _case(case_id)
    kernel = np.asarray(layer.kernel.get_value())
    bias = None if layer.bias is None else np.asarray(layer.bias.get_value())
    q = q4jax.quantize_model(_Holder(layer), "int8").layer
    cb_want, scb_want = q4jax.quantize_int8_weight(jnp.asarray(wfn(kernel)[0]))
    base = q.quantized
    assert isinstance(base, Linear8bit)
    assert np.array_equal(np.asarray(base.weight.get_value()), np.asarray(cb_want))
    assert np.array_equal(np.asarray(base.SCB.get_value()), np.asarray(scb_want))
    rows = np.asarray(x).reshape(10, 64)  # both cases: batch (2, 5), contracted 64 in kernel order
    y2 = q4jax.matmul_8bit(jnp.asarray(rows), cb_want, scb_want, None, 0.0)
    if case_id == "q-BTD,NDH":
        want = np.asarray(y2).reshape(2, 5, 4, 16)
    else:
        want = np.asarray(y2).reshape(2, 5, 64) + bias
    np.testing.assert_array_equal(np.asarray(q(x)), want.astype(np.float32))


def test_quantized_projection_keeps_the_float_layers_attributes():
    e = nnx.Einsum("BTD,NDH->BTNH", (4, 64, 16), rngs=nnx.Rngs(0))
    g = nnx.LinearGeneral((4, 16), 64, axis=(-2, -1), rngs=nnx.Rngs(0))
    m = q4jax.quantize_model(nnx.Dict(e=e, g=g), "nf4")
    assert (m["e"].einsum_str, m["e"].kernel_shape, m["e"].bias_shape, m["e"].use_bias) == (
        e.einsum_str,
        tuple(e.kernel_shape),
        e.bias_shape,
        False,
    )
    assert (m["g"].in_features, m["g"].out_features, m["g"].axis, m["g"].use_bias) == (
        g.in_features,
        g.out_features,
        g.axis,
        True,
    )
    # a call-time einsum_str that splits the kernel the same way is honoured, another is refused
    x = jnp.ones((2, 5, 64))
    np.testing.assert_array_equal(
        np.asarray(m["e"](x, einsum_str="XYD,NDH->XYNH")), np.asarray(m["e"](x)).astype(np.float32)
    )
    with pytest.raises(ValueError, match="splits the kernel differently"):
        m["e"](jnp.ones((2, 4, 16)), einsum_str="BND,NDH->BNH")


# ------------------------------------------------------------------ a Gemma-style decoder


class Embedder(nnx.Embed):
    """Gemma's pattern (flax/examples/gemma ScaledEmbed): __call__ overridden through
    super() to scale the lookup, and the tied output head, as methods of a subclass."""

    def __call__(self, ids, out_sharding=None):
        return super().__call__(ids, out_sharding) * jnp.sqrt(jnp.float32(self.features))

    def encode(self, ids):
        return self(ids)

    def decode(self, h, out_sharding=None):
        return self.attend(h, out_sharding=out_sharding)


class GatedLinear(nnx.Linear):
    """A subclass that keeps nnx.Linear's call and adds a method and an attribute."""

    def __init__(self, *args, gain: float, **kwargs):
        super().__init__(*args, **kwargs)
        self.gain = gain

    def gated(self, x):
        return self(x) * self.gain


class Attention(nnx.Module):
    def __init__(self, d, heads, head_dim, rngs):
        self.q_einsum = nnx.Einsum("BTD,NDH->BTNH", (heads, d, head_dim), rngs=rngs)
        self.kv_einsum = nnx.Einsum("BSD,CKDH->CBSKH", (2, heads // 2, d, head_dim), rngs=rngs)
        self.attn_vec_einsum = nnx.Einsum("BTNH,NHD->BTD", (heads, head_dim, d), rngs=rngs)

    @property
    def head_dim(self):  # as flax/examples/gemma reads it
        return self.attn_vec_einsum.kernel.shape[1]

    def __call__(self, x):
        q = self.q_einsum(x, out_sharding=None)
        k, v = self.kv_einsum(x, out_sharding=None)
        k, v = (jnp.repeat(a, 2, axis=2) for a in (k, v))
        logits = jnp.einsum("BTNH,BSNH->BNTS", q, k) / jnp.sqrt(self.head_dim)
        t = x.shape[1]
        logits = jnp.where(jnp.tril(jnp.ones((t, t), bool)), logits, -1e9)
        probs = jax.nn.softmax(logits, axis=-1)
        return self.attn_vec_einsum(jnp.einsum("BNTS,BSNH->BTNH", probs, v), out_sharding=None)


class Block(nnx.Module):
    def __init__(self, d, rngs):
        self.norm = nnx.RMSNorm(d, rngs=rngs)
        self.attn = Attention(d, 4, 16, rngs)
        self.gate_proj = GatedLinear(d, 128, use_bias=False, gain=0.5, rngs=rngs)
        self.up_proj = nnx.Linear(d, 128, use_bias=False, rngs=rngs)
        self.down_proj = nnx.Linear(128, d, use_bias=False, rngs=rngs)

    def __call__(self, x):
        x = x + self.attn(self.norm(x))
        h = self.norm(x)
        ff = jax.nn.gelu(self.gate_proj.gated(h)) * self.up_proj(h, out_sharding=None)
        return x + self.down_proj(ff, out_sharding=None)


class Gemma(nnx.Module):
    def __init__(self, rngs, vocab=96, d=64, layers=2):
        self.embedder = Embedder(vocab, d, rngs=rngs)
        self.blocks = nnx.List([Block(d, rngs) for _ in range(layers)])
        self.final_norm = nnx.RMSNorm(d, rngs=rngs)

    def __call__(self, ids):
        x = self.embedder.encode(ids)
        for b in self.blocks:
            x = b(x)
        return self.embedder.decode(self.final_norm(x), out_sharding=None)


def _greedy(model, ids, steps):
    step = nnx.jit(lambda m, ids: jnp.argmax(m(ids)[:, -1], axis=-1))
    for _ in range(steps):
        ids = jnp.concatenate([ids, step(model, ids)[:, None]], axis=1)
    return np.asarray(ids)


def _dequantized_float_model(float_model, quantized):
    """The float model with every quantized weight replaced by its dequantized value
    (numpy oracle on the stored bytes; the kernel rebuilt through projection.matrix_of's
    index map, whose bytes test_projection_bytes_and_output_against_the_oracle checks)."""
    from q4jax._src.model import _split_of
    from q4jax._src.projection import matrix_of

    f_edges = {p: c for p, _, _, c in q4jax._src.graph.graph_edges(float_model)}
    for path, _, _, q in q4jax._src.graph.graph_edges(quantized):
        f = f_edges.get(path)
        if f is None:
            continue  # a projection's 2-D base: rebuilt with the projection
        if isinstance(q, (QuantizedEinsum, QuantizedLinearGeneral)):
            kind = "einsum" if isinstance(q, QuantizedEinsum) else "general"
            shape = tuple(f.kernel.get_value().shape)
            k = _kernel_from_matrices(
                shape, lambda a, f=f, kind=kind: matrix_of(a, _split_of(f, kind)), _dequantized_matrices(q.quantized)
            )
            f.kernel.set_value(jnp.asarray(k))
        elif isinstance(q, Linear4bit):
            f.kernel.set_value(jnp.asarray(_dequantized_matrices(q)[0].T))
        elif isinstance(q, q4jax.nn.Embedding4bit):
            n, d = q.num_embeddings, q.features
            t = oracle.dequantize_4bit(
                np.asarray(q.weight.get_value()), np.asarray(q.quant_state.get_value().absmax), n * d, BS, q.quant_type
            )
            f.embedding.set_value(jnp.asarray(t.reshape(n, d)))
    return float_model


def test_gemma_style_decoder_quantizes_completely_and_runs():
    model = Gemma(nnx.Rngs(0))
    ids = jnp.asarray(np.random.default_rng(0).integers(0, 96, (2, 6)))
    q, report = q4jax.quantize_model(
        nnx.clone(model), "nf4", compress_statistics=False, embeddings=True, return_report=True
    )
    assert report.left_float == [], str(report)
    assert len(report.quantized) == 1 + 2 * 6  # the embedder (tied head), 3 einsums + 3 linears a block
    assert type(q.embedder).__name__ == "Embedder4bit" and isinstance(q.embedder, q4jax.nn.Embedding4bit)
    assert isinstance(q.blocks[0].gate_proj, Linear4bit) and q.blocks[0].gate_proj.gain == 0.5
    # shape queries answer as on the float layers; a float value is refused with the way to get one
    assert q.blocks[0].attn.head_dim == 16 and q.embedder.embedding.shape == (96, 64)
    assert q.blocks[0].up_proj.kernel.shape == (64, 128)
    with pytest.raises(AttributeError, match=r"kernel is quantized: it has a shape \(4, 16, 64\)"):
        _ = q.blocks[0].attn.attn_vec_einsum.kernel.value
    # eager, jit and the sampling loop run; logits equal the float model on the dequantized weights
    logits = q(ids)
    # (XLA fuses the model's own float code differently under jit: fp32 rounding only)
    np.testing.assert_allclose(np.asarray(nnx.jit(lambda m, i: m(i))(q, ids)), np.asarray(logits), rtol=1e-5, atol=1e-5)
    ref = _dequantized_float_model(nnx.clone(model), q)(ids)
    np.testing.assert_allclose(np.asarray(logits), np.asarray(ref), rtol=2e-4, atol=2e-4 * float(jnp.abs(ref).max()))
    assert _greedy(q, ids, 3).shape == (2, 9)
    # int8 runs too, with nothing left float
    q8, r8 = q4jax.quantize_model(nnx.clone(model), "int8", embeddings=True, return_report=True)
    assert r8.left_float == [] and q8(ids).shape == logits.shape


def test_gemma_style_lora_step_trains_only_the_adapters():
    model = q4jax.quantize_model(Gemma(nnx.Rngs(0)), "nf4", embeddings=True)
    frozen = lambda m: [np.asarray(a) for a in jax.tree.leaves(nnx.state(m, q4jax.nn.QuantStateVar))]  # noqa: E731
    before = frozen(model)
    q4jax.add_lora(model, 4, targets=("q_einsum", "attn_vec_einsum", "up_proj"), rngs=nnx.Rngs(1))
    assert isinstance(model.blocks[0].attn.q_einsum.base, nnx.LoRA)
    ids = jnp.asarray(np.random.default_rng(0).integers(0, 96, (2, 6)))
    opt = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.LoRAParam)

    @nnx.jit
    def step(m, opt, ids):
        def loss(m):
            return optax.softmax_cross_entropy_with_integer_labels(m(ids)[:, :-1], ids[:, 1:]).mean()

        value, grads = nnx.value_and_grad(loss, argnums=nnx.DiffState(0, nnx.LoRAParam))(m)
        opt.update(m, grads)
        return value

    losses = [float(step(model, opt, ids)) for _ in range(4)]
    assert losses[-1] < losses[0]
    after = frozen(model)
    assert len(after) == len(before) and all(np.array_equal(a, b) for a, b in zip(after, before, strict=True))


def test_multi_head_attention_is_quantized_through_its_linear_generals():
    mha = nnx.MultiHeadAttention(4, 64, qkv_features=64, decode=False, rngs=nnx.Rngs(0))
    x = jnp.asarray(np.random.default_rng(2).standard_normal((2, 5, 64)).astype(np.float32))
    q, report = q4jax.quantize_model(_Holder(nnx.clone(mha)), "nf4", compress_statistics=False, return_report=True)
    assert {r.path for r in report.quantized} == {f"layer.{n}" for n in ("query", "key", "value", "out")}
    assert report.left_float == []
    ref = _dequantized_float_model(_Holder(nnx.clone(mha)), q)(x)
    got = q(x)
    np.testing.assert_allclose(np.asarray(got), np.asarray(ref), rtol=1e-4, atol=1e-4 * float(jnp.abs(ref).max()))
    got_jit = nnx.jit(lambda m, x: nnx.remat(lambda m, x: m(x))(m, x))(q, x)
    np.testing.assert_allclose(np.asarray(got_jit), np.asarray(got), rtol=1e-6, atol=1e-6)


# ------------------------------------------------------------------ scanned stacks

LAYERS = 3


class ScanBlock(nnx.Module):
    def __init__(self, rngs):
        self.q = nnx.Einsum("BTD,NDH->BTNH", (4, 64, 16), rngs=rngs)
        self.o = nnx.Einsum("BTNH,NHD->BTD", (4, 16, 64), (64,), rngs=rngs)
        self.up = nnx.Linear(64, 128, rngs=rngs)
        self.down = nnx.Linear(128, 64, rngs=rngs)

    def __call__(self, x):
        x = x + self.o(self.q(x))
        return x + self.down(jax.nn.gelu(self.up(x)))


class Scanned(nnx.Module):
    def __init__(self, rngs):
        @nnx.split_rngs(splits=LAYERS)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def make(r):
            return ScanBlock(r)

        self.layers = make(rngs)

    def __call__(self, x):
        @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
        @nnx.remat
        def body(h, layer):
            return layer(h)

        return body(x, self.layers)


def test_scanned_stack_is_quantized_slice_by_slice_and_runs_under_scan_and_remat():
    model = Scanned(nnx.Rngs(0))
    kernels = {n: np.asarray(getattr(model.layers, n).kernel.get_value()) for n in ("q", "up")}
    x = jnp.asarray(np.random.default_rng(3).standard_normal((2, 5, 64)).astype(np.float32))
    q, report = q4jax.quantize_model(model, "nf4", compress_statistics=False, return_report=True)
    assert len(report.quantized) == 4 and all("stacked [3]" in r.detail for r in report.quantized)
    # each slice's bytes are the oracle's for that layer alone
    for i in range(LAYERS):
        want, _ = oracle.quantize_4bit(kernels["up"][i].T, BS, "nf4")
        assert np.asarray(q.layers.up.weight.get_value()[i]).tobytes() == want.tobytes()
        want, _ = oracle.quantize_4bit(kernels["q"][i].transpose(0, 2, 1).reshape(64, 64), BS, "nf4")
        assert np.asarray(q.layers.q.quantized.weight.get_value()[i]).tobytes() == want.tobytes()
    # the scan equals the layers applied one at a time (each slice merged as a layer of its own)
    graphdef, state = nnx.split(q.layers)
    h = x
    for i in range(LAYERS):
        h = nnx.merge(graphdef, jax.tree.map(lambda a, i=i: a[i], state))(h)
    y = q(x)
    np.testing.assert_allclose(np.asarray(y), np.asarray(h), rtol=1e-5, atol=1e-5)
    # a LoRA step through scan + remat: gradients reach the stacked adapters only
    q4jax.add_lora(q, 4, rngs=nnx.Rngs(1))
    assert q.layers.up.lora_a.get_value().shape == (LAYERS, 64, 4)
    opt = nnx.Optimizer(q, optax.adam(1e-2), wrt=nnx.LoRAParam)
    packed = np.asarray(q.layers.up.base_module.weight.get_value())

    @nnx.jit
    def step(m, opt, x):
        value, grads = nnx.value_and_grad(lambda m: (m(x) ** 2).mean(), argnums=nnx.DiffState(0, nnx.LoRAParam))(m)
        opt.update(m, grads)
        return value

    losses = [float(step(q, opt, x)) for _ in range(3)]
    assert losses[-1] < losses[0]
    assert np.array_equal(np.asarray(q.layers.up.base_module.weight.get_value()), packed)


def test_stacked_layers_have_no_per_layer_checkpoint_entries():
    q = q4jax.quantize_model(Scanned(nnx.Rngs(0)), "nf4")
    with pytest.raises(ValueError, match=r"layers\.down: a stacked layer \(\[3\]"):
        q4jax.state_dict(q)


# ------------------------------------------------------------------ the report


class RawWeight(nnx.Module):
    def __init__(self, rngs):
        self.w = nnx.Param(jax.random.normal(rngs.params(), (64, 32)))

    def __call__(self, x):
        return x @ self.w[...]


class OwnCall(nnx.Linear):
    """Overrides the call and reads the float kernel itself: cannot stand over a quantized layer."""

    def __call__(self, x):
        return x @ self.kernel[...] * 2


class ThroughSuper(nnx.Linear):
    """Overrides the call through super(): quantized, its own call kept."""

    def __call__(self, x):
        return super().__call__(x) * 2


class Zoo(nnx.Module):
    def __init__(self, rngs):
        self.lin = nnx.Linear(64, 64, rngs=rngs)
        self.lm_head = nnx.Linear(64, 96, rngs=rngs)
        self.embed = nnx.Embed(96, 64, rngs=rngs)
        self.conv = nnx.Conv(64, 64, (3,), rngs=rngs)
        self.raw = RawWeight(rngs)
        self.own = OwnCall(64, 64, rngs=rngs)
        self.odd = nnx.Linear(96, 64, rngs=rngs)  # in_features not a multiple of 64: no W4A8
        self.sup = ThroughSuper(64, 64, rngs=rngs)


def _rows(report):
    return {r.path: r.detail for r in report.left_float}


def test_report_names_every_layer_left_float_and_why(caplog):
    with caplog.at_level(logging.INFO, logger="q4jax"):
        _, report = q4jax.quantize_model(Zoo(nnx.Rngs(0)), "nf4", activation_quant="int8", return_report=True)
    assert {r.path: r.detail for r in report.quantized} == {"lin": "Linear4bit (nf4)", "sup": "ThroughSuper4bit (nf4)"}
    rows = _rows(report)
    assert rows["lm_head"] == "skip rule"
    assert rows["embed"] == "embeddings=False"
    assert rows["own"].startswith("OwnCall.__call__ reads self.kernel itself")
    assert rows["odd"].startswith("activation_quant='int8'") and "96" in rows["odd"]
    assert rows["conv.kernel"].startswith("a float parameter (3, 64, 64) of nnx.Conv")
    assert rows["raw.w"].startswith("a float parameter (64, 32) of RawWeight")
    assert set(rows) == {"lm_head", "embed", "own", "odd", "conv.kernel", "raw.w"}
    warned = {
        r.getMessage().split(" float: ")[0].rsplit(" ", 1)[-1] for r in caplog.records if r.levelno == logging.WARNING
    }
    assert warned == {"own", "odd", "conv.kernel", "raw.w"}  # the skip rule and embeddings=False are INFO


def test_strict_raises_on_what_no_option_asked_for():
    with pytest.raises(ValueError, match=r"strict=True.*own \(OwnCall.*conv\.kernel.*raw\.w") as e:
        q4jax.quantize_model(Zoo(nnx.Rngs(0)), "nf4", strict=True)
    assert "lm_head" not in str(e.value) and "embed (" not in str(e.value)
    model = q4jax.quantize_model(
        Zoo(nnx.Rngs(0)), "nf4", strict=True, skip=("lm_head", "conv", "raw", "own"), embeddings=True
    )
    assert isinstance(model.embed, q4jax.nn.Embedding4bit) and isinstance(model.odd, Linear4bit)


def test_subclasses_keep_their_methods_copies_and_splits():
    model = Gemma(nnx.Rngs(0), layers=1)
    q = q4jax.quantize_model(model, "int8", embeddings=True)
    ids = jnp.asarray([[1, 2, 3]])
    assert type(q.embedder).__name__ == "Embedder8bit" and q.embedder.encode(ids).shape == (1, 3, 64)
    assert type(q.blocks[0].gate_proj).__name__ == "GatedLinear8bit"
    clone = nnx.clone(q)
    assert type(clone.embedder) is type(q.embedder)
    graphdef, state = nnx.split(q)
    again = nnx.merge(graphdef, state)
    np.testing.assert_array_equal(np.asarray(again(ids)), np.asarray(q(ids)))


# ------------------------------------------------------------------ out_sharding, methods, checkpoints


def test_out_sharding_is_honoured_as_the_float_layer_honours_it():
    mesh = jax.make_mesh((1,), ("d",), axis_types=(AxisType.Explicit,))
    layers = {
        "lin": nnx.Linear(64, 32, rngs=nnx.Rngs(0)),
        "einsum": nnx.Einsum("BTD,NDH->BTNH", (4, 64, 16), rngs=nnx.Rngs(0)),
        "general": nnx.LinearGeneral(64, (4, 16), rngs=nnx.Rngs(0)),
    }
    quantized = q4jax.quantize_model(nnx.Dict(**{k: nnx.clone(v) for k, v in layers.items()}), "nf4")
    x = jnp.ones((2, 5, 64))
    with jax.set_mesh(mesh):
        for name, layer in layers.items():
            spec = P("d", *([None] * (layer(x).ndim - 1)))
            want = layer(x, out_sharding=spec).sharding.spec
            got = quantized[name](x, out_sharding=spec).sharding.spec
            assert got == want == spec, name
        emb = q4jax.quantize_model(nnx.Dict(e=nnx.Embed(96, 64, rngs=nnx.Rngs(0))), "nf4", embeddings=True)["e"]
        assert emb.attend(x, out_sharding=P("d", None, None)).sharding.spec == P("d", None, None)


@pytest.mark.parametrize("method", ["mse", "gptq"])
def test_error_minimising_methods_on_an_einsum(method):
    """The same bytes as q4's numpy quantizer on the stored matrix (gptq: with the
    Hessian of the rows the einsum multiplies: the contracted axis, over batch x time)."""
    layer = nnx.Einsum("BTD,NDH->BTNH", (4, 64, 16), rngs=nnx.Rngs(0))
    w = np.asarray(layer.kernel.get_value()).transpose(0, 2, 1).reshape(64, 64)
    x = np.random.default_rng(4).standard_normal((3, 7, 64)).astype(np.float32)
    calib = [jnp.asarray(x)] if method == "gptq" else None
    q = q4jax.quantize_model(_Holder(layer), "nf4", method=method, calibration=calib).layer
    rows = x.reshape(-1, 64).astype(np.float64)
    h = rows.T @ rows if method == "gptq" else None
    packed, state = quantize_weight_4bit(w, BS, "nf4", True, method, hessian=h)
    assert np.asarray(q.quantized.weight.get_value()).tobytes() == packed.tobytes()


def test_einsum_checkpoint_is_the_2d_matrix_and_reloads(tmp_path):
    """state_dict stores the projection under its own path as the 2-D matrix, with the
    bytes q4torch stores for that matrix; load_quantized rebuilds the layer in a float model."""
    torch = pytest.importorskip("torch")
    import q4torch.functional as F

    def model():
        return nnx.Dict(
            q=nnx.Einsum("BTD,NDH->BTNH", (4, 64, 16), rngs=nnx.Rngs(0)),
            o=nnx.LinearGeneral((4, 16), 64, axis=(-2, -1), rngs=nnx.Rngs(1)),
        )

    float_model = model()
    w = np.asarray(float_model["q"].kernel.get_value()).transpose(0, 2, 1).reshape(64, 64)
    q = q4jax.quantize_model(model(), "nf4")
    sd = q4jax.state_dict(q)
    assert {"q.weight", "o.weight", "o.bias"} <= set(sd) and not any(".base." in k for k in sd)
    packed, _ = F.quantize_4bit(torch.from_numpy(w), blocksize=BS, compress_statistics=True, quant_type="nf4")
    assert sd["q.weight"].tobytes() == packed.numpy().tobytes()
    reloaded = model()
    rest = q4jax.load_quantized(reloaded, sd)
    assert rest == {} and isinstance(reloaded["q"], QuantizedEinsum)
    x = jnp.ones((2, 5, 64))
    np.testing.assert_array_equal(np.asarray(reloaded["q"](x)), np.asarray(q["q"](x)))
    h = jnp.ones((2, 5, 4, 16))
    np.testing.assert_array_equal(np.asarray(reloaded["o"](h)), np.asarray(q["o"](h)))


def test_a_subclass_overriding_the_call_through_super_keeps_its_call():
    """ThroughSuper doubles nnx.Linear's output: quantized, it doubles the quantized output."""
    layer = ThroughSuper(64, 64, rngs=nnx.Rngs(0))
    plain = nnx.Linear(64, 64, rngs=nnx.Rngs(0))
    m = q4jax.quantize_model(nnx.Dict(a=layer, b=plain), "nf4")
    assert isinstance(m["a"], ThroughSuper) and isinstance(m["a"], Linear4bit)
    x = jnp.ones((3, 64))
    np.testing.assert_array_equal(np.asarray(m["a"](x)), 2 * np.asarray(m["b"](x)))
