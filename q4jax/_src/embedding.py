"""flax.nnx embedding layers on the shared kernels: Embedding4bit
(EmbeddingNF4 / EmbeddingFP4), Embedding8bit and StableEmbedding, with the
checkpoint entries of q4torch's / bitsandbytes' layers of the same names.

The quantized table is E [num_embeddings, features] (nnx.Embed's
``embedding``), quantized as q4torch quantizes it: 4-bit blockwise over the
flattened table (the same packed bytes and absmax), or int8 rows with one
fp32 absmax each (rounded to fp16 first). A lookup gives the same bits as
q4torch's for the same checkpoint:

- 4-bit: ``dequantize_4bit(E)[ids]`` in the state's dtype, decoding only the
  blocks the looked-up rows touch (gathered, then decoded by the kernels'
  XLA ops; a block may straddle two rows);
- 8-bit: ``CB[ids] * (SCB[ids] / 127)`` in fp32 (an IEEE division, as in
  PyTorch: XLA would otherwise turn the division by the constant 127 into a
  multiplication by its rounded reciprocal, one ulp off for about a quarter
  of the values);

then cast to ``dtype``. ``attend(query)`` (nnx.Embed's tied-output
projection, query . E^T) runs the fused matmul kernels on the quantized table.

Indices must be integers. Outside a trace an index outside
[0, num_embeddings) raises IndexError; under ``jit`` it cannot be checked, and
its row comes back as NaN (never another row's values).

Quantization state lives in QuantStateVar (frozen: ``nnx.grad`` never sees
it); StableEmbedding's table and LayerNorm are nnx.Param (trainable).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from flax.nnx.nn.linear import default_embed_init

from q4._src import formats
from q4._src.schema import FLOAT_DTYPES, int8_entries, plan_4bit_load, plan_int8_load, quant4_entries
from q4jax._src import ffi
from q4jax._src.layers import (
    QuantStateVar,
    WeightShape,
    _device_copy,
    _float_dtype_name,
    _host_copy,
    concrete,
    device_4bit,
    out_sharded,
)
from q4jax._src.matmul import matmul_4bit, matmul_8bit
from q4jax._src.quant import QuantState, check_state, quantize_4bit, quantize_int8_weight

_XAVIER_UNIFORM = nnx.initializers.xavier_uniform()  # StableEmbedding's (bitsandbytes': xavier_uniform_)


def blocks_per_row(dim: int, blocksize: int) -> int:
    """How many consecutive blocks the elements of one row can touch: row r
    starts at offset (r*dim) mod blocksize of its first block, a multiple of
    g = gcd(dim, blocksize), at most blocksize - g (q4torch uses the same bound)."""
    g = math.gcd(dim, blocksize)
    return (blocksize - g + dim - 1) // blocksize + 1


# ------------------------------------------------------------------ lookups


def _rows(ids: jax.Array, num_embeddings: int) -> tuple[jax.Array, jax.Array]:
    """(int32 row of each index, clamped into the table; whether it was in range)."""
    flat = ids.reshape(-1)
    if flat.dtype.itemsize < 4:  # (u)int8 / (u)int16: compare in int32, where num_embeddings fits
        flat = flat.astype(jnp.int32)
    valid = (flat >= 0) & (flat < num_embeddings)
    return jnp.clip(flat, 0, num_embeddings - 1).astype(jnp.int32), valid


def _row_start(rows: jax.Array, dim: int, blocksize: int) -> tuple[jax.Array, jax.Array]:
    """(first block, offset in it) of each row's first element r*dim, in int32
    without forming r*dim (which overflows for tables of 2^31 elements): with
    dim = q*bs + rem and r = hi*bs + lo, r*dim = (r*q + hi*rem)*bs + lo*rem."""
    q, rem = divmod(dim, blocksize)
    if rem == 0:
        return rows * q, jnp.zeros_like(rows)
    hi, lo = rows // blocksize, rows % blocksize
    t = lo * rem
    return rows * q + hi * rem + t // blocksize, t % blocksize


def _gather_blocks(flat: jax.Array, first: jax.Array, count: int, width: int) -> jax.Array:
    """[n, count * width]: for each row i the blocks first[i] .. first[i] + count - 1
    of `flat` cut into blocks of `width` elements (the last block may be
    partial). Blocks past the end read as some other block's elements (callers
    discard every position that is not inside the array)."""
    n = first.shape[0]
    full, tail = divmod(flat.size, width)
    ids = first[:, None] + jnp.arange(count, dtype=first.dtype)
    if full:
        body = (flat[: full * width] if tail else flat).reshape(full, width)
        out = jnp.take(body, jnp.minimum(ids, full - 1), axis=0, mode="clip")
    else:
        out = jnp.zeros((n, count, width), flat.dtype)
    if tail:
        last = jnp.zeros((width,), flat.dtype).at[:tail].set(flat[full * width :])
        out = jnp.where((ids == full)[..., None], last, out)
    return out.reshape(n, count * width)


def _block_absmax(state: QuantState, first: jax.Array, count: int) -> jax.Array:
    """fp32 [n, count]: the absmax of blocks first[i] .. first[i] + count - 1; a
    nested state is decoded by the kernel in whole 256-blocks of codes, only
    those the rows touch: fp32(code[q] * absmax2[block]) + offset."""
    n_blocks = state.absmax.shape[0]
    if not state.nested:
        ids = jnp.minimum(first[:, None] + jnp.arange(count, dtype=first.dtype), n_blocks - 1)
        return jnp.take(state.absmax, ids, mode="clip")
    bs2 = formats.nested_blocksize()
    first2 = first // bs2
    count2 = (count + 2 * bs2 - 2) // bs2  # 256-blocks touched by `count` blocks from any offset
    codes = _gather_blocks(state.absmax, first2, count2, bs2)
    nested_absmax = state.nested_absmax
    assert nested_absmax is not None  # state.nested
    ids2 = jnp.minimum(first2[:, None] + jnp.arange(count2, dtype=first.dtype), nested_absmax.shape[0] - 1)
    scales = jnp.take(nested_absmax, ids2, mode="clip")
    code = jnp.asarray(formats.code_table("dynamic"))
    decoded = ffi.dequantize_blockwise_raw(
        codes.reshape(-1), scales.reshape(-1), code, state.nested_offset, bs2, "float32"
    ).reshape(first.shape[0], count2 * bs2)
    at = (first - first2 * bs2)[:, None] + jnp.arange(count, dtype=first.dtype)
    return jnp.take_along_axis(decoded, at, axis=1)


@functools.partial(jax.jit, static_argnames=("num_embeddings", "features"))
def lookup_4bit(packed: jax.Array, state: QuantState, ids: jax.Array, *, num_embeddings: int, features: int):
    """Rows ``ids`` (any shape) of the [num_embeddings, features] table packed in
    ``packed`` / ``state``: [*ids.shape, features] in state.dtype, bit for bit
    ``dequantize_4bit(packed, state)[ids]``, decoding only the blocks those rows
    touch; an index outside the table gives a NaN row."""
    check_state(packed, state)
    if tuple(state.shape) != (num_embeddings, features):
        raise ValueError(f"state.shape {state.shape} is not the table's {(num_embeddings, features)}")
    rows, valid = _rows(ids, num_embeddings)
    n, bs = rows.shape[0], state.blocksize
    if n == 0:
        return jnp.zeros((*ids.shape, features), state.dtype)
    count = blocks_per_row(features, bs)
    first, off = _row_start(rows, features, bs)
    absmax = _block_absmax(state, first, count)
    data = _gather_blocks(packed.reshape(-1), first, count, bs // 2)
    out = ffi.dequantize_4bit_raw(
        data.reshape(-1), absmax.reshape(-1), (n, count * bs), state.dtype, bs, state.quant_type
    )
    if count * bs != features:
        out = jnp.take_along_axis(out, off[:, None] + jnp.arange(features, dtype=off.dtype), axis=1)
    out = jnp.where(valid[:, None], out, jnp.nan)
    return out.reshape(*ids.shape, features)


@functools.partial(jax.jit, static_argnames=("num_embeddings",))
def lookup_8bit(cb: jax.Array, scb: jax.Array, ids: jax.Array, *, num_embeddings: int):
    """``CB[ids] * (SCB[ids] / 127)`` in fp32, [*ids.shape, CB.shape[1]]; an index
    outside the table gives a NaN row."""
    rows, valid = _rows(ids, num_embeddings)
    q = jnp.take(cb, rows, axis=0, mode="clip")
    s = jnp.take(scb, rows, mode="clip")
    # the divisor as an opaque full-shape operand: a division by the constant
    # 127 would be rewritten as a multiplication by fp32(1/127)
    s, d = jax.lax.optimization_barrier((s, jnp.full(s.shape, 127.0, jnp.float32)))
    out = q.astype(jnp.float32) * (s / d)[:, None]
    out = jnp.where(valid[:, None], out, jnp.nan)
    return out.reshape(*ids.shape, cb.shape[1])


# ------------------------------------------------------------------ layers


class _Embedding(nnx.Module):
    """Shared pieces: sizes, dtypes, the float table from an initializer, index checks."""

    def _init_common(self, num_embeddings, features, dtype, param_dtype, embedding_init, rngs) -> jax.Array:
        for name, value in (("num_embeddings", num_embeddings), ("features", features)):
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value <= 0:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        self.num_embeddings, self.features = int(num_embeddings), int(features)
        _float_dtype_name(param_dtype, "param_dtype")
        self.dtype = jnp.dtype(param_dtype if dtype is None else dtype)
        _float_dtype_name(self.dtype, "dtype")
        if not isinstance(rngs, nnx.Rngs):
            raise TypeError(f"rngs must be an nnx.Rngs, got {type(rngs).__name__}")
        table = embedding_init(rngs.params(), (self.num_embeddings, self.features), param_dtype)
        if tuple(table.shape) != (self.num_embeddings, self.features):
            raise ValueError(
                f"embedding_init returned shape {tuple(table.shape)}, expected {(self.num_embeddings, self.features)}"
            )
        return table

    def _check_table(self, table) -> jax.Array:
        table = table if isinstance(table, jax.Array) else jnp.asarray(np.asarray(table))
        _float_dtype_name(table.dtype, "table dtype")
        if tuple(table.shape) != (self.num_embeddings, self.features):
            raise ValueError(
                f"the table must have shape (num_embeddings, features) = {(self.num_embeddings, self.features)}, "
                f"got {tuple(table.shape)}"
            )
        return table

    def _check_ids(self, ids) -> jax.Array:
        if not hasattr(ids, "dtype"):
            ids = np.asarray(ids)
        if not jnp.issubdtype(ids.dtype, jnp.integer):
            raise TypeError(f"{type(self).__name__} input must hold integer indices, got {ids.dtype}")
        if not isinstance(ids, jax.core.Tracer) and ids.size:
            host = np.asarray(ids)
            lo, hi = int(host.min()), int(host.max())
            if lo < 0 or hi >= self.num_embeddings:
                bad = lo if lo < 0 else hi
                raise IndexError(
                    f"{type(self).__name__}: index {bad} is out of range for num_embeddings={self.num_embeddings}"
                )
        return jnp.asarray(ids)

    def _check_query(self, query) -> jax.Array:
        if not hasattr(query, "dtype") or query.ndim < 1 or query.shape[-1] != self.features:
            got = tuple(query.shape) if hasattr(query, "shape") else type(query).__name__
            raise ValueError(f"attend expects a query with {self.features} features in the last axis, got {got}")
        _float_dtype_name(query.dtype, "query dtype")
        return query.astype(self.dtype)


def _table_shape(self) -> WeightShape:
    """nnx.Embed's table as a shape and dtype (no float value): ``layer.embedding.shape``."""
    return WeightShape((self.num_embeddings, self.features), self.dtype, type(self).__name__, "embedding")


