"""torch.library custom ops over the q4 kernels (CPU, and CUDA when built).

Each op is declared once with its schema and a fake (meta) implementation;
the device kernels hand raw pointers to the kernel library. Inputs are
validated here, at the boundary, with the offending value in the message.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from q4._src import formats
from q4._src import kernels as K

_DTYPE_CODE = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}


def dtype_code(dtype: torch.dtype, what: str) -> int:
    if dtype not in _DTYPE_CODE:
        raise TypeError(f"{what} must be float32, float16 or bfloat16, got {dtype}")
    return _DTYPE_CODE[dtype]


def _stream(t: torch.Tensor):
    return torch.cuda.current_stream(t.device).cuda_stream if t.device.type == "cuda" else None


def _nonempty(t: torch.Tensor, what: str) -> None:
    if t.numel() == 0:
        raise ValueError(f"cannot quantize an empty tensor ({what} has shape {tuple(t.shape)})")


def _u8(t: torch.Tensor, what: str) -> torch.Tensor:
    if t.dtype != torch.uint8:
        raise TypeError(f"{what} must be uint8, got {t.dtype}")
    return t.contiguous()


def _f32(t: torch.Tensor, what: str) -> torch.Tensor:
    if t.dtype != torch.float32:
        raise TypeError(f"{what} must be float32, got {t.dtype}")
    return t.contiguous()


# ------------------------------------------------------------------ 4-bit


@torch.library.custom_op("q4::quantize_4bit", mutates_args=(), device_types=("cpu", "cuda"))
def quantize_4bit(A: torch.Tensor, blocksize: int, quant_type: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Blockwise 4-bit quantization of A flattened: (packed uint8 [ceil(n/2), 1], absmax f32 [n_blocks])."""
    code = dtype_code(A.dtype, "quantize_4bit input")
    bs, qt = formats.check_blocksize(blocksize), formats.check_quant_type(quant_type)
    _nonempty(A, "input")
    A = A.contiguous()
    n = A.numel()
    packed = torch.empty((formats.packed_bytes(n), 1), dtype=torch.uint8, device=A.device)
    absmax = torch.empty(formats.num_blocks(n, bs), dtype=torch.float32, device=A.device)
    K.quantize_4bit_ptr(A.data_ptr(), code, n, bs, qt, packed.data_ptr(), absmax.data_ptr(), _stream(A))
    return packed, absmax


@quantize_4bit.register_fake
def _(A, blocksize, quant_type):
    formats.check_blocksize(blocksize)
    formats.check_quant_type(quant_type)
    dtype_code(A.dtype, "quantize_4bit input")
    n = A.numel()
    return (
        A.new_empty((formats.packed_bytes(n), 1), dtype=torch.uint8),
        A.new_empty((formats.num_blocks(n, blocksize),), dtype=torch.float32),
    )


def _check_4bit_inputs(packed, absmax, blocksize, quant_type, shape, dtype):
    formats.check_blocksize(blocksize)
    formats.check_quant_type(quant_type)
    dtype_code(dtype, "dequantize_4bit output dtype")
    n = 1
    for s in shape:
        n *= s
    if n <= 0:
        raise ValueError(f"shape must have positive sizes, got {list(shape)}")
    if packed.numel() != formats.packed_bytes(n):
        raise ValueError(f"packed has {packed.numel()} bytes, shape {list(shape)} needs {formats.packed_bytes(n)}")
    if absmax.numel() != formats.num_blocks(n, blocksize):
        raise ValueError(
            f"absmax has {absmax.numel()} values, shape {list(shape)} with blocksize {blocksize} "
            f"needs {formats.num_blocks(n, blocksize)}"
        )
    return n


@torch.library.custom_op("q4::dequantize_4bit", mutates_args=(), device_types=("cpu", "cuda"))
def dequantize_4bit(
    packed: torch.Tensor,
    absmax: torch.Tensor,
    blocksize: int,
    quant_type: str,
    shape: Sequence[int],
    dtype: torch.dtype,
) -> torch.Tensor:
    """decode(nibble) * absmax[block] in fp32, rounded to `dtype`, reshaped to `shape`."""
    n = _check_4bit_inputs(packed, absmax, blocksize, quant_type, shape, dtype)
    packed, absmax = _u8(packed, "packed"), _f32(absmax, "absmax")
    out = torch.empty(tuple(shape), dtype=dtype, device=packed.device)
    K.dequantize_4bit_ptr(
        packed.data_ptr(),
        absmax.data_ptr(),
        n,
        blocksize,
        formats.QUANT_TYPE_CODES[quant_type],
        out.data_ptr(),
        _DTYPE_CODE[dtype],
        _stream(packed),
    )
    return out


@dequantize_4bit.register_fake
def _(packed, absmax, blocksize, quant_type, shape, dtype):
    _check_4bit_inputs(packed, absmax, blocksize, quant_type, shape, dtype)
    return packed.new_empty(tuple(shape), dtype=dtype)


