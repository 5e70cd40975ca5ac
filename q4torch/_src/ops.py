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

# the C ABI's dtype codes (q4._src.formats.DTYPE_CODES), by torch dtype
_DTYPE_CODE = {getattr(torch, name): code for name, code in formats.DTYPE_CODES.items()}


def dtype_code(dtype: torch.dtype, what: str) -> int:
    if dtype not in _DTYPE_CODE:
        raise TypeError(f"{what} must be float32, float16 or bfloat16, got {dtype}")
    return _DTYPE_CODE[dtype]


def _stream(t: torch.Tensor):
    return torch.cuda.current_stream(t.device).cuda_stream if t.is_cuda else None


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
    formats.check_packed_size(packed.numel(), n, "packed", f"shape {list(shape)}")
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
    bs = formats.check_blocksize8(blocksize)
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
    formats.check_blocksize8(blocksize)
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
    bs = formats.check_blocksize8(blocksize)
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


# ------------------------------------------------------------ fused matmuls


def _bias_arg(bias: torch.Tensor | None, n: int):
    """(contiguous bias kept alive, pointer or None, dtype code) for a length-n bias."""
    if bias is None:
        return None, None, 0
    if bias.shape != (n,):
        raise ValueError(f"bias must have shape ({n},), got {tuple(bias.shape)}")
    bias = bias.contiguous()
    return bias, bias.data_ptr(), dtype_code(bias.dtype, "bias")


def weight_args(packed, absmax, nested_absmax, nested_offset, n, k, blocksize, quant_type):
    """Validated C ABI weight arguments (scales tuple) for a 4-bit W [n, k]."""
    formats.check_blocksize(blocksize)
    formats.check_quant_type(quant_type)
    if n <= 0 or k <= 0:
        raise ValueError(f"weight shape must be positive, got ({n}, {k})")
    if packed.dtype != torch.uint8:
        raise TypeError(f"packed weight must be uint8 (view other quant_storage as uint8), got {packed.dtype}")
    formats.check_packed_size(packed.numel(), n * k, "packed weight", f"a ({n}, {k}) weight")
    blocks = formats.num_blocks(n * k, blocksize)
    if absmax.numel() != blocks:
        raise ValueError(
            f"absmax has {absmax.numel()} values, a ({n}, {k}) weight with blocksize {blocksize} needs {blocks}"
        )
    if nested_absmax is None:
        if absmax.dtype != torch.float32:
            raise TypeError(f"absmax must be float32, got {absmax.dtype}")
        return K.scales_args(absmax.data_ptr(), None, None, 0, None, None, blocks)
    if absmax.dtype != torch.uint8:
        raise TypeError(f"nested absmax codes must be uint8, got {absmax.dtype}")
    n2 = formats.num_blocks(blocks, formats.nested_blocksize())
    if nested_absmax.dtype != torch.float32 or nested_absmax.numel() != n2:
        raise ValueError(f"nested_absmax must be float32[{n2}], got {nested_absmax.dtype}[{nested_absmax.numel()}]")
    if nested_offset is None or nested_offset.numel() != 1:
        raise ValueError("a nested state needs a one-element nested_offset")
    return K.scales_args(
        None, absmax.data_ptr(), nested_absmax.data_ptr(), n2, None, float(nested_offset.reshape(()).item()), blocks
    )