def _from_embed_args(embed: nnx.Embed) -> dict:
    if not isinstance(embed, nnx.Embed):
        raise TypeError(f"from_embed expects an nnx.Embed, got {type(embed).__name__}")
    table = concrete(embed.embedding.get_value())
    return dict(
        num_embeddings=embed.num_embeddings,
        features=embed.features,
        dtype=embed.dtype,
        param_dtype=table.dtype,
        embedding_init=lambda key, shape, dtype: table,
    )


class Embedding4bit(_Embedding):
    """An embedding table quantized to 4 bits (NF4 / FP4, blockwise over the
    flattened [num_embeddings, features] table, optionally nested absmax):
    q4torch's / bitsandbytes' Embedding4bit in nnx style.

    ``layer(ids)`` returns ``dequantize_4bit(E)[ids]`` cast to ``dtype`` (default
    ``param_dtype``), bit for bit q4torch's; ``attend(query)`` returns
    ``query . dequantize(E)^T`` through the fused kernel. The packed bytes and
    state are the checkpoint entries of q4torch's layer.
    """

    embedding = property(_table_shape)

    def __init__(
        self,
        num_embeddings: int,
        features: int,
        *,
        dtype=None,
        param_dtype=jnp.float32,
        embedding_init: Callable = default_embed_init,
        quant_type: str = "nf4",
        blocksize: int = 64,
        compress_statistics: bool = False,
        rngs: nnx.Rngs,
    ):
        formats.check_quant_type(quant_type)
        self.quant_type = quant_type
        self.blocksize = formats.check_blocksize(blocksize)
        self.compress_statistics = bool(compress_statistics)
        table = self._init_common(num_embeddings, features, dtype, param_dtype, embedding_init, rngs)
        self.weight = QuantStateVar(jnp.zeros((0, 1), jnp.uint8))
        self.quant_state = QuantStateVar(None)
        self.set_weight(table)

    def set_weight(self, table) -> Embedding4bit:
        """Quantize a float table [num_embeddings, features] with this layer's
        settings and replace the packed bytes and state (wholesale)."""
        packed, state = quantize_4bit(
            self._check_table(table), self.blocksize, self.quant_type, self.compress_statistics
        )
        self.weight.set_value(packed)
        self.quant_state.set_value(state)
        return self

    @classmethod
    def from_embed(
        cls,
        embed: nnx.Embed,
        *,
        quant_type: str | None = None,
        blocksize: int = 64,
        compress_statistics: bool = False,
    ) -> Embedding4bit:
        """Quantize an nnx.Embed's table (the Embed is not modified); quant_type
        None takes the class's (nf4 for Embedding4bit)."""
        kwargs: dict[str, Any] = {} if quant_type is None else {"quant_type": quant_type}
        return cls(
            **_from_embed_args(embed),
            **kwargs,
            blocksize=blocksize,
            compress_statistics=compress_statistics,
            rngs=nnx.Rngs(0),
        )

    def __call__(self, ids, out_sharding=None) -> jax.Array:
        ids = self._check_ids(ids)
        packed, state = self.weight.get_value(), self.quant_state.get_value()
        out = lookup_4bit(packed, state, ids, num_embeddings=self.num_embeddings, features=self.features)
        return out_sharded(out.astype(self.dtype), out_sharding)

    def attend(self, query, out_sharding=None) -> jax.Array:
        """query [..., features] . dequantize(E)^T -> [..., num_embeddings] in ``dtype``."""
        y = matmul_4bit(self._check_query(query), self.weight.get_value(), self.quant_state.get_value())
        return out_sharded(y, out_sharding)

    # -- checkpoint entries (keys relative to the layer's prefix)

    def _state_entries(self) -> dict[str, np.ndarray]:
        state = self.quant_state.get_value().to_numpy().to_dict()
        return quant4_entries(_host_copy(self.weight.get_value()), {k: _host_copy(v) for k, v in state.items()})

    def _plan_load(self, d: dict, prefix: str, errs: list[str], used: set[str]) -> Callable[[], None] | None:
        shape = (self.num_embeddings, self.features)
        found = plan_4bit_load(d, prefix, shape, errs, used, what="table")
        if found is None:
            return None
        data, st = found
        if st is None:
            table = _device_copy(data)

            def apply_float() -> None:
                self.set_weight(table)

            return apply_float
        packed_dev, state = device_4bit(data, st)

        def apply() -> None:
            self.quant_type, self.blocksize, self.compress_statistics = st.quant_type, st.blocksize, st.nested
            self.weight.set_value(packed_dev)
            self.quant_state.set_value(state)

        return apply


