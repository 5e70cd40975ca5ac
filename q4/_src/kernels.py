"""Pointer-level calls into the CPU kernels, plus numpy conveniences.

The pointer functions are what the front ends use (torch passes data_ptr()s);
every size is explicit and checked by the library before memory is touched.
"""

from __future__ import annotations

import numpy as np

from q4._src import formats, native


def _call(name: str, stream, *args) -> None:
    """CPU kernel when stream is None, else the CUDA kernel on that stream."""
    if stream is None:
        native.check(getattr(native.lib(), "q4_" + name)(*args))
    elif not native.has_cuda():
        raise native.NativeLibraryError(
            f"{native.library_path()} was built without the CUDA kernels; rebuild q4 where nvcc is available"
        )
    else:
        native.check_cuda(getattr(native.lib(), "q4_cuda_" + name)(*args, stream))


def quantize_4bit_ptr(x, x_dtype: int, n: int, blocksize: int, quant_type: int, packed, absmax, stream=None) -> None:
    _call(
        "quantize_4bit",
        stream,
        x,
        x_dtype,
        n,
        blocksize,
        quant_type,
        packed,
        formats.packed_bytes(n),
        absmax,
        formats.num_blocks(n, blocksize),
    )


def dequantize_4bit_ptr(
    packed, absmax, n: int, blocksize: int, quant_type: int, out, out_dtype: int, stream=None
) -> None:
    _call(
        "dequantize_4bit",
        stream,
        packed,
        formats.packed_bytes(n),
        absmax,
        formats.num_blocks(n, blocksize),
        n,
        blocksize,
        quant_type,
        out,
        out_dtype,
    )


def quantize_blockwise_ptr(x, x_dtype: int, n: int, blocksize: int, code, codes, absmax, stream=None) -> None:
    _call(
        "quantize_blockwise",
        stream,
        x,
        x_dtype,
        n,
        blocksize,
        code,
        codes,
        n,
        absmax,
        formats.num_blocks(n, blocksize),
    )


def dequantize_blockwise_ptr(
    codes, n: int, absmax, blocksize: int, code, offset, out, out_dtype: int, stream=None
) -> None:
    """offset None: out = code[q]*absmax; else fp32(code[q]*absmax) + offset."""
    _call(
        "dequantize_blockwise",
        stream,
        codes,
        n,
        absmax,
        formats.num_blocks(n, blocksize),
        blocksize,
        code,
        0 if offset is None else 1,
        0.0 if offset is None else float(offset),
        out,
        out_dtype,
    )


def quantize_nested_ptr(absmax, n_blocks: int, codes, absmax2, offset, stream=None) -> None:
    _call(
        "quantize_nested",
        stream,
        absmax,
        n_blocks,
        codes,
        absmax2,
        formats.num_blocks(n_blocks, formats.nested_blocksize()),
        offset,
    )


# ---------------------------------------------------------------- numpy API


def dtype_name(dtype) -> str:
    """'float32' / 'float16' / 'bfloat16' for a numpy (or ml_dtypes) dtype."""
    name = np.dtype(dtype).name
    if name not in formats.DTYPE_CODES:
        raise TypeError(f"expected a float32, float16 or bfloat16 array, got dtype {name}")
    return name


def _np_dtype(name: str):
    if name == "bfloat16":
        import ml_dtypes

        return ml_dtypes.bfloat16
    return np.dtype(name)


def _input(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x)
    dtype_name(x.dtype)
    if x.size == 0:
        raise ValueError(f"cannot quantize an empty array (shape {x.shape})")
    return np.ascontiguousarray(x)


def quantize_4bit(x: np.ndarray, blocksize: int = 64, quant_type: str = "nf4") -> tuple[np.ndarray, np.ndarray]:
    """Blockwise 4-bit quantization of the flattened array.

    Returns (packed uint8 [ceil(n/2), 1], absmax float32 [ceil(n/blocksize)]).
    """
    x = _input(x)
    bs, qt = formats.check_blocksize(blocksize), formats.check_quant_type(quant_type)
    n = x.size
    packed = np.empty((formats.packed_bytes(n), 1), np.uint8)
    absmax = np.empty(formats.num_blocks(n, bs), np.float32)
    quantize_4bit_ptr(
        x.ctypes.data, formats.DTYPE_CODES[dtype_name(x.dtype)], n, bs, qt, packed.ctypes.data, absmax.ctypes.data
    )
    return packed, absmax