@torch.library.custom_op("q4::dequantize_4bit_out", mutates_args=("out",), device_types=("cpu", "cuda"))
def dequantize_4bit_out(
    packed: torch.Tensor, absmax: torch.Tensor, blocksize: int, quant_type: str, out: torch.Tensor
) -> None:
    """dequantize_4bit written into a contiguous `out` (its shape and dtype give
    the result's): no allocation, so no first-touch cost for a reused buffer."""
    n = _check_4bit_inputs(packed, absmax, blocksize, quant_type, list(out.shape), out.dtype)
    if not out.is_contiguous():
        raise ValueError(f"out must be contiguous, got strides {tuple(out.stride())}")
    if out.device != packed.device:
        raise ValueError(f"out is on {out.device}, packed on {packed.device}")
    packed, absmax = _u8(packed, "packed"), _f32(absmax, "absmax")
    K.dequantize_4bit_ptr(
        packed.data_ptr(),
        absmax.data_ptr(),
        n,
        blocksize,
        formats.QUANT_TYPE_CODES[quant_type],
        out.data_ptr(),
        _DTYPE_CODE[out.dtype],
        _stream(packed),
    )


@dequantize_4bit_out.register_fake
def _(packed, absmax, blocksize, quant_type, out):
    _check_4bit_inputs(packed, absmax, blocksize, quant_type, list(out.shape), out.dtype)


# ------------------------------------------------------------------ 8-bit


@torch.library.custom_op("q4::quantize_blockwise", mutates_args=(), device_types=("cpu", "cuda"))
def quantize_blockwise(A: torch.Tensor, code: torch.Tensor, blocksize: int) -> tuple[torch.Tensor, torch.Tensor]:
    """8-bit blockwise quantization with a sorted 256-entry code book: (codes uint8 like A, absmax f32)."""
    xcode = dtype_code(A.dtype, "quantize_blockwise input")
    bs = formats.check_blocksize(blocksize)
    _nonempty(A, "input")
    code = _f32(code, "code")
    if code.numel() != 256:
        raise ValueError(f"code must hold 256 values, got {code.numel()}")
    A = A.contiguous()
    out = torch.empty(A.shape, dtype=torch.uint8, device=A.device)
    absmax = torch.empty(formats.num_blocks(A.numel(), bs), dtype=torch.float32, device=A.device)
    K.quantize_blockwise_ptr(
        A.data_ptr(), xcode, A.numel(), bs, code.data_ptr(), out.data_ptr(), absmax.data_ptr(), _stream(A)
    )
    return out, absmax


@quantize_blockwise.register_fake
def _(A, code, blocksize):
    formats.check_blocksize(blocksize)
    return A.new_empty(A.shape, dtype=torch.uint8), A.new_empty(
        (formats.num_blocks(A.numel(), blocksize),), dtype=torch.float32
    )


@torch.library.custom_op("q4::dequantize_blockwise", mutates_args=(), device_types=("cpu", "cuda"))
def dequantize_blockwise(
    A: torch.Tensor,
    absmax: torch.Tensor,
    code: torch.Tensor,
    blocksize: int,
    dtype: torch.dtype,
    offset: torch.Tensor | None = None,
) -> torch.Tensor:
    """code[A] * absmax[block]; with offset: fp32(code[A] * absmax[block]) + offset (nested absmax)."""
    bs = formats.check_blocksize(blocksize)
    dcode = dtype_code(dtype, "dequantize_blockwise output dtype")
    A, absmax, code = _u8(A, "A"), _f32(absmax, "absmax"), _f32(code, "code")
    if absmax.numel() != formats.num_blocks(A.numel(), bs):
        raise ValueError(
            f"absmax has {absmax.numel()} values, {A.numel()} codes with blocksize {bs} "
            f"need {formats.num_blocks(A.numel(), bs)}"
        )
    if code.numel() != 256:
        raise ValueError(f"code must hold 256 values, got {code.numel()}")
    out = torch.empty(A.shape, dtype=dtype, device=A.device)
    off = None if offset is None else float(offset.reshape(()).item())
    K.dequantize_blockwise_ptr(
        A.data_ptr(), A.numel(), absmax.data_ptr(), bs, code.data_ptr(), off, out.data_ptr(), dcode, _stream(A)
    )
    return out


@dequantize_blockwise.register_fake
def _(A, absmax, code, blocksize, dtype, offset=None):
    return A.new_empty(A.shape, dtype=dtype)


@torch.library.custom_op("q4::quantize_nested", mutates_args=(), device_types=("cpu", "cuda"))
def quantize_nested(absmax: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Nested 8-bit quantization of a 4-bit absmax: (codes u8, absmax2 f32, offset f32 scalar)."""
    absmax = _f32(absmax, "absmax").reshape(-1)
    _nonempty(absmax, "absmax")
    n = absmax.numel()
    codes = torch.empty(n, dtype=torch.uint8, device=absmax.device)
    absmax2 = torch.empty(formats.num_blocks(n, formats.nested_blocksize()), dtype=torch.float32, device=absmax.device)
    offset = torch.empty((), dtype=torch.float32, device=absmax.device)
    K.quantize_nested_ptr(
        absmax.data_ptr(), n, codes.data_ptr(), absmax2.data_ptr(), offset.data_ptr(), _stream(absmax)
    )
    return codes, absmax2, offset


@quantize_nested.register_fake
def _(absmax):
    n = absmax.numel()
    return (
        absmax.new_empty((n,), dtype=torch.uint8),
        absmax.new_empty((formats.num_blocks(n, formats.nested_blocksize()),), dtype=torch.float32),
        absmax.new_empty((), dtype=torch.float32),
    )