class _FixedQuantType(Embedding4bit):
    QUANT_TYPE = ""

    def __init__(self, num_embeddings: int, features: int, **kwargs):
        if kwargs.setdefault("quant_type", self.QUANT_TYPE) != self.QUANT_TYPE:
            raise TypeError(
                f"{type(self).__name__} fixes quant_type={self.QUANT_TYPE!r}, got {kwargs['quant_type']!r}; "
                "use Embedding4bit to choose it"
            )
        super().__init__(num_embeddings, features, **kwargs)


class EmbeddingNF4(_FixedQuantType):
    """Embedding4bit with NF4 codes."""

    QUANT_TYPE = "nf4"


class EmbeddingFP4(_FixedQuantType):
    """Embedding4bit with FP4 codes."""

    QUANT_TYPE = "fp4"


class Embedding8bit(_Embedding):
    """An embedding table quantized to int8 rows (LLM.int8's row format: CB int8
    [num_embeddings, features], SCB fp32 [num_embeddings], the table rounded to
    fp16 first): q4torch's / bitsandbytes' Embedding8bit in nnx style.

    ``layer(ids)`` returns ``CB[ids] * (SCB[ids] / 127)`` (fp32) cast to
    ``dtype`` (default ``param_dtype``), bit for bit q4torch's; ``attend``
    runs the LLM.int8 kernel. Quantization goes through the kernels' XLA op,
    so the layer can be built under ``jit``.
    """

    embedding = property(_table_shape)

    def __init__(
        self,
        num_embeddings: int,
        features: int,
        *,
        dtype=None,
        param_dtype=jnp.float32,
        embedding_init: Callable = default_embed_init,
        rngs: nnx.Rngs,
    ):
        table = self._init_common(num_embeddings, features, dtype, param_dtype, embedding_init, rngs)
        self.weight = QuantStateVar(jnp.zeros((0, 0), jnp.int8))
        self.SCB = QuantStateVar(jnp.zeros((0,), jnp.float32))
        self.set_weight(table)

    def set_weight(self, table) -> Embedding8bit:
        """Quantize a float table [num_embeddings, features] and replace CB / SCB."""
        cb, scb = quantize_int8_weight(self._check_table(table))
        self.weight.set_value(cb)
        self.SCB.set_value(scb)
        return self

    @classmethod
    def from_embed(cls, embed: nnx.Embed) -> Embedding8bit:
        """Quantize an nnx.Embed's table (the Embed is not modified)."""
        return cls(**_from_embed_args(embed), rngs=nnx.Rngs(0))

    def __call__(self, ids, out_sharding=None) -> jax.Array:
        ids = self._check_ids(ids)
        out = lookup_8bit(self.weight.get_value(), self.SCB.get_value(), ids, num_embeddings=self.num_embeddings)
        return out_sharded(out.astype(self.dtype), out_sharding)

    def attend(self, query, out_sharding=None) -> jax.Array:
        """query [..., features] . (CB * SCB / 127)^T -> [..., num_embeddings] in ``dtype``."""
        y = matmul_8bit(self._check_query(query), self.weight.get_value(), self.SCB.get_value(), None, 0.0)
        return out_sharded(y, out_sharding)

    def _state_entries(self) -> dict[str, np.ndarray]:
        return int8_entries(_host_copy(self.weight.get_value()), _host_copy(self.SCB.get_value()))

    def _plan_load(self, d: dict, prefix: str, errs: list[str], used: set[str]) -> Callable[[], None] | None:
        shape = (self.num_embeddings, self.features)
        found = plan_int8_load(d, prefix, shape, "the table", errs, used)
        if found is None:
            return None
        w, scb = found
        if scb is not None:
            cb_dev, scb_dev = _device_copy(w), _device_copy(scb, np.float32)

            def apply() -> None:
                self.weight.set_value(cb_dev)
                self.SCB.set_value(scb_dev)

            return apply
        table = _host_copy(w)

        def apply_float() -> None:
            self.set_weight(table)

        return apply_float