def gemm_4bit_call(x, packed_ptr, n, k, scales, blocksize, quant_type, bias, activation_quant=None) -> torch.Tensor:
    """q4::gemm_4bit's (activation_quant='int8': q4::gemm_4bit_w4a8's) work for
    a packed weight whose C ABI arguments (packed_ptr, scales from weight_args)
    are already validated: the input checks, the result and the kernel call
    (CPU, or CUDA on x's stream). This is the whole per-call cost of a batch-1
    eager forward besides the kernel (eager.matmul_4bit calls it
    directly), so it does no more than it must: ~1 us a line when the weight
    has just pushed Python's own data out of the caches."""
    xcode = _DTYPE_CODE.get(x.dtype)
    if xcode is None:
        dtype_code(x.dtype, "gemm_4bit input")  # raises
    shape = x.shape
    if not shape or shape[-1] != k:
        raise ValueError(f"input has {shape[-1] if shape else 0} features, the weight expects {k} (weight ({n}, {k}))")
    numel = x.numel()
    if numel == 0:
        raise ValueError(f"empty input (shape {tuple(x.shape)})")
    if activation_quant is not None:
        formats.check_activation_quant(activation_quant)
        formats.check_w4a8_features(k, blocksize)
    bias, b, bcode = _bias_arg(bias, n)
    if not x.is_contiguous():
        x = x.contiguous()
    # x's dtype and device (half the cost of torch.empty's keywords); a tuple
    # size (a torch.Size costs ~0.7 us more in new_empty, ~0.1 more to build)
    out = x.new_empty((*shape[:-1], n))
    K.gemm_4bit_ptr(
        x.data_ptr(),
        xcode,
        numel // k,
        n,
        k,
        packed_ptr,
        scales,
        blocksize,
        formats.QUANT_TYPE_CODES[quant_type],
        b,
        bcode,
        out.data_ptr(),
        xcode,
        _stream(x),
        activation_quant,
    )
    return out


@torch.library.custom_op("q4::gemm_4bit", mutates_args=(), device_types=("cpu", "cuda"))
def gemm_4bit(
    x: torch.Tensor,
    packed: torch.Tensor,
    absmax: torch.Tensor,
    nested_absmax: torch.Tensor | None,
    nested_offset: torch.Tensor | None,
    n: int,
    k: int,
    blocksize: int,
    quant_type: str,
    bias: torch.Tensor | None,
) -> torch.Tensor:
    """y[..., n] = x[..., k] . dequantize(W)^T (+ bias), fp32 accumulation, W never materialised."""
    return _gemm(x, packed, absmax, nested_absmax, nested_offset, n, k, blocksize, quant_type, bias, None)


# Validated weight arguments of the op body, by what they are a function of:
# the pointers, sizes, dtypes and layouts of the packed bytes and scales and the
# op's integer arguments. An entry is exactly what weight_args would return for
# tensors with that key (pointers and sizes are all it holds), so a freed
# weight whose memory a new one reuses finds the new one's arguments; the
# nested offset's value is read on every call. Bounded: a compiled decoder's
# layers hit it on every token, a process that makes weights endlessly does not
# grow it. (The eager layers keep theirs per QuantState: eager._PREPARED.)
_WEIGHT_ARGS: dict[tuple, tuple] = {}
_WEIGHT_ARGS_MAX = 4096


def _in_place_key(t: torch.Tensor) -> tuple | None:
    """What a tensor contributes to a _WEIGHT_ARGS key, or None where the
    arguments must not be kept: a non-contiguous tensor is read through a
    copy, whose pointer dies with the call."""
    return (t.data_ptr(), t.numel(), t.dtype, t.device) if t.is_contiguous() else None


def _gemm(x, packed, absmax, nested_absmax, nested_offset, n, k, blocksize, quant_type, bias, activation_quant):
    """The body of q4::gemm_4bit and q4::gemm_4bit_w4a8 (activation_quant='int8')."""
    nested = nested_absmax is not None
    parts = (packed, absmax, nested_absmax) if nested else (packed, absmax)
    key: tuple | None = (n, k, blocksize, quant_type, None if nested_offset is None else nested_offset.numel())
    for t in parts:
        part = _in_place_key(t)
        key = None if part is None or key is None else key + part
    hit = None if key is None else _WEIGHT_ARGS.get(key)
    if hit is None:
        packed, absmax = packed.contiguous().reshape(-1), absmax.contiguous()
        nested_absmax = None if nested_absmax is None else nested_absmax.contiguous()
        scales = weight_args(packed, absmax, nested_absmax, nested_offset, n, k, blocksize, quant_type)
        hit = (packed.data_ptr(), scales)
        if key is not None:
            if len(_WEIGHT_ARGS) >= _WEIGHT_ARGS_MAX:
                _WEIGHT_ARGS.clear()
            _WEIGHT_ARGS[key] = hit
    elif nested:  # the offset's current value (weight_args checked its size when the entry was made)
        scales = hit[1]
        hit = (hit[0], scales[:5] + (float(nested_offset.reshape(()).item()),) + scales[6:])
    return gemm_4bit_call(x, hit[0], n, k, hit[1], blocksize, quant_type, bias, activation_quant)


