"""q4jax.nn embeddings (Embedding4bit / NF4 / FP4, Embedding8bit,
StableEmbedding): lookups against the numpy oracle, under jit, attend,
checkpoints, copying, gradients, quantize_model, bad input."""

from __future__ import annotations

import copy
import gc
import weakref

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from q4_reference import inputs, oracle
from q4_reference.matmul import rel_err

import q4jax
from q4._src import formats
from q4jax import nn as qnn

N = 37


def _table(rng, n=N, d=65, dtype="float32", kind="normal") -> np.ndarray:
    return inputs.make(rng, (n, d), dtype, kind)


def _ids(rng, shape=(3, 7), n=N) -> np.ndarray:
    ids = rng.integers(0, n, size=shape).astype(np.int32)
    ids.reshape(-1)[:2] = [0, n - 1]
    return ids


def _emb4(table, **kw) -> qnn.Embedding4bit:
    n, d = table.shape
    return qnn.Embedding4bit(
        n, d, param_dtype=table.dtype, embedding_init=lambda *_: jnp.asarray(table), rngs=nnx.Rngs(0), **kw
    )


def _emb8(table) -> qnn.Embedding8bit:
    n, d = table.shape
    return qnn.Embedding8bit(
        n, d, param_dtype=table.dtype, embedding_init=lambda *_: jnp.asarray(table), rngs=nnx.Rngs(0)
    )


def oracle_rows(layer: qnn.Embedding4bit, ids: np.ndarray) -> np.ndarray:
    """The oracle's dequantized table, indexed, rounded to the state's dtype (as fp32)."""
    packed, st = np.asarray(layer.weight.get_value()), layer.quant_state.get_value()
    absmax = np.asarray(st.absmax)
    if st.nested:
        code = formats.code_table("dynamic")  # the library's table (the oracle's own is within 2 ulp)
        absmax = oracle.dequantize_blockwise(absmax, np.asarray(st.nested_absmax), 256, code, float(st.nested_offset))
    table = oracle.dequantize_4bit(packed, absmax, int(np.prod(st.shape)), st.blocksize, st.quant_type)
    rows = table.reshape(st.shape)[ids]
    return inputs.to_f32(inputs.to_dtype(rows, st.dtype))


def _bits(a) -> np.ndarray:
    return inputs.bits(np.asarray(a))


LOOKUPS = [
    # (dim, blocksize, nested, dtype)
    (384, 64, False, "float32"),
    (65, 64, False, "float32"),  # blocks straddle rows
    (96, 64, True, "float32"),
    (7, 32, True, "float32"),  # a row inside a block
    (1, 64, True, "float32"),
    (33, 4096, True, "float32"),  # the whole table is one partial block
    (300, 128, True, "bfloat16"),
    (130, 256, False, "float16"),
]


@pytest.mark.parametrize("quant_type", ["nf4", "fp4"])
@pytest.mark.parametrize(
    "dim, blocksize, nested, dtype", LOOKUPS, ids=[f"d{d}-bs{b}-{'n' if n else 'p'}-{t}" for d, b, n, t in LOOKUPS]
)
def test_lookup_equals_the_oracle(rng, quant_type, dim, blocksize, nested, dtype):
    table = _table(rng, d=dim, dtype=dtype)
    layer = _emb4(table, quant_type=quant_type, blocksize=blocksize, compress_statistics=nested)
    assert layer.quant_state.get_value().nested == nested
    ids = _ids(rng, (5, 11))
    got = layer(ids)
    assert got.dtype == jnp.dtype(dtype) and got.shape == (5, 11, dim)
    assert np.array_equal(_bits(got.astype(jnp.float32)), _bits(oracle_rows(layer, ids)))
    jitted = nnx.jit(lambda m, i: m(i))(layer, jnp.asarray(ids))
    assert np.array_equal(_bits(jitted), _bits(got))
    full = q4jax.dequantize_4bit(layer.weight.get_value(), layer.quant_state.get_value())
    assert np.array_equal(_bits(np.asarray(full)[ids]), _bits(got))


@pytest.mark.parametrize("n, dim, blocksize", [(300, 65, 32), (300, 64, 64), (3000, 3, 32)])
def test_nested_lookup_across_256_block_groups(rng, n, dim, blocksize):
    """Tables of several 256-block groups of nested absmax codes: every row,
    including those whose blocks straddle two groups, equals the oracle."""
    layer = _emb4(_table(rng, n, dim), blocksize=blocksize, compress_statistics=True)
    assert layer.quant_state.get_value().nested_absmax.shape[0] >= 2
    ids = np.arange(n, dtype=np.int32).reshape(3, -1)
    assert np.array_equal(_bits(layer(ids)), _bits(oracle_rows(layer, ids)))


