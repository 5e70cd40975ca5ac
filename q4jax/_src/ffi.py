"""The q4 kernels as XLA FFI custom calls (jax.ffi.ffi_call).

Targets are registered on first use from libq4's ``q4_ffi_*`` handlers (CPU,
and platform "CUDA" when the library has the CUDA kernels). Every call uses
vmap_method="broadcast_all": the handlers treat leading batch dimensions as
independent items, so vmap over inputs or stacked weights is one kernel call.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from q4._src import formats, native

_OPS = ("quantize_4bit", "dequantize_4bit", "quantize_blockwise", "dequantize_blockwise", "quantize_nested")
_DTYPES = {"float32": jnp.float32, "float16": jnp.float16, "bfloat16": jnp.bfloat16}


@functools.cache
def register() -> None:
    """Register the FFI targets with XLA (idempotent)."""
    lib = native.lib()
    for op in _OPS:
        try:
            handler = getattr(lib, "q4_ffi_" + op)
        except AttributeError as e:
            raise native.NativeLibraryError(
                f"{native.library_path()} has no XLA FFI handlers (built without jaxlib headers); "
                "rebuild q4 with jax installed"
            ) from e
        jax.ffi.register_ffi_target("q4_" + op, jax.ffi.pycapsule(handler), platform="cpu")
        if native.has_cuda():
            cuda_handler = getattr(lib, "q4_ffi_cuda_" + op)
            jax.ffi.register_ffi_target("q4_" + op, jax.ffi.pycapsule(cuda_handler), platform="CUDA")


def dtype_name(dtype) -> str:
    name = jnp.dtype(dtype).name
    if name not in _DTYPES:
        raise TypeError(f"expected float32, float16 or bfloat16, got {name}")
    return name


def _call(op: str, results, *args, **attrs):
    register()
    attrs = {k: np.int64(v) for k, v in attrs.items()}
    return jax.ffi.ffi_call("q4_" + op, results, vmap_method="broadcast_all")(*args, **attrs)


def quantize_4bit_raw(x: jax.Array, blocksize: int, quant_type: str):
    """x (any shape) -> (packed uint8 [ceil(n/2), 1], absmax f32 [n_blocks])."""
    n = x.size
    out = (
        jax.ShapeDtypeStruct((formats.packed_bytes(n), 1), jnp.uint8),
        jax.ShapeDtypeStruct((formats.num_blocks(n, blocksize),), jnp.float32),
    )
    return _call(
        "quantize_4bit",
        out,
        x.reshape(-1),
        n=n,
        blocksize=blocksize,
        quant_type=formats.QUANT_TYPE_CODES[quant_type],
    )


def dequantize_4bit_raw(packed, absmax, shape, dtype: str, blocksize: int, quant_type: str):
    n = int(np.prod(shape))
    out = jax.ShapeDtypeStruct((n,), _DTYPES[dtype])
    flat = _call(
        "dequantize_4bit",
        out,
        packed.reshape(-1),
        absmax,
        n=n,
        blocksize=blocksize,
        quant_type=formats.QUANT_TYPE_CODES[quant_type],
    )
    return flat.reshape(shape)


def quantize_blockwise_raw(x, code, blocksize: int):
    n = x.size
    out = (
        jax.ShapeDtypeStruct((n,), jnp.uint8),
        jax.ShapeDtypeStruct((formats.num_blocks(n, blocksize),), jnp.float32),
    )
    codes, absmax = _call("quantize_blockwise", out, x.reshape(-1), code, n=n, blocksize=blocksize)
    return codes.reshape(x.shape), absmax


def dequantize_blockwise_raw(codes, absmax, code, offset, blocksize: int, dtype: str):
    n = codes.size
    out = jax.ShapeDtypeStruct((n,), _DTYPES[dtype])
    add = offset is not None
    off = jnp.zeros((1,), jnp.float32) if offset is None else jnp.reshape(offset, (1,)).astype(jnp.float32)
    flat = _call(
        "dequantize_blockwise",
        out,
        codes.reshape(-1),
        absmax,
        code,
        off,
        n=n,
        blocksize=blocksize,
        add_offset=int(add),
    )
    return flat.reshape(codes.shape)


def quantize_nested_raw(absmax):
    n = absmax.size
    out = (
        jax.ShapeDtypeStruct((n,), jnp.uint8),
        jax.ShapeDtypeStruct((formats.num_blocks(n, formats.nested_blocksize()),), jnp.float32),
        jax.ShapeDtypeStruct((1,), jnp.float32),
    )
    codes, absmax2, offset = _call("quantize_nested", out, absmax.reshape(-1), n_blocks=n)
    return codes, absmax2, offset.reshape(())