def _gemm_fake(x, n, k, blocksize, activation_quant):
    if x.shape[-1] != k:
        raise ValueError(f"input has {x.shape[-1]} features, the weight expects {k}")
    if activation_quant is not None:
        formats.check_w4a8_features(k, blocksize)
    return x.new_empty(x.shape[:-1] + (n,))


@gemm_4bit.register_fake
def _(x, packed, absmax, nested_absmax, nested_offset, n, k, blocksize, quant_type, bias):
    return _gemm_fake(x, n, k, blocksize, None)


@torch.library.custom_op("q4::gemm_4bit_w4a8", mutates_args=(), device_types=("cpu", "cuda"))
def gemm_4bit_w4a8(
    x: torch.Tensor,
    packed: torch.Tensor,
    absmax: torch.Tensor,
    nested_absmax: torch.Tensor | None,
    nested_offset: torch.Tensor | None,
    n: int,
    k: int,
    blocksize: int,
    quant_type: str,
    bias: torch.Tensor | None,
) -> torch.Tensor:
    """gemm_4bit with x quantized to int8 per row in blocks (W4A8, q4/w4a8.h);
    its gradient is gemm_4bit's (straight through the activation rounding)."""
    return _gemm(x, packed, absmax, nested_absmax, nested_offset, n, k, blocksize, quant_type, bias, "int8")


@gemm_4bit_w4a8.register_fake
def _(x, packed, absmax, nested_absmax, nested_offset, n, k, blocksize, quant_type, bias):
    return _gemm_fake(x, n, k, blocksize, "int8")


@torch.library.custom_op("q4::gemm_4bit_grad_input", mutates_args=(), device_types=("cpu", "cuda"))
def gemm_4bit_grad_input(
    grad_out: torch.Tensor,
    packed: torch.Tensor,
    absmax: torch.Tensor,
    nested_absmax: torch.Tensor | None,
    nested_offset: torch.Tensor | None,
    n: int,
    k: int,
    blocksize: int,
    quant_type: str,
) -> torch.Tensor:
    """dx[..., k] = grad_out[..., n] . dequantize(W), W never materialised."""
    return gemm_4bit_grad_input_call(
        grad_out, packed, absmax, nested_absmax, nested_offset, n, k, blocksize, quant_type
    )


def gemm_4bit_grad_input_call(
    grad_out, packed, absmax, nested_absmax, nested_offset, n, k, blocksize, quant_type
) -> torch.Tensor:
    """q4::gemm_4bit_grad_input's work: the checks, the result and the kernel
    call (CPU, or CUDA on grad_out's stream). The eager backward
    (eager.EagerGemm4bit) calls it directly."""
    gcode = dtype_code(grad_out.dtype, "grad_out")
    if grad_out.shape[-1] != n:
        raise ValueError(f"grad_out has {grad_out.shape[-1]} features, the weight has {n} outputs")
    packed, absmax = packed.contiguous().reshape(-1), absmax.contiguous()
    nested_absmax = None if nested_absmax is None else nested_absmax.contiguous()
    scales = weight_args(packed, absmax, nested_absmax, nested_offset, n, k, blocksize, quant_type)
    g = grad_out.contiguous()
    out = torch.empty(grad_out.shape[:-1] + (k,), dtype=grad_out.dtype, device=grad_out.device)
    K.gemm_4bit_grad_input_ptr(
        g.data_ptr(),
        gcode,
        g.numel() // n,
        n,
        k,
        packed.data_ptr(),
        scales,
        blocksize,
        formats.QUANT_TYPE_CODES[quant_type],
        out.data_ptr(),
        gcode,
        _stream(g),
    )
    return out


@gemm_4bit_grad_input.register_fake
def _(grad_out, packed, absmax, nested_absmax, nested_offset, n, k, blocksize, quant_type):
    return grad_out.new_empty(grad_out.shape[:-1] + (k,))