def dequantize_4bit(
    packed: np.ndarray, absmax: np.ndarray, shape, blocksize: int = 64, quant_type: str = "nf4", dtype="float32"
) -> np.ndarray:
    """Inverse of quantize_4bit: decode(nibble) * absmax[block], rounded to dtype."""
    bs, qt = formats.check_blocksize(blocksize), formats.check_quant_type(quant_type)
    shape = tuple(int(s) for s in shape)
    n = int(np.prod(shape))
    packed = np.ascontiguousarray(packed, np.uint8)
    absmax = np.ascontiguousarray(absmax, np.float32)
    if packed.size != formats.packed_bytes(n):
        raise ValueError(f"packed has {packed.size} bytes, shape {shape} needs {formats.packed_bytes(n)}")
    if absmax.size != formats.num_blocks(n, bs):
        raise ValueError(
            f"absmax has {absmax.size} values, shape {shape} with blocksize {bs} needs {formats.num_blocks(n, bs)}"
        )
    name = dtype_name(_np_dtype(np.dtype(dtype).name) if not isinstance(dtype, str) else _np_dtype(dtype))
    out = np.empty(shape, _np_dtype(name))
    dequantize_4bit_ptr(packed.ctypes.data, absmax.ctypes.data, n, bs, qt, out.ctypes.data, formats.DTYPE_CODES[name])
    return out


def quantize_blockwise(x: np.ndarray, blocksize: int = 4096, code: np.ndarray | None = None):
    """8-bit blockwise quantization (dynamic map by default): (codes uint8 like x, absmax float32)."""
    x = _input(x)
    bs = formats.check_blocksize(blocksize)
    code_arr = None if code is None else np.ascontiguousarray(code, np.float32)
    if code_arr is not None and code_arr.size != 256:
        raise ValueError(f"code must hold 256 values, got {code_arr.size}")
    codes = np.empty(x.shape, np.uint8)
    absmax = np.empty(formats.num_blocks(x.size, bs), np.float32)
    quantize_blockwise_ptr(
        x.ctypes.data,
        formats.DTYPE_CODES[dtype_name(x.dtype)],
        x.size,
        bs,
        None if code_arr is None else code_arr.ctypes.data,
        codes.ctypes.data,
        absmax.ctypes.data,
    )
    return codes, absmax


def dequantize_blockwise(codes, absmax, blocksize: int = 4096, code=None, offset=None, dtype="float32"):
    bs = formats.check_blocksize(blocksize)
    codes = np.ascontiguousarray(codes, np.uint8)
    absmax = np.ascontiguousarray(absmax, np.float32)
    if absmax.size != formats.num_blocks(codes.size, bs):
        raise ValueError(
            f"absmax has {absmax.size} values, {codes.size} codes with blocksize {bs} need {formats.num_blocks(codes.size, bs)}"
        )
    code_arr = None if code is None else np.ascontiguousarray(code, np.float32)
    name = dtype if isinstance(dtype, str) else np.dtype(dtype).name
    out = np.empty(codes.shape, _np_dtype(name))
    dequantize_blockwise_ptr(
        codes.ctypes.data,
        codes.size,
        absmax.ctypes.data,
        bs,
        None if code_arr is None else code_arr.ctypes.data,
        offset,
        out.ctypes.data,
        formats.check_dtype_name(name),
    )
    return out


def quantize_nested(absmax: np.ndarray):
    """Nested quantization of a 4-bit absmax vector: (codes uint8, absmax2 float32, offset float32)."""
    absmax = np.ascontiguousarray(absmax, np.float32).reshape(-1)
    if absmax.size == 0:
        raise ValueError("cannot quantize an empty absmax")
    codes = np.empty(absmax.size, np.uint8)
    absmax2 = np.empty(formats.num_blocks(absmax.size, formats.nested_blocksize()), np.float32)
    offset = np.empty(1, np.float32)
    quantize_nested_ptr(absmax.ctypes.data, absmax.size, codes.ctypes.data, absmax2.ctypes.data, offset.ctypes.data)
    return codes, absmax2, offset[0]
