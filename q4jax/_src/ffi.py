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

_DTYPES = {"float32": jnp.float32, "float16": jnp.float16, "bfloat16": jnp.bfloat16}


@functools.cache
def register() -> None:
    """Register the FFI targets with XLA (idempotent)."""
    lib = native.lib()
    for op in native.op_names():
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


def _call(op: str, results, *args, vmap_method: str | None = "broadcast_all", **attrs):
    register()
    attrs = {k: np.float32(v) if isinstance(v, float) else np.int64(v) for k, v in attrs.items()}
    return jax.ffi.ffi_call("q4_" + op, results, vmap_method=vmap_method)(*args, **attrs)


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


# ------------------------------------------------------------ fused matmuls
# Weight operands: packed uint8, absmax (f32, or uint8 codes when nested),
# nested_absmax f32 and nested_offset f32 [1] (empty arrays when plain). The
# handler treats every leading dim of x as rows, and a stacked weight (leading
# batch on the weight operands) as one matmul per item.

_EMPTY = np.zeros((0,), np.float32)


def weight_operands(absmax, nested_absmax, nested_offset):
    if nested_absmax is None:
        return absmax, jnp.asarray(_EMPTY), jnp.asarray(_EMPTY)
    return absmax, nested_absmax, jnp.reshape(nested_offset, nested_offset.shape + (1,))


@functools.cache
def _gemm_fn(op: str, n: int, k: int, blocksize: int, quant_type: str, nested: bool, out_dim: int, out_dtype: str):
    attrs = dict(n=n, k=k, blocksize=blocksize, quant_type=formats.QUANT_TYPE_CODES[quant_type], nested=int(nested))
    return _matmul_fn(op, tuple(sorted(attrs.items())), out_dim, out_dtype)


@functools.cache
def _matmul_fn(op: str, attr_items: tuple, out_dim: int, out_dtype: str):
    """The FFI call of a fused matmul for one static configuration, with a
    batching rule: batch dims of x alone become extra rows (one pass over the
    shared weight); a batch over the weight operands runs one matmul per
    stacked weight."""
    attrs = dict(attr_items)

    @jax.custom_batching.custom_vmap
    def call(x, *weights):
        # weights: the weight operands (then the bias, empty when absent, for a forward)
        out = jax.ShapeDtypeStruct(x.shape[:-1] + (out_dim,), jnp.dtype(out_dtype))
        return _call(op, out, x, *weights, vmap_method=None, **attrs)

    @call.def_vmap
    def _rule(axis_size, in_batched, x, *weights):
        x_batched, *weights_batched = in_batched
        if not any(weights_batched):
            return call(x, *weights), True
        args = [
            a if b else jnp.broadcast_to(a, (axis_size,) + a.shape)
            for a, b in zip((x, *weights), in_batched, strict=True)
        ]
        return call(*args), True

    return call


def gemm_4bit_raw(
    x, packed, absmax, nested_absmax, nested_offset, bias, n, k, blocksize, quant_type, out_dtype, activation_quant=None
):
    """y[..., n] = x[..., k] . dequantize(W)^T (+ bias), W [n, k] never materialised
    (activation_quant='int8': the W4A8 kernel, gemm_4bit_w4a8)."""
    a, na, no = weight_operands(absmax, nested_absmax, nested_offset)
    op = formats.ACTIVATION_QUANT_OPS[activation_quant]
    fn = _gemm_fn(op, n, k, blocksize, quant_type, nested_absmax is not None, n, dtype_name(out_dtype))
    return fn(x, packed, a, na, no, jnp.asarray(_EMPTY) if bias is None else bias)


def gemm_4bit_grad_input_raw(
    grad_out, packed, absmax, nested_absmax, nested_offset, n, k, blocksize, quant_type, out_dtype
):
    """dx[..., k] = grad_out[..., n] . dequantize(W)."""
    a, na, no = weight_operands(absmax, nested_absmax, nested_offset)
    fn = _gemm_fn(
        "gemm_4bit_grad_input", n, k, blocksize, quant_type, nested_absmax is not None, k, dtype_name(out_dtype)
    )
    return fn(grad_out, packed, a, na, no)


def int8_quantize_rows_raw(x):
    """LLM.int8 rows without outliers: x [..., cols] -> (q int8 [..., cols], row absmax f32 [...])."""
    out = (jax.ShapeDtypeStruct(x.shape, jnp.int8), jax.ShapeDtypeStruct(x.shape[:-1], jnp.float32))
    return _call("int8_quantize_rows", out, x, cols=x.shape[-1])


def int8_linear_raw(x, weight, scale, bias, threshold: float, out_dtype):
    """LLM.int8 linear: y[..., n] ~= x[..., k] . (CB * SCB / 127)^T (+ bias)."""
    n, k = weight.shape[-2], weight.shape[-1]
    fn = _matmul_fn("int8_linear", (("k", k), ("n", n), ("threshold", float(threshold))), n, dtype_name(out_dtype))
    return fn(x, weight, scale, jnp.asarray(_EMPTY) if bias is None else bias)


def int8_grad_input_raw(grad_out, weight, scale, out_dtype):
    """dx[..., k] = grad_out[..., n] . (CB * SCB / 127)."""
    n, k = weight.shape[-2], weight.shape[-1]
    fn = _matmul_fn("int8_grad_input", (("k", k), ("n", n)), k, dtype_name(out_dtype))
    return fn(grad_out, weight, scale)