def _gemm_setup_context(ctx, inputs, output):
    # Every tensor the backward needs goes through save_for_backward (never a
    # ctx attribute), so a recompute under activation checkpointing, or a
    # caller that refills the weight's buffer, is seen by the backward exactly
    # as the forward saw it — and a buffer modified in between is detected.
    x, packed, absmax, nested_absmax, nested_offset, n, k, blocksize, quant_type, bias = inputs
    ctx.save_for_backward(packed, absmax, nested_absmax, nested_offset)
    ctx.meta = (n, k, blocksize, quant_type, None if bias is None else bias.dtype)


def _gemm_backward(ctx, grad):
    return gemm_grads(ctx, grad, gemm_4bit_grad_input, 9)


def gemm_grads(ctx, grad, grad_input, bias_index: int) -> tuple:
    """The gradients of a gemm_4bit / gemm_4bit_w4a8 call: of x (the input
    gradient kernel, called through grad_input) and of the bias (at input
    bias_index), None for every other input. The weight comes from the
    tensors saved by the forward (packed, absmax, nested_absmax,
    nested_offset) and the shape from ctx.meta."""
    packed, absmax, nested_absmax, nested_offset = ctx.saved_tensors
    n, k, blocksize, quant_type, bias_dtype = ctx.meta
    grads = [None] * len(ctx.needs_input_grad)
    if ctx.needs_input_grad[0]:
        grads[0] = grad_input(grad, packed, absmax, nested_absmax, nested_offset, n, k, blocksize, quant_type)
    if bias_dtype is not None and ctx.needs_input_grad[bias_index]:
        grads[bias_index] = grad.reshape(-1, n).sum(0, dtype=torch.float32).to(bias_dtype)
    return tuple(grads)


gemm_4bit.register_autograd(_gemm_backward, setup_context=_gemm_setup_context)
gemm_4bit_w4a8.register_autograd(_gemm_backward, setup_context=_gemm_setup_context)


# ------------------------------------------------------------------ LLM.int8


def _int8_weight(weight: torch.Tensor, scale: torch.Tensor) -> tuple[int, int]:
    if weight.dtype != torch.int8 or weight.dim() != 2:
        raise TypeError(f"weight must be a 2-D int8 tensor (CB), got {weight.dtype} with shape {tuple(weight.shape)}")
    n, k = weight.shape
    if scale.dtype != torch.float32 or scale.shape != (n,):
        raise ValueError(f"weight_scale must be float32 of shape ({n},), got {scale.dtype} {tuple(scale.shape)}")
    return n, k


