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


def search_scales_4bit(blocks: np.ndarray, quant_type: str = "nf4") -> np.ndarray:
    """The 'mse' scale (float32 [nb]) of each row of fp32 ``blocks`` [nb, bs]
    (kernels: search_scales_4bit in q4/kernels.h)."""
    x = np.ascontiguousarray(blocks, np.float32)
    if x.ndim != 2:
        raise ValueError(f"blocks must be 2-D [n_blocks, blocksize], got shape {x.shape}")
    bs, qt = formats.check_blocksize(x.shape[1]), formats.check_quant_type(quant_type)
    out = np.empty(x.shape[0], np.float32)
    if not x.shape[0]:
        return out
    native.check(native.lib().q4_search_scales_4bit(x.ctypes.data, x.shape[0], bs, qt, out.ctypes.data))
    return out


def encode_4bit(blocks: np.ndarray, scales: np.ndarray, quant_type: str = "nf4") -> np.ndarray:
    """Packed nibbles (uint8 [nb * bs / 2]) of fp32 ``blocks`` [nb, bs] with
    the given per-block ``scales`` [nb] (kernels: encode_4bit in q4/kernels.h)."""
    x = np.ascontiguousarray(blocks, np.float32)
    s = np.ascontiguousarray(scales, np.float32).reshape(-1)
    if x.ndim != 2 or s.shape[0] != x.shape[0]:
        raise ValueError(f"blocks [n_blocks, blocksize] and scales [n_blocks], got {x.shape} and {s.shape}")
    bs, qt = formats.check_blocksize(x.shape[1]), formats.check_quant_type(quant_type)
    out = np.empty(x.size // 2, np.uint8)
    if not x.shape[0]:
        return out
    native.check(native.lib().q4_encode_4bit(x.ctypes.data, x.shape[0], bs, qt, s.ctypes.data, out.ctypes.data))
    return out


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
    formats.check_packed_size(packed.size, n, "packed", f"shape {shape}")
    if absmax.size != formats.num_blocks(n, bs):
        raise ValueError(
            f"absmax has {absmax.size} values, shape {shape} with blocksize {bs} needs {formats.num_blocks(n, bs)}"
        )
    name = dtype_name(_np_dtype(np.dtype(dtype).name) if not isinstance(dtype, str) else _np_dtype(dtype))
    out = np.empty(shape, _np_dtype(name))
    dequantize_4bit_ptr(packed.ctypes.data, absmax.ctypes.data, n, bs, qt, out.ctypes.data, formats.DTYPE_CODES[name])
    return out


def _code_book(code) -> np.ndarray | None:
    """An 8-bit code book as the kernels read it: 256 contiguous fp32 values
    (None: the dynamic map). The kernels index all 256, so any other length is
    refused here, before a pointer is passed."""
    if code is None:
        return None
    arr = np.ascontiguousarray(code, np.float32)
    if arr.size != 256:
        raise ValueError(f"code must hold 256 values, got {arr.size} (shape {arr.shape})")
    return arr.reshape(256)


def quantize_blockwise(x: np.ndarray, blocksize: int = 4096, code: np.ndarray | None = None):
    """8-bit blockwise quantization (dynamic map by default): (codes uint8 like x, absmax float32)."""
    x = _input(x)
    bs = formats.check_blocksize8(blocksize)
    code_arr = _code_book(code)
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
    """8-bit blockwise codes back to floats: code[codes] * absmax[block] (+ offset), bitsandbytes' dequantize_blockwise."""
    bs = formats.check_blocksize8(blocksize)
    codes = np.ascontiguousarray(codes, np.uint8)
    absmax = np.ascontiguousarray(absmax, np.float32)
    if absmax.size != formats.num_blocks(codes.size, bs):
        raise ValueError(
            f"absmax has {absmax.size} values, {codes.size} codes with blocksize {bs} need {formats.num_blocks(codes.size, bs)}"
        )
    code_arr = _code_book(code)
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


# ------------------------------------------------------------ fused matmuls


def scales_args(absmax, nested_codes, nested_absmax, nested_absmax_size: int, nested_code, nested_offset, n_blocks):
    """The 7 C ABI arguments describing a 4-bit weight's scales (pointers or None)."""
    return (
        absmax,
        nested_codes,
        nested_absmax,
        nested_absmax_size,
        nested_code,
        0.0 if nested_offset is None else float(nested_offset),
        n_blocks,
    )


def gemm_4bit_ptr(
    x,
    x_dtype,
    m,
    n,
    k,
    packed,
    scales,
    blocksize,
    quant_type,
    bias,
    bias_dtype,
    out,
    out_dtype,
    stream=None,
    activation_quant: str | None = None,
) -> None:
    """gemm_4bit, or gemm_4bit_w4a8 with activation_quant='int8'."""
    _call(
        formats.ACTIVATION_QUANT_OPS[activation_quant],
        stream,
        x,
        x_dtype,
        m,
        n,
        k,
        packed,
        formats.packed_bytes(n * k),
        *scales,
        blocksize,
        quant_type,
        bias,
        bias_dtype,
        out,
        out_dtype,
    )


def gemm_4bit_grad_input_ptr(
    dy, dy_dtype, m, n, k, packed, scales, blocksize, quant_type, dx, dx_dtype, stream=None
) -> None:
    _call(
        "gemm_4bit_grad_input",
        stream,
        dy,
        dy_dtype,
        m,
        n,
        k,
        packed,
        formats.packed_bytes(n * k),
        *scales,
        blocksize,
        quant_type,
        dx,
        dx_dtype,
    )


def int8_quantize_rows_ptr(x, x_dtype, rows, cols, threshold, q, stats, outlier_cols, stream=None) -> None:
    _call("int8_quantize_rows", stream, x, x_dtype, rows, cols, float(threshold), q, stats, outlier_cols)


def int8_linear_ptr(
    x, x_dtype, m, n, k, weight, scale, threshold, bias, bias_dtype, out, out_dtype, stream=None
) -> None:
    _call("int8_linear", stream, x, x_dtype, m, n, k, weight, scale, float(threshold), bias, bias_dtype, out, out_dtype)


def int8_grad_input_ptr(dy, dy_dtype, m, n, k, weight, scale, dx, dx_dtype, stream=None) -> None:
    _call("int8_grad_input", stream, dy, dy_dtype, m, n, k, weight, scale, dx, dx_dtype)


def _state_scales(state) -> tuple:
    """C ABI scale arguments for a q4.QuantState (keeps the arrays alive in the tuple's owner)."""
    state.validate()
    if state.nested:
        codes = np.ascontiguousarray(state.absmax, np.uint8)
        absmax2 = np.ascontiguousarray(state.nested_absmax, np.float32)
        keep: tuple[np.ndarray, ...] = (codes, absmax2)
        args = scales_args(
            None, codes.ctypes.data, absmax2.ctypes.data, absmax2.size, None, state.nested_offset, codes.size
        )
    else:
        absmax = np.ascontiguousarray(state.absmax, np.float32)
        keep = (absmax,)
        args = scales_args(absmax.ctypes.data, None, None, 0, None, None, absmax.size)
    return args, keep


def _matrix(a, what: str) -> np.ndarray:
    a = np.ascontiguousarray(a)
    dtype_name(a.dtype)
    if a.ndim != 2 or a.size == 0:
        raise ValueError(f"{what} must be a non-empty 2-D array, got shape {a.shape}")
    return a


def gemm_4bit(
    x: np.ndarray,
    packed: np.ndarray,
    state,
    bias: np.ndarray | None = None,
    out_dtype=None,
    activation_quant: str | None = None,
) -> np.ndarray:
    """Y = x @ dequantize(W).T (+ bias) without materialising W; W's shape is state.shape = (n, k).

    Accumulates in fp32; the result has x's dtype unless out_dtype is given.
    activation_quant='int8': W4A8 (x quantized to int8 per row in blocks of
    min(64, blocksize), integer dot products; README "W4A8").
    """
    formats.check_activation_quant(activation_quant)
    x = _matrix(x, "x")
    n, k = _weight_shape(state)
    if x.shape[1] != k:
        raise ValueError(f"x has {x.shape[1]} features, the weight expects {k} (weight shape {(n, k)})")
    if activation_quant is not None:
        formats.check_w4a8_features(k, state.blocksize)
    packed = _packed(packed, n * k)
    args, keep = _state_scales(state)
    name = _out_name(x.dtype, out_dtype)
    out = np.empty((x.shape[0], n), _np_dtype(name))
    bias, b, bcode = _bias_arg(bias, n)
    gemm_4bit_ptr(
        x.ctypes.data,
        formats.DTYPE_CODES[dtype_name(x.dtype)],
        x.shape[0],
        n,
        k,
        packed.ctypes.data,
        args,
        state.blocksize,
        formats.QUANT_TYPE_CODES[state.quant_type],
        b,
        bcode,
        out.ctypes.data,
        formats.check_dtype_name(name),
        activation_quant=activation_quant,
    )
    del keep
    return out


def gemm_4bit_grad_input(grad_out: np.ndarray, packed: np.ndarray, state, out_dtype=None) -> np.ndarray:
    """dX = grad_out @ dequantize(W), without materialising W."""
    dy = _matrix(grad_out, "grad_out")
    n, k = _weight_shape(state)
    if dy.shape[1] != n:
        raise ValueError(f"grad_out has {dy.shape[1]} features, the weight has {n} outputs (shape {(n, k)})")
    packed = _packed(packed, n * k)
    args, keep = _state_scales(state)
    name = _out_name(dy.dtype, out_dtype)
    out = np.empty((dy.shape[0], k), _np_dtype(name))
    gemm_4bit_grad_input_ptr(
        dy.ctypes.data,
        formats.DTYPE_CODES[dtype_name(dy.dtype)],
        dy.shape[0],
        n,
        k,
        packed.ctypes.data,
        args,
        state.blocksize,
        formats.QUANT_TYPE_CODES[state.quant_type],
        out.ctypes.data,
        formats.check_dtype_name(name),
    )
    del keep
    return out


def _bias_arg(bias, n: int):
    """(contiguous bias kept alive, pointer or None, dtype code) for a length-n bias."""
    if bias is None:
        return None, None, 0
    bias = np.ascontiguousarray(bias)
    if bias.shape != (n,):
        raise ValueError(f"bias must have shape ({n},), got {bias.shape}")
    return bias, bias.ctypes.data, formats.DTYPE_CODES[dtype_name(bias.dtype)]


def _out_name(default_dtype, out_dtype) -> str:
    """The result dtype's name: out_dtype if given, else the input's."""
    if out_dtype is None:
        return dtype_name(default_dtype)
    return out_dtype if isinstance(out_dtype, str) else np.dtype(out_dtype).name


def _weight_shape(state) -> tuple[int, int]:
    if len(state.shape) != 2:
        raise ValueError(f"a matmul weight must be 2-D (n, k), got shape {tuple(state.shape)}")
    return int(state.shape[0]), int(state.shape[1])


def _packed(packed, n_elements: int) -> np.ndarray:
    packed = np.ascontiguousarray(packed)
    if packed.dtype != np.uint8:
        packed = packed.view(np.uint8)
    formats.check_packed_size(packed.size, n_elements, "packed weight", f"a weight of {n_elements} elements")
    return packed


def int8_quantize_rows(x: np.ndarray, threshold: float = 0.0):
    """LLM.int8 row-wise quantization: (q int8 like x, row_stats f32 [rows], outlier_cols bool [cols])."""
    x = _matrix(x, "x")
    q = np.empty(x.shape, np.int8)
    stats = np.empty(x.shape[0], np.float32)
    cols = np.empty(x.shape[1], np.uint8)
    int8_quantize_rows_ptr(
        x.ctypes.data,
        formats.DTYPE_CODES[dtype_name(x.dtype)],
        x.shape[0],
        x.shape[1],
        threshold,
        q.ctypes.data,
        stats.ctypes.data,
        cols.ctypes.data,
    )
    return q, stats, cols.astype(bool)


def _int8_weight(weight, weight_scale):
    weight = np.ascontiguousarray(weight)
    if weight.dtype != np.int8 or weight.ndim != 2:
        raise TypeError(f"weight must be a 2-D int8 array, got {weight.dtype} {weight.shape}")
    scale = np.ascontiguousarray(weight_scale, np.float32)
    if scale.shape != (weight.shape[0],):
        raise ValueError(f"weight_scale must have shape ({weight.shape[0]},), got {scale.shape}")
    return weight, scale


def int8_linear(x, weight, weight_scale, threshold: float = 0.0, bias=None, out_dtype=None) -> np.ndarray:
    """LLM.int8 linear: Y ~= x @ (weight * weight_scale[:, None] / 127).T (+ bias); see Int8LinearParams."""
    x = _matrix(x, "x")
    weight, scale = _int8_weight(weight, weight_scale)
    n, k = weight.shape
    if x.shape[1] != k:
        raise ValueError(f"x has {x.shape[1]} features, the weight expects {k}")
    name = _out_name(x.dtype, out_dtype)
    out = np.empty((x.shape[0], n), _np_dtype(name))
    bias, b, bcode = _bias_arg(bias, n)
    int8_linear_ptr(
        x.ctypes.data,
        formats.DTYPE_CODES[dtype_name(x.dtype)],
        x.shape[0],
        n,
        k,
        weight.ctypes.data,
        scale.ctypes.data,
        threshold,
        b,
        bcode,
        out.ctypes.data,
        formats.check_dtype_name(name),
    )
    return out


def int8_grad_input(grad_out, weight, weight_scale, out_dtype=None) -> np.ndarray:
    """dX = grad_out @ (weight * weight_scale[:, None] / 127), fp32 accumulation."""
    dy = _matrix(grad_out, "grad_out")
    weight, scale = _int8_weight(weight, weight_scale)
    n, k = weight.shape
    if dy.shape[1] != n:
        raise ValueError(f"grad_out has {dy.shape[1]} features, the weight has {n} outputs")
    name = _out_name(dy.dtype, out_dtype)
    out = np.empty((dy.shape[0], k), _np_dtype(name))
    int8_grad_input_ptr(
        dy.ctypes.data,
        formats.DTYPE_CODES[dtype_name(dy.dtype)],
        dy.shape[0],
        n,
        k,
        weight.ctypes.data,
        scale.ctypes.data,
        out.ctypes.data,
        formats.check_dtype_name(name),
    )
    return out