def test_8bit_lookup_is_the_definition(rng):
    for dtype in ("float32", "bfloat16"):
        table = _table(rng, d=65, dtype=dtype)
        layer = _emb8(table)
        cb, scb = np.asarray(layer.weight.get_value()), np.asarray(layer.SCB.get_value())
        want_cb, want_scb = q4jax.quantize_int8_weight(jnp.asarray(table))
        assert cb.tobytes() == np.asarray(want_cb).tobytes() and scb.tobytes() == np.asarray(want_scb).tobytes()
        ids = _ids(rng, (4, 9))
        want = cb[ids].astype(np.float32) * (scb[ids] / np.float32(127))[..., None]  # an IEEE division
        want = inputs.to_f32(inputs.to_dtype(want, dtype))
        for got in (layer(ids), nnx.jit(lambda m, i: m(i))(layer, jnp.asarray(ids))):
            assert got.dtype == jnp.dtype(dtype)
            assert np.array_equal(_bits(got.astype(jnp.float32)), _bits(want))


@pytest.mark.parametrize("shape", [(), (0,), (10,), (2, 5, 3)], ids=str)
def test_input_shapes_and_index_dtypes(rng, shape):
    table = _table(rng)
    for layer in (_emb4(table), _emb8(table), qnn.StableEmbedding(N, 65, rngs=nnx.Rngs(0))):
        ids = rng.integers(0, N, size=shape)
        for dt in (np.int32, np.uint8):
            out = layer(ids.astype(dt))
            assert out.shape == (*shape, 65)
            if ids.size:
                np.testing.assert_array_equal(
                    out, np.asarray(layer(ids.reshape(-1).astype(np.int32))).reshape(out.shape)
                )


def test_narrow_index_dtypes_on_a_large_table(rng):
    layer = _emb8(_table(rng, n=300, d=8))
    ids = np.array([0, 255, 7], np.uint8)
    np.testing.assert_array_equal(layer(ids), layer(ids.astype(np.int32)))
    assert np.isnan(np.asarray(jax.jit(lambda i: layer(i))(np.array([299, 300], np.uint16)))[1]).all()


def test_out_of_range_indices(rng):
    table = _table(rng)
    for layer in (_emb4(table), _emb8(table), qnn.StableEmbedding(N, 65, rngs=nnx.Rngs(0))):
        name = type(layer).__name__
        with pytest.raises(IndexError, match=f"{name}: index 37 is out of range for num_embeddings=37"):
            layer(np.array([[1, 37]]))
        with pytest.raises(IndexError, match="index -2 is out of range"):
            layer(jnp.array([-2, 3]))
        # under jit nothing can raise: a bad index gives a NaN row, never another row's values
        ids = jnp.array([3, 37, -1, 0])
        out = np.asarray(nnx.jit(lambda m, i: m(i))(layer, ids))
        assert np.isnan(out[1:3]).all() and not np.isnan(out[[0, 3]]).any()
        np.testing.assert_array_equal(out[[0, 3]], np.asarray(layer(np.array([3, 0]))))


def test_bad_input_raises(rng):
    table = _table(rng)
    for layer in (_emb4(table), _emb8(table)):
        with pytest.raises(TypeError, match="integer indices, got float32"):
            layer(jnp.zeros(3))
        with pytest.raises(TypeError, match="integer indices, got bool"):
            layer(np.zeros(3, bool))
        with pytest.raises(ValueError, match="65 features in the last axis, got"):
            layer.attend(jnp.zeros((2, 64)))
        with pytest.raises(TypeError, match="query dtype"):
            layer.attend(jnp.zeros((2, 65), jnp.int32))
        with pytest.raises(ValueError, match=r"shape \(num_embeddings, features\) = \(37, 65\), got \(37, 64\)"):
            layer.set_weight(jnp.zeros((N, 64)))
        with pytest.raises(TypeError, match="table dtype"):
            layer.set_weight(jnp.zeros((N, 65), jnp.int32))
    with pytest.raises(ValueError, match="num_embeddings must be a positive int, got 0"):
        qnn.Embedding4bit(0, 8, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="quant_type"):
        qnn.Embedding4bit(4, 8, quant_type="int4", rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="blocksize"):
        qnn.Embedding4bit(4, 8, blocksize=48, rngs=nnx.Rngs(0))
    with pytest.raises(TypeError, match="EmbeddingNF4 fixes quant_type='nf4', got 'fp4'"):
        qnn.EmbeddingNF4(4, 8, quant_type="fp4", rngs=nnx.Rngs(0))
    with pytest.raises(TypeError, match="from_embed expects an nnx.Embed, got Linear"):
        qnn.Embedding4bit.from_embed(nnx.Linear(2, 2, rngs=nnx.Rngs(0)))