@torch.library.custom_op("q4::int8_quantize_rows", mutates_args=(), device_types=("cpu", "cuda"))
def int8_quantize_rows(x: torch.Tensor, threshold: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """LLM.int8 row-wise quantization of a 2-D x: (int8 like x, row_stats f32, outlier-column mask bool)."""
    code = dtype_code(x.dtype, "int8_quantize_rows input")
    if x.dim() != 2 or x.numel() == 0:
        raise ValueError(f"int8_quantize_rows needs a non-empty 2-D tensor, got shape {tuple(x.shape)}")
    x = x.contiguous()
    q = torch.empty(x.shape, dtype=torch.int8, device=x.device)
    stats = torch.empty(x.shape[0], dtype=torch.float32, device=x.device)
    cols = torch.empty(x.shape[1], dtype=torch.uint8, device=x.device)
    K.int8_quantize_rows_ptr(
        x.data_ptr(),
        code,
        x.shape[0],
        x.shape[1],
        formats.check_threshold(threshold),
        q.data_ptr(),
        stats.data_ptr(),
        cols.data_ptr(),
        _stream(x),
    )
    return q, stats, cols.bool()


@int8_quantize_rows.register_fake
def _(x, threshold):
    return (
        x.new_empty(x.shape, dtype=torch.int8),
        x.new_empty((x.shape[0],), dtype=torch.float32),
        x.new_empty((x.shape[1],), dtype=torch.bool),
    )


@torch.library.custom_op("q4::int8_linear", mutates_args=(), device_types=("cpu", "cuda"))
def int8_linear(
    x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, threshold: float, bias: torch.Tensor | None
) -> torch.Tensor:
    """LLM.int8 linear: y[..., n] ~= x[..., k] . (CB * SCB / 127)^T (+ bias), x quantized row-wise inside."""
    return int8_linear_call(x, weight, weight_scale, threshold, bias)


def int8_linear_call(x, weight, weight_scale, threshold, bias) -> torch.Tensor:
    """q4::int8_linear's work: the checks, the result and the kernel call (CPU,
    or CUDA on x's stream). eager.int8_linear calls it directly in eager
    mode when nothing records (as matmul_4bit calls gemm_4bit_call)."""
    xcode = dtype_code(x.dtype, "int8_linear input")
    n, k = _int8_weight(weight, weight_scale)
    if x.dim() < 1 or x.shape[-1] != k:
        raise ValueError(
            f"input has {x.shape[-1] if x.dim() else 0} features, the weight expects {k} (weight ({n}, {k}))"
        )
    if x.numel() == 0:
        raise ValueError(f"empty input (shape {tuple(x.shape)})")
    bias, b, bcode = _bias_arg(bias, n)
    x2, weight, weight_scale = x.contiguous(), weight.contiguous(), weight_scale.contiguous()
    out = torch.empty(x.shape[:-1] + (n,), dtype=x.dtype, device=x.device)
    K.int8_linear_ptr(
        x2.data_ptr(),
        xcode,
        x2.numel() // k,
        n,
        k,
        weight.data_ptr(),
        weight_scale.data_ptr(),
        formats.check_threshold(threshold),
        b,
        bcode,
        out.data_ptr(),
        xcode,
        _stream(x),
    )
    return out


@int8_linear.register_fake
def _(x, weight, weight_scale, threshold, bias):
    return x.new_empty(x.shape[:-1] + (weight.shape[0],))


@torch.library.custom_op("q4::int8_grad_input", mutates_args=(), device_types=("cpu", "cuda"))
def int8_grad_input(grad_out: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor) -> torch.Tensor:
    """dx[..., k] = grad_out[..., n] . (CB * SCB / 127), fp32 accumulation."""
    return int8_grad_input_call(grad_out, weight, weight_scale)


def int8_grad_input_call(grad_out, weight, weight_scale) -> torch.Tensor:
    """q4::int8_grad_input's work (the eager backward, eager.EagerInt8Linear, calls it directly)."""
    gcode = dtype_code(grad_out.dtype, "grad_out")
    n, k = _int8_weight(weight, weight_scale)
    if grad_out.shape[-1] != n:
        raise ValueError(f"grad_out has {grad_out.shape[-1]} features, the weight has {n} outputs")
    g, weight, weight_scale = grad_out.contiguous(), weight.contiguous(), weight_scale.contiguous()
    out = torch.empty(grad_out.shape[:-1] + (k,), dtype=grad_out.dtype, device=grad_out.device)
    K.int8_grad_input_ptr(
        g.data_ptr(),
        gcode,
        g.numel() // n,
        n,
        k,
        weight.data_ptr(),
        weight_scale.data_ptr(),
        out.data_ptr(),
        gcode,
        _stream(g),
    )
    return out


@int8_grad_input.register_fake
def _(grad_out, weight, weight_scale):
    return grad_out.new_empty(grad_out.shape[:-1] + (weight.shape[1],))


def int8_setup_context(ctx, inputs, output):
    x, weight, weight_scale, threshold, bias = inputs
    ctx.save_for_backward(weight, weight_scale)
    ctx.bias_dtype = None if bias is None else bias.dtype


def _int8_backward(ctx, grad):
    return int8_grads(ctx, grad, int8_grad_input)


def int8_grads(ctx, grad, grad_input) -> tuple:
    """The gradients of an int8_linear call (x, weight, weight_scale,
    threshold, bias): of x through grad_input, of the bias, None for the rest."""
    weight, weight_scale = ctx.saved_tensors
    grad_x = grad_bias = None
    if ctx.needs_input_grad[0]:
        grad_x = grad_input(grad, weight, weight_scale)
    if ctx.bias_dtype is not None and ctx.needs_input_grad[4]:
        grad_bias = grad.reshape(-1, weight.shape[0]).sum(0, dtype=torch.float32).to(ctx.bias_dtype)
    return grad_x, None, None, None, grad_bias


int8_linear.register_autograd(_int8_backward, setup_context=int8_setup_context)