class StableEmbedding(_Embedding):
    """bitsandbytes' StableEmbedding in nnx style: a trainable table (Xavier
    uniform init) whose lookups go through a LayerNorm (epsilon 1e-5, two-pass
    variance, computed in fp32) and come back in ``dtype`` (default the table's).
    Checkpoint keys as q4torch's: ``weight``, ``norm.weight``, ``norm.bias``.

    Equal to q4torch's for the same checkpoint up to the LayerNorm's
    summation order (the two frameworks reduce in different orders): within
    a few fp32 ulp, not bit for bit.
    """

    def __init__(
        self,
        num_embeddings: int,
        features: int,
        *,
        dtype=None,
        param_dtype=jnp.float32,
        embedding_init: Callable = _XAVIER_UNIFORM,
        rngs: nnx.Rngs,
    ):
        table = self._init_common(num_embeddings, features, dtype, param_dtype, embedding_init, rngs)
        self.embedding = nnx.Param(table)
        self.norm = nnx.LayerNorm(
            self.features, epsilon=1e-5, use_fast_variance=False, dtype=jnp.float32, param_dtype=jnp.float32, rngs=rngs
        )

    def __call__(self, ids, out_sharding=None) -> jax.Array:
        ids = self._check_ids(ids)
        rows, valid = _rows(ids, self.num_embeddings)
        emb = jnp.take(self.embedding.get_value(), rows, axis=0, mode="clip").astype(jnp.float32)
        emb = jnp.where(valid[:, None], emb, jnp.nan).reshape(*ids.shape, self.features)
        return out_sharded(self.norm(emb).astype(self.dtype), out_sharding)

    def _variables(self) -> dict[str, tuple[tuple[int, ...], nnx.Param]]:
        """Checkpoint key -> (shape, variable); the LayerNorm has its scale and bias."""
        scale, bias = self.norm.scale, self.norm.bias
        assert scale is not None and bias is not None  # use_scale, use_bias
        return {
            "weight": ((self.num_embeddings, self.features), self.embedding),
            "norm.weight": ((self.features,), scale),
            "norm.bias": ((self.features,), bias),
        }

    def _state_entries(self) -> dict[str, np.ndarray]:
        return {key: _host_copy(var.get_value()) for key, (_, var) in self._variables().items()}

    def _plan_load(self, d: dict, prefix: str, errs: list[str], used: set[str]) -> Callable[[], None] | None:
        wanted = self._variables()
        new = []
        for name, (shape, var) in wanted.items():
            key = prefix + name
            if key not in d:
                errs.append(f"missing key '{key}'")
                continue
            used.add(key)
            a = np.asarray(d[key])
            if a.dtype.name not in FLOAT_DTYPES or a.shape != shape:
                errs.append(f"'{key}' must be a float array of shape {shape}, got {a.dtype} {a.shape}")
                continue
            new.append((var, _device_copy(a, var.get_value().dtype)))
        if len(new) < len(wanted):
            return None

        def apply() -> None:
            for var, value in new:
                var.set_value(value)

        return apply


EMBEDDING_TYPES = (Embedding4bit, Embedding8bit, StableEmbedding)