def test_attend_is_the_tied_projection(rng):
    """attend(q) = q . E^T through the fused kernels: within the fp32 rounding
    of a dense matmul with the dequantized table."""
    table = _table(rng, d=64) * 0.1
    q = jnp.asarray(inputs.make(rng, (5, 64), "float32"))
    layer4 = _emb4(table, blocksize=32, compress_statistics=True)
    deq = np.asarray(q4jax.dequantize_4bit(layer4.weight.get_value(), layer4.quant_state.get_value()), np.float64)
    got = layer4.attend(q)
    assert got.shape == (5, N) and got.dtype == jnp.float32
    assert rel_err(got, np.asarray(q, np.float64) @ deq.T) < 1e-6
    layer8 = _emb8(table)
    cb, scb = np.asarray(layer8.weight.get_value()), np.asarray(layer8.SCB.get_value())
    deq8 = cb.astype(np.float64) * scb[:, None] / 127
    assert rel_err(layer8.attend(q), np.asarray(q, np.float64) @ deq8.T) < 2e-2  # int8 activations
    g = nnx.grad(lambda m, x: jnp.sum(m.attend(x) ** 2), argnums=1)(layer4, q)
    assert rel_err(g, 2 * (np.asarray(q, np.float64) @ deq.T) @ deq) < 1e-5


def test_nnx_embed_conversion_and_dtype(rng):
    embed = nnx.Embed(N, 48, param_dtype=jnp.bfloat16, rngs=nnx.Rngs(3))
    before = np.asarray(embed.embedding.get_value()).copy()
    layer = qnn.EmbeddingFP4.from_embed(embed, blocksize=128, compress_statistics=True)
    assert layer.quant_type == "fp4" and layer.dtype == jnp.bfloat16
    packed, st = q4jax.quantize_4bit(embed.embedding.get_value(), 128, "fp4", True)
    assert np.asarray(layer.weight.get_value()).tobytes() == np.asarray(packed).tobytes()
    ids = _ids(rng)
    assert np.array_equal(_bits(layer(ids)), _bits(np.asarray(q4jax.dequantize_4bit(packed, st))[ids]))
    assert layer(ids).dtype == jnp.bfloat16
    f32 = qnn.Embedding8bit.from_embed(nnx.Embed(N, 48, dtype=jnp.float32, param_dtype=jnp.bfloat16, rngs=nnx.Rngs(3)))
    assert f32(ids).dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(embed.embedding.get_value()), before)  # the Embed is not modified


# ------------------------------------------------------------------ checkpoints


def _entries_equal(a: dict, b: dict) -> bool:
    return sorted(a) == sorted(b) and all(
        np.asarray(a[k]).dtype == np.asarray(b[k]).dtype and np.asarray(a[k]).tobytes() == np.asarray(b[k]).tobytes()
        for k in a
    )


@pytest.mark.parametrize("kind", ["nf4-nested", "fp4", "int8", "stable"])
def test_checkpoint_round_trip(rng, kind):
    table = _table(rng)
    make = {
        "nf4-nested": lambda t: _emb4(t, blocksize=32, compress_statistics=True),
        "fp4": lambda t: _emb4(t, quant_type="fp4"),
        "int8": _emb8,
        "stable": lambda t: qnn.StableEmbedding(N, 65, embedding_init=lambda *_: jnp.asarray(t), rngs=nnx.Rngs(0)),
    }[kind]
    src = make(table)
    sd = qnn.state_dict(src)
    want = {
        "nf4-nested": {"weight", "weight.absmax", "weight.quant_map", "weight.nested_absmax", "weight.nested_quant_map"}
        | {"weight.quant_state.bitsandbytes__nf4"},
        "fp4": {"weight", "weight.absmax", "weight.quant_map", "weight.quant_state.bitsandbytes__fp4"},
        "int8": {"weight", "SCB", "weight_format"},
        "stable": {"weight", "norm.weight", "norm.bias"},
    }[kind]
    assert set(sd) == want
    snapshot = {k: v.copy() for k, v in sd.items()}
    ids = _ids(rng)
    fresh = make(_table(rng))  # another table (and, for 4-bit, other settings get overwritten)
    fresh(ids)  # after a forward
    qnn.load_state_dict(fresh, sd)
    assert np.array_equal(_bits(fresh(ids)), _bits(src(ids)))
    assert _entries_equal(qnn.state_dict(fresh), sd)
    assert _entries_equal(sd, snapshot)  # the caller's arrays unchanged, and not aliased:
    for v in sd.values():
        v[...] = 0
    assert _entries_equal(qnn.state_dict(fresh), snapshot)
    # a model holding the layer: torch-style dotted keys
    model = nnx.Dict({"tok": fresh})
    assert set(qnn.state_dict(model)) == {"tok." + k for k in want}


