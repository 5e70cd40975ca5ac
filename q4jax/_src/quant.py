"""Pure functions: 4-bit and 8-bit blockwise quantization over jax arrays.

Bytes are identical to q4torch's (and, for the 4-bit formats, to
bitsandbytes') for the same input: both call the same kernels.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from q4._src import formats
from q4._src.quant_state import QuantState as NpQuantState
from q4._src.weights import check_int8_scales
from q4jax._src import ffi


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=["absmax", "nested_absmax", "nested_offset"],
    meta_fields=["quant_type", "blocksize", "shape", "dtype"],
)
@dataclasses.dataclass(frozen=True)
class QuantState:
    """State of a packed 4-bit array (a pytree: arrays are leaves, the rest static).

    absmax: f32 [n_blocks], or uint8 codes [n_blocks] of (absmax - offset)
    when nested; nested_absmax: f32 [ceil(n_blocks/256)]; nested_offset: f32
    scalar. shape/dtype are those dequantize_4bit returns.
    """

    absmax: jax.Array
    nested_absmax: jax.Array | None
    nested_offset: jax.Array | None
    quant_type: str
    blocksize: int
    shape: tuple[int, ...]
    dtype: str

    @property
    def nested(self) -> bool:
        return self.nested_absmax is not None

    def to_numpy(self) -> NpQuantState:
        """The framework-neutral state (validated); not traceable."""
        return NpQuantState(
            quant_type=self.quant_type,
            blocksize=self.blocksize,
            shape=tuple(self.shape),
            dtype=self.dtype,
            absmax=np.asarray(self.absmax),
            nested_absmax=None if self.nested_absmax is None else np.asarray(self.nested_absmax),
            nested_offset=None if self.nested_offset is None else float(np.asarray(self.nested_offset)),
        ).validate()

    @classmethod
    def from_numpy(cls, st: NpQuantState) -> QuantState:
        st.validate()
        return cls(
            absmax=jnp.asarray(st.absmax),
            nested_absmax=None if st.nested_absmax is None else jnp.asarray(st.nested_absmax),
            nested_offset=None if st.nested_offset is None else jnp.asarray(st.nested_offset, jnp.float32),
            quant_type=st.quant_type,
            blocksize=st.blocksize,
            shape=tuple(st.shape),
            dtype=st.dtype,
        )


def _check_input(x) -> None:
    ffi.dtype_name(x.dtype)
    if x.size == 0:
        raise ValueError(f"cannot quantize an empty array (shape {tuple(x.shape)})")


@functools.partial(jax.jit, static_argnames=("blocksize", "quant_type", "compress_statistics"))
def quantize_4bit(
    x: jax.Array, blocksize: int = 64, quant_type: str = "nf4", compress_statistics: bool = False
) -> tuple[jax.Array, QuantState]:
    """Blockwise 4-bit quantization of x flattened (row-major).

    Returns (packed uint8 [ceil(n/2), 1], QuantState). compress_statistics
    quantizes the absmax with the 8-bit dynamic map in blocks of 256 after
    subtracting its mean (nested). Works under jit and vmap.
    """
    _check_input(x)
    bs, _ = formats.check_blocksize(blocksize), formats.check_quant_type(quant_type)
    packed, absmax = ffi.quantize_4bit_raw(x, bs, quant_type)
    nested_absmax = nested_offset = None
    if compress_statistics:
        absmax, nested_absmax, nested_offset = ffi.quantize_nested_raw(absmax)
    state = QuantState(absmax, nested_absmax, nested_offset, quant_type, bs, tuple(x.shape), ffi.dtype_name(x.dtype))
    return packed, state


def state_absmax(state: QuantState) -> jax.Array:
    """The fp32 per-block absmax (decoding a nested state: code[q]*absmax2 + offset)."""
    if not state.nested:
        return state.absmax
    code = jnp.asarray(formats.code_table("dynamic"))
    return ffi.dequantize_blockwise_raw(
        state.absmax, state.nested_absmax, code, state.nested_offset, formats.nested_blocksize(), "float32"
    )


def check_state(packed, state: QuantState) -> None:
    """The one check of a packed 4-bit weight and its state, at trace time
    (every function taking a QuantState calls it): quant_type, blocksize,
    dtype and shape are valid; packed is uint8 with ceil(n/2) bytes; absmax
    holds ceil(n/blocksize) values (f32, or uint8 codes when nested); a nested
    state has ceil(n_blocks/256) f32 nested_absmax and one f32 offset.
    Raises TypeError / ValueError naming the bad value."""
    if not isinstance(state, QuantState):
        raise TypeError(f"state must be a q4jax.QuantState, got {type(state).__name__}")
    formats.check_quant_type(state.quant_type)
    formats.check_blocksize(state.blocksize)
    formats.check_dtype_name(state.dtype)
    shape = state.shape
    if (
        not isinstance(shape, tuple)
        or not shape
        or not all(isinstance(s, (int, np.integer)) and not isinstance(s, bool) and s > 0 for s in shape)
    ):
        raise ValueError(f"state.shape must be a non-empty tuple of positive ints, got {shape!r}")
    n = math.prod(int(s) for s in shape)
    if packed.dtype != jnp.uint8:
        raise TypeError(f"packed must be uint8, got {packed.dtype}")
    formats.check_packed_size(packed.size, n, "packed", f"shape {shape}")
    nb = formats.num_blocks(n, state.blocksize)
    if state.absmax.size != nb:
        raise ValueError(
            f"absmax has {state.absmax.size} values, shape {shape} with blocksize {state.blocksize} needs {nb}"
        )
    want = jnp.uint8 if state.nested else jnp.float32
    if state.absmax.dtype != want:
        raise TypeError(
            f"absmax must be {jnp.dtype(want).name}{' (nested codes)' if state.nested else ''}, "
            f"got {state.absmax.dtype}"
        )
    if state.nested:
        n2 = formats.num_blocks(nb, formats.nested_blocksize())
        na: Any = state.nested_absmax
        if na.size != n2 or na.dtype != jnp.float32:
            raise ValueError(f"nested_absmax must be float32[{n2}], got {na.dtype}[{na.size}]")
        off = state.nested_offset
        if off is None or jnp.size(off) != 1 or jnp.asarray(off).dtype != jnp.float32:
            raise ValueError(
                "a nested state needs nested_offset, one float32 value, got "
                + ("None" if off is None else f"{jnp.asarray(off).dtype}{tuple(jnp.shape(off))}")
            )
    elif state.nested_offset is not None:
        raise ValueError("nested_offset is set but nested_absmax is None (a plain state has neither)")


@jax.jit
def dequantize_4bit(packed: jax.Array, state: QuantState) -> jax.Array:
    """decode(nibble) * absmax[block] in fp32, rounded to state.dtype, shaped state.shape."""
    check_state(packed, state)
    return ffi.dequantize_4bit_raw(
        packed, state_absmax(state), state.shape, state.dtype, state.blocksize, state.quant_type
    )


@functools.partial(jax.jit, static_argnames=("blocksize",))
def quantize_blockwise(x: jax.Array, blocksize: int = 4096, code: jax.Array | None = None):
    """8-bit blockwise quantization (dynamic map by default): (codes uint8 like x, absmax f32)."""
    _check_input(x)
    bs = formats.check_blocksize8(blocksize)
    code = jnp.asarray(formats.code_table("dynamic")) if code is None else jnp.asarray(code, jnp.float32)
    if code.shape[-1:] != (256,):
        raise ValueError(f"code must hold 256 values, got shape {code.shape}")
    return ffi.quantize_blockwise_raw(x, code, bs)


@functools.partial(jax.jit, static_argnames=("blocksize", "dtype"))
def dequantize_blockwise(codes, absmax, blocksize: int = 4096, code=None, dtype: str = "float32"):
    """code[codes] * absmax[block], rounded to dtype."""
    bs = formats.check_blocksize8(blocksize)
    if codes.dtype != jnp.uint8:
        raise TypeError(f"codes must be uint8, got {codes.dtype}")
    nb = formats.num_blocks(codes.size, bs)
    if absmax.size != nb:
        raise ValueError(f"absmax has {absmax.size} values, {codes.size} codes with blocksize {bs} need {nb}")
    code = jnp.asarray(formats.code_table("dynamic")) if code is None else jnp.asarray(code, jnp.float32)
    if code.shape[-1:] != (256,):
        raise ValueError(f"code must hold 256 values, got shape {code.shape}")
    return ffi.dequantize_blockwise_raw(codes, absmax, code, None, bs, ffi.dtype_name(dtype))


def quantize_int8_weight(w: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(CB int8 [out, in], SCB fp32 [out]) of a 2-D float weight as a
    bitsandbytes Linear8bitLt stores it: rounded to float16 first, then one
    absmax per row (the kernels' int8_quantize_rows, threshold 0). Works under
    jit. Outside a trace a row that is not finite after the float16 rounding
    (|w| > 65504) raises ValueError; under jit its SCB is inf."""
    w16 = w.astype(jnp.float32).astype(jnp.float16)
    cb, scb = ffi.int8_quantize_rows_raw(w16)
    if not isinstance(scb, jax.core.Tracer):
        check_int8_scales(scb)
    return cb, scb