def test_4bit_takes_the_checkpoints_format_and_float_tables(rng):
    src = _emb4(_table(rng), quant_type="fp4", blocksize=128, compress_statistics=True)
    layer = _emb4(_table(rng))  # nf4, block 64, plain
    qnn.load_state_dict(layer, qnn.state_dict(src))
    assert (layer.quant_type, layer.blocksize, layer.compress_statistics) == ("fp4", 128, True)
    ids = _ids(rng)
    assert np.array_equal(_bits(layer(ids)), _bits(src(ids)))
    table = _table(rng)
    qnn.load_state_dict(layer, {"weight": table})  # a float table: quantized with the layer's settings
    assert _entries_equal(
        qnn.state_dict(layer), qnn.state_dict(_emb4(table, quant_type="fp4", blocksize=128, compress_statistics=True))
    )
    layer8 = _emb8(_table(rng))
    qnn.load_state_dict(layer8, {"weight": table})
    assert _entries_equal(qnn.state_dict(layer8), qnn.state_dict(_emb8(table)))


@pytest.mark.parametrize(
    "kind, corrupt, match",
    [
        ("4", lambda sd: sd.pop("weight.quant_state.bitsandbytes__nf4"), "no 'weight.quant_state"),
        ("4", lambda sd: sd.update({"weight.absmax": sd["weight.absmax"][:-1]}), "absmax"),
        ("4", lambda sd: sd.update({"weight": sd["weight"][:-1]}), "needs"),
        (
            "4",
            lambda sd: sd.update({"weight.quant_state.bitsandbytes__nf4": np.array([1, 2], np.uint8)}),
            "quant_state",
        ),
        ("4", lambda sd: (sd.clear(), sd.update({"weight": np.zeros((N, 64), np.float32)})), "float table of shape"),
        ("4", lambda sd: sd.update({"extra": np.zeros(1)}), "unexpected keys \\['extra'\\]"),
        ("8", lambda sd: sd.pop("SCB"), "missing key 'SCB'"),
        ("8", lambda sd: sd.update({"SCB": sd["SCB"][:-1]}), "'SCB' must be a float array of shape \\(37,\\)"),
        ("8", lambda sd: sd.update({"weight_format": np.array(3, np.uint8)}), "row-major"),
        ("8", lambda sd: sd.update({"weight": sd["weight"].astype(np.int32)}), "int8 \\(quantized\\) or float"),
        ("8", lambda sd: sd.update({"weight": sd["weight"][:, 1:]}), "size mismatch"),
        ("s", lambda sd: sd.pop("norm.bias"), "missing key 'norm.bias'"),
        ("s", lambda sd: sd.update({"norm.weight": np.zeros(3, np.float32)}), "'norm.weight' must be a float array"),
    ],
)
def test_corrupted_checkpoints_raise_and_change_nothing(rng, kind, corrupt, match):
    make = {
        "4": lambda: _emb4(_table(rng)),
        "8": lambda: _emb8(_table(rng)),
        "s": lambda: qnn.StableEmbedding(N, 65, rngs=nnx.Rngs(0)),
    }[kind]
    sd = qnn.state_dict(make())
    corrupt(sd)
    layer = make()
    before = qnn.state_dict(layer)
    with pytest.raises(ValueError, match=match):
        qnn.load_state_dict(layer, sd)
    assert _entries_equal(qnn.state_dict(layer), before)


# ------------------------------------------------------------------ copying, gradients, jit


class _Model(nnx.Module):
    def __init__(self, rng):
        self.tok = _emb4(_table(rng, d=32), compress_statistics=True)
        self.tied = self.tok  # one layer reachable by two paths
        self.int8 = _emb8(_table(rng, d=32))
        self.stable = qnn.StableEmbedding(N, 32, rngs=nnx.Rngs(1))
        self.head = nnx.Linear(32, 4, rngs=nnx.Rngs(2))

    def __call__(self, ids):
        return self.head(self.tok(ids) + self.int8(ids) + self.stable(ids) + self.tied(ids))


@pytest.mark.parametrize("how", ["clone", "deepcopy"])
def test_copy_is_independent(rng, how):
    model = _Model(rng)
    ids = jnp.asarray(_ids(rng))
    y0 = np.asarray(model(ids))
    before = qnn.state_dict(model)
    dup = nnx.clone(model) if how == "clone" else copy.deepcopy(model)
    assert dup.tied is dup.tok and dup.tok is not model.tok and dup.tok.weight is not model.tok.weight
    np.testing.assert_array_equal(np.asarray(dup(ids)), y0)
    dup.tok.set_weight(_table(rng, d=32))
    dup.int8.set_weight(_table(rng, d=32))
    dup.stable.embedding.set_value(dup.stable.embedding.get_value() + 1)
    assert _entries_equal(qnn.state_dict(model), before)
    np.testing.assert_array_equal(np.asarray(model(ids)), y0)
    ref = weakref.ref(model)
    del model
    gc.collect()
    assert ref() is None
    dup(ids)


def test_grads_reach_params_only_under_jit(rng):
    model = _Model(rng)
    ids = jnp.asarray(_ids(rng))

    @nnx.jit
    def step(m, i):
        return nnx.grad(lambda m: jnp.mean(m(i) ** 2))(m)

    grads = step(model, ids)
    assert not jax.tree.leaves(nnx.state(grads, qnn.QuantStateVar))
    names = {".".join(map(str, p)) for p, _ in nnx.to_flat_state(grads)}
    assert names == {"stable.embedding", "stable.norm.scale", "stable.norm.bias", "head.kernel", "head.bias"}
    assert float(jnp.abs(grads["stable"]["embedding"][...]).sum()) > 0


def test_stable_embedding_is_the_definition(rng):
    table = _table(rng, d=48, dtype="bfloat16")
    layer = qnn.StableEmbedding(
        N, 48, param_dtype=jnp.bfloat16, embedding_init=lambda *_: jnp.asarray(table), rngs=nnx.Rngs(0)
    )
    layer.norm.scale.set_value(jnp.asarray(inputs.make(rng, (48,), "float32")))
    layer.norm.bias.set_value(jnp.asarray(inputs.make(rng, (48,), "float32")))
    ids = _ids(rng)
    x = inputs.to_f32(table)[ids].astype(np.float64)
    mean = x.mean(-1, keepdims=True)
    var = ((x - mean) ** 2).mean(-1, keepdims=True)
    want = (x - mean) / np.sqrt(var + 1e-5) * np.asarray(layer.norm.scale.get_value()) + np.asarray(
        layer.norm.bias.get_value()
    )
    got = layer(ids)
    assert got.dtype == jnp.bfloat16
    assert rel_err(got.astype(jnp.float32), want) < 2**-8  # bf16 output
    assert rel_err(layer.norm(jnp.asarray(x, jnp.float32)), want) < 1e-6
    default = qnn.StableEmbedding(1000, 24, rngs=nnx.Rngs(0))
    bound = (6 / (1000 + 24)) ** 0.5  # Xavier uniform
    top = float(jnp.abs(default.embedding.get_value()).max())
    assert 0.9 * bound < top <= bound


# ------------------------------------------------------------------ quantize_model


class _Net(nnx.Module):
    def __init__(self):
        rngs = nnx.Rngs(0)
        self.tok = nnx.Embed(50, 64, rngs=rngs)
        self.pos = nnx.Embed(16, 64, rngs=rngs)
        self.proj = nnx.Linear(64, 32, rngs=rngs)


@pytest.mark.parametrize("quant_type", ["nf4", "int8"])
def test_quantize_model_embeddings(rng, quant_type):
    net = _Net()
    table = np.asarray(net.tok.embedding.get_value())
    assert type(q4jax.quantize_model(nnx.clone(net), quant_type).tok) is nnx.Embed  # off by default
    q4jax.quantize_model(net, quant_type, embeddings=True, skip=("pos",), blocksize=32)
    want = qnn.Embedding8bit if quant_type == "int8" else qnn.Embedding4bit
    assert type(net.tok) is want and type(net.pos) is nnx.Embed and type(net.proj) is not nnx.Linear
    if quant_type == "nf4":
        assert (net.tok.blocksize, net.tok.compress_statistics) == (32, True)
        packed, _ = q4jax.quantize_4bit(jnp.asarray(table), 32, "nf4", True)
        assert np.asarray(net.tok.weight.get_value()).tobytes() == np.asarray(packed).tobytes()
    else:
        cb, _ = q4jax.quantize_int8_weight(jnp.asarray(table))
        assert np.asarray(net.tok.weight.get_value()).tobytes() == np.asarray(cb).tobytes()
