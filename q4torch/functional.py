"""bitsandbytes-shaped functional API over the q4 kernels.

Signatures and defaults follow ``bitsandbytes.functional`` so that code can
switch by changing the import. Results are bit-identical to bitsandbytes'
CPU path for the 4-bit formats; see the README for the nested 8-bit absmax.

This module is the bitsandbytes-facing surface only. QuantState and its
check live in q4torch/_src/quant_state.py (re-exported here), the ops in
q4torch/_src/ops.py, and the eager fast path that matmul_4bit and
int8_linear try first (direct kernel calls, the cache of validated weight
arguments) in q4torch/_src/eager.py, which the layers call too.
"""

from __future__ import annotations

import copy
import math
import warnings
from typing import Any

import torch

import q4
from q4._src import formats, quantizers
from q4torch._src import eager, ops
from q4torch._src.quant_state import QuantState, check_quant_state, code_table

__all__ = [
    "QuantState",
    "create_fp8_map",
    "create_linear_map",
    "create_normal_map",
    "gemv_4bit",
    "has_avx512bf16",
    "int8_double_quant",
    "int8_linear",
    "int8_linear_matmul",
    "int8_mm_dequant",
    "int8_vectorwise_dequant",
    "int8_vectorwise_quant",
    "matmul_4bit",
    "dequantize_4bit",
    "dequantize_blockwise",
    "dequantize_fp4",
    "dequantize_nf4",
    "get_4bit_type",
    "create_dynamic_map",
    "quantize_4bit",
    "quantize_blockwise",
    "quantize_fp4",
    "quantize_nf4",
]

_INV_127 = 1.0 / 127.0  # fp32(1/127), LLM.int8's dequantization
_INV_127_SQ = 1.0 / 16129.0  # fp32(1/127^2)


def get_4bit_type(typename: str, device=None) -> torch.Tensor:
    """The 16-entry code book of 'nf4' or 'fp4' (read from the kernel library)."""
    formats.check_quant_type(typename)
    return code_table(typename, device)


def create_dynamic_map(signed=True, max_exponent_bits=7, total_bits=8, device=None) -> torch.Tensor:
    """The dynamic map: 256 sorted values in [-1, 1] (bitsandbytes' signature).
    The default, signed 8-bit map is the kernel library's table; other
    parameters build the generalised map (a dynamic exponent of up to
    max_exponent_bits decimal digits, linearly spaced fractions in [0.1, 1]),
    padded with zeros to 256 values."""
    if isinstance(signed, (torch.device, str)) and device is None:  # create_dynamic_map(device)
        signed, device = True, signed
    if signed is True and max_exponent_bits == 7 and total_bits == 8:
        return code_table("dynamic", device)
    if not (1 <= total_bits <= 8) or not (1 <= max_exponent_bits <= total_bits):
        raise ValueError(
            f"create_dynamic_map needs 1 <= total_bits <= 8 and 1 <= max_exponent_bits <= total_bits, "
            f"got total_bits={total_bits}, max_exponent_bits={max_exponent_bits}"
        )
    values: list[float] = []
    fraction_bits = total_bits - 1 - max_exponent_bits  # bits beside the sign and the exponent's indicator
    sides = (1.0, -1.0) if signed else (1.0,)

    def scaled(scale: float, count: int) -> list[float]:
        # fp32 midpoints of `count` equal steps over [0.1, 1], times the scale (in fp32)
        edges = torch.linspace(0.1, 1, count + 1, dtype=torch.float32)
        means = (edges[:-1] + edges[1:]) / 2.0
        return [v for side in sides for v in ((side * scale) * means).tolist()]

    for e in range(max_exponent_bits):
        count = int(2.0 ** (e + fraction_bits + (0 if signed else 1)))  # below 1: none
        values += scaled(10.0 ** (e - (max_exponent_bits - 1)), count)
    extra = int(2**fraction_bits - 1)  # the codes whose exponent bits are all zero
    if extra > 0:
        values += scaled(1.0, extra)  # at the largest exponent's scale
    values += [0.0, 1.0]
    values += [0.0] * (256 - len(values))
    return torch.tensor(sorted(values), dtype=torch.float32, device=device or "cpu")


def create_linear_map(signed=True, total_bits=8, add_zero=True) -> torch.Tensor:
    """2**total_bits evenly spaced values over [-1, 1] (signed) or [0, 1], one
    fewer when signed with add_zero (so that 0 is a value), zero-padded in the
    middle to 256 entries (bitsandbytes' layout)."""
    count = 2**total_bits
    if (add_zero or total_bits < 8) and signed:
        count -= 1
    values = torch.linspace(-1.0 if signed else 0.0, 1.0, count)
    gap = 256 - values.numel()
    if gap == 0:
        return values
    half = values.numel() // 2
    return torch.cat([values[:half], torch.zeros(gap), values[half:]])


def create_normal_map(offset=0.9677083, use_extra_value=True) -> torch.Tensor:
    """The NormalFloat map: quantiles of N(0, 1) at evenly spaced probabilities
    from `offset` to 0.5 (8 positive and 7 negative values with
    use_extra_value, else 7 and 7), zero-padded to 256, sorted, scaled so the
    largest is 1. The default's 16 non-zero-padding values are q4's NF4 table."""
    try:
        from scipy.stats import norm
    except ImportError as e:  # pragma: no cover - scipy is a test dependency
        raise ImportError("create_normal_map needs scipy") from e
    positive = norm.ppf(torch.linspace(offset, 0.5, 9 if use_extra_value else 8)[:-1].numpy()).tolist()
    negative = (-norm.ppf(torch.linspace(offset, 0.5, 8)[:-1].numpy())).tolist()
    values = torch.tensor(positive + [0.0] * (256 - len(positive) - len(negative)) + negative)
    values = values.sort().values
    return values / values.max()


def create_fp8_map(signed=True, exponent_bits=5, precision_bits=2, total_bits=8) -> torch.Tensor:
    """A small floating-point format's values (exponent bias 2**(exponent_bits - 1),
    subnormals at exponent 0), both signs when signed, zero-padded to 256,
    sorted and scaled so the largest is 1 (bitsandbytes' code-book builder; its
    4-bit E2M1 variant is not the FP4 table, whose smallest value differs)."""
    if exponent_bits + precision_bits != total_bits - (1 if signed else 0):
        raise ValueError(
            f"exponent_bits + precision_bits must be total_bits - {1 if signed else 0}, got "
            f"{exponent_bits} + {precision_bits} with total_bits {total_bits}"
        )
    bias = 2 ** (exponent_bits - 1)
    values: list[float] = []
    for e in range(2**exponent_bits):
        for m in range(2**precision_bits):
            fraction = m / 2**precision_bits  # mantissa bits, most significant first
            v = fraction * 2.0**-bias if e == 0 else (1 + fraction) * 2.0 ** -(e - bias - 1)
            values += [v, -v] if signed else [v]
    values += [0.0] * (256 - len(values))
    code = torch.tensor(sorted(values))
    return code / code.max()


def _check_tensors(**named) -> None:
    """A must be a tensor; optional tensor arguments must be tensors or None."""
    for name, value in named.items():
        required = name in ("A", "B")
        if (value is not None or required) and not isinstance(value, torch.Tensor):
            raise TypeError(
                f"{name} must be a torch.Tensor{'' if required else ' or None'}, got {type(value).__name__}"
            )


# dtypes the packed 4-bit bytes may be viewed as (bitsandbytes' quant_storage): every copy keeps the
# bytes. Not bool: a copy of a bool tensor turns every non-zero byte into 1, so other codes.
QUANT_STORAGE_DTYPES = (torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.float16,
                        torch.bfloat16, torch.float32, torch.float64)  # fmt: skip


def check_quant_storage(dtype, what: str = "quant_storage") -> torch.dtype:
    """``dtype`` if the packed 4-bit bytes may be stored as it, else ValueError naming ``what``."""
    if not isinstance(dtype, torch.dtype) or dtype not in QUANT_STORAGE_DTYPES:
        why = " (a copy of a bool tensor turns every non-zero byte into 1)" if dtype is torch.bool else ""
        raise ValueError(f"{what} must be one of {', '.join(str(d) for d in QUANT_STORAGE_DTYPES)}, got {dtype!r}{why}")
    return dtype


def _check_devices(**named) -> None:
    """No tensor on the meta device (no data: a kernel would read leftover
    memory) unless every one is (shape propagation)."""
    tensors = {k: v for k, v in named.items() if isinstance(v, torch.Tensor)}
    meta = sorted(k for k, v in tensors.items() if v.is_meta)
    if meta and len(meta) < len(tensors):
        raise ValueError(
            f"{', '.join(meta)} {'is' if len(meta) == 1 else 'are'} on the meta device (no data) while "
            f"{', '.join(sorted(set(tensors) - set(meta)))} {'is' if len(tensors) - len(meta) == 1 else 'are'} "
            "not: load or materialise the quantized weight (e.g. load_state_dict(..., assign=True), or "
            "to_empty() and a checkpoint) before computing with it"
        )


def _state_tensors(qs: QuantState) -> dict[str, Any]:
    nested = qs.nested and isinstance(qs.state2, QuantState)
    return {
        "quant_state.absmax": qs.absmax,
        "quant_state.state2.absmax": qs.state2.absmax if nested else None,
        "quant_state.offset": qs.offset if nested else None,
    }


def _resolve_blocksize(blocksize, default):
    return formats.check_blocksize(default if blocksize is None else blocksize)


def quantize_4bit(
    A: torch.Tensor,
    absmax: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    blocksize: int | None = None,
    compress_statistics: bool = False,
    quant_type: str = "fp4",
    quant_storage: torch.dtype = torch.uint8,
) -> tuple[torch.Tensor, QuantState]:
    """Quantize A (fp32/fp16/bf16, any shape; a non-contiguous A is copied) to
    4 bits in blocks of `blocksize` (default 64) consecutive elements.

    Returns (packed [ceil(n/2), 1] of quant_storage, QuantState). With
    compress_statistics the absmax is itself quantized (nested, block 256).
    NaN in a block makes its absmax NaN and every nibble 15 (see the README);
    with compress_statistics a NaN or Inf is refused (ValueError naming the
    blocks: it would turn every block into NaN), and scales whose float32
    mean overflows get a float64 mean as the nested offset.
    """
    _check_tensors(A=A, absmax=absmax, out=out)
    bs = _resolve_blocksize(blocksize, 64)
    check_quant_storage(quant_storage)
    packed, _absmax = ops.quantize_4bit(A, bs, quant_type)
    if quant_storage != torch.uint8:
        if packed.numel() * 1 % quant_storage.itemsize:
            raise ValueError(
                f"{packed.numel()} packed bytes cannot be viewed as {quant_storage} (itemsize {quant_storage.itemsize})"
            )
        packed = packed.squeeze(1).view(quant_storage).unsqueeze(1)
    code = get_4bit_type(quant_type, A.device)
    if compress_statistics:
        codes, absmax2, offset = ops.quantize_nested(_absmax)
        if not bool(torch.isfinite(offset)):
            # a NaN / Inf in A (refused, naming the blocks), or finite scales whose fp32 mean overflows
            c, a2, off = quantizers.nested_fallback(_absmax.detach().cpu().numpy(), bs)
            codes = torch.from_numpy(c).to(A.device).reshape(codes.shape)
            absmax2 = torch.from_numpy(a2).to(A.device)
            offset = torch.tensor(float(off), dtype=torch.float32, device=A.device)
        state2 = QuantState(
            absmax=absmax2, code=create_dynamic_map(A.device), blocksize=formats.nested_blocksize(), dtype=torch.float32
        )
        state = QuantState(
            absmax=codes,
            shape=A.shape,
            dtype=A.dtype,
            blocksize=bs,
            code=code,
            quant_type=quant_type,
            offset=offset,
            state2=state2,
        )
    else:
        state = QuantState(absmax=_absmax, shape=A.shape, dtype=A.dtype, blocksize=bs, code=code, quant_type=quant_type)
    if out is not None:
        packed = out.copy_(packed)
    if absmax is not None:
        state.absmax = absmax.copy_(state.absmax)
    return packed, state


def _state_absmax(state: QuantState) -> torch.Tensor:
    """The fp32 per-block absmax of a state (decoding a nested one)."""
    if not state.nested:
        return state.absmax.float() if state.absmax.dtype != torch.float32 else state.absmax
    s2 = state.state2
    return ops.dequantize_blockwise(state.absmax, s2.absmax, s2.code, s2.blocksize, torch.float32, state.offset)


def dequantize_4bit(
    A: torch.Tensor,
    quant_state: QuantState | None = None,
    absmax: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    blocksize: int | None = None,
    quant_type: str = "fp4",
) -> torch.Tensor:
    """Dequantize packed 4-bit data: decode(nibble) * absmax[block] in fp32,
    rounded to the state's dtype (exactly bitsandbytes' values)."""
    if quant_state is None:
        if absmax is None or out is None:
            raise ValueError("dequantize_4bit needs quant_state, or both absmax and out")
        quant_state = QuantState(
            absmax=absmax,
            shape=out.shape,
            dtype=out.dtype,
            blocksize=_resolve_blocksize(blocksize, 64),
            quant_type=quant_type,
        )
    _check_tensors(A=A, out=out)
    check_quant_state(quant_state, A)
    check_quant_storage(A.dtype, "the packed weight's dtype")
    _check_devices(A=A, **_state_tensors(quant_state))
    packed = A if A.dtype == torch.uint8 else A.view(torch.uint8)
    absmax = _state_absmax(quant_state)
    if (
        out is not None
        and out.is_contiguous()
        and out.dtype == quant_state.dtype
        and out.numel() == math.prod(quant_state.shape)
    ):
        ops.dequantize_4bit_out(packed.reshape(-1), absmax, quant_state.blocksize, quant_state.quant_type, out)
        result = out
    else:
        result = ops.dequantize_4bit(
            packed.reshape(-1),
            absmax,
            quant_state.blocksize,
            quant_state.quant_type,
            list(quant_state.shape),
            quant_state.dtype,
        )
        if out is not None:
            result = out.copy_(result)
    return result.t() if A.shape[0] == 1 else result


def quantize_fp4(A, absmax=None, out=None, blocksize=None, compress_statistics=False, quant_storage=torch.uint8):
    """quantize_4bit with quant_type="fp4" (bitsandbytes' name)."""
    return quantize_4bit(A, absmax, out, blocksize, compress_statistics, "fp4", quant_storage)


def quantize_nf4(A, absmax=None, out=None, blocksize=None, compress_statistics=False, quant_storage=torch.uint8):
    """quantize_4bit with quant_type="nf4" (bitsandbytes' name)."""
    return quantize_4bit(A, absmax, out, blocksize, compress_statistics, "nf4", quant_storage)


def dequantize_fp4(A, quant_state=None, absmax=None, out=None, blocksize=None):
    """dequantize_4bit of an FP4 weight (bitsandbytes' name)."""
    return dequantize_4bit(A, quant_state, absmax, out, blocksize, "fp4")


def dequantize_nf4(A, quant_state=None, absmax=None, out=None, blocksize=None):
    """dequantize_4bit of an NF4 weight (bitsandbytes' name)."""
    return dequantize_4bit(A, quant_state, absmax, out, blocksize, "nf4")


def quantize_blockwise(
    A: torch.Tensor,
    code: torch.Tensor | None = None,
    absmax: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    blocksize: int = 4096,
    nested: bool = False,
) -> tuple[torch.Tensor, QuantState]:
    """8-bit blockwise quantization with the dynamic map (or `code`): each
    element gets the code whose reconstruction code[j] * absmax is nearest."""
    _check_tensors(A=A, code=code, absmax=absmax, out=out)
    bs = formats.check_blocksize8(blocksize)
    code = create_dynamic_map(A.device) if code is None else code.to(A.device)
    _out, _absmax = ops.quantize_blockwise(A, code, bs)
    if nested:
        offset = _absmax.mean()
        qabsmax, state2 = quantize_blockwise(_absmax - offset, blocksize=bs, nested=False)
        state = QuantState(absmax=qabsmax, code=code.clone(), blocksize=bs, dtype=A.dtype, offset=offset, state2=state2)
    else:
        state = QuantState(absmax=_absmax, code=code.clone(), blocksize=bs, dtype=A.dtype)
    if out is not None:
        _out = out.copy_(_out)
    if absmax is not None:
        state.absmax = absmax.copy_(state.absmax)
    return _out, state


def dequantize_blockwise(
    A: torch.Tensor,
    quant_state: QuantState | None = None,
    absmax: torch.Tensor | None = None,
    code: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    blocksize: int = 4096,
    nested: bool = False,
) -> torch.Tensor:
    """Inverse of quantize_blockwise: code[A] * absmax[block] in the state's dtype."""
    if quant_state is None:
        if absmax is None:
            raise ValueError("dequantize_blockwise needs quant_state or absmax")
        quant_state = QuantState(
            absmax=absmax,
            code=create_dynamic_map(A.device) if code is None else code,
            blocksize=blocksize,
            dtype=torch.float32,
        )
    scale = quant_state.absmax
    if quant_state.state2 is not None:
        s2 = quant_state.state2
        scale = ops.dequantize_blockwise(scale, s2.absmax, s2.code, s2.blocksize, torch.float32, quant_state.offset)
    result = ops.dequantize_blockwise(A, scale, quant_state.code, quant_state.blocksize, quant_state.dtype)
    if out is not None:
        result = out.copy_(result)
    return result


def matmul_4bit(
    A: torch.Tensor,
    B: torch.Tensor,
    quant_state: QuantState,
    out: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    activation_quant: str | None = None,
) -> torch.Tensor:
    """A . dequantize(B)^T (+ bias) through the fused kernels, differentiable in
    A and bias (the quantized weight is frozen). B is the packed weight (any
    quant_storage view, transposed or not); quant_state.shape = (out, in).

    Neither direction materialises the dequantized weight; the backward uses
    the packed weight saved by the forward (save_for_backward).

    activation_quant='int8' (opt-in W4A8): A is quantized to int8 per row in
    blocks of min(64, blocksize) and multiplied with the codes as int8 values
    in integer dot products (README "W4A8"): faster on VNNI CPUs, less exact
    (about 1e-2 relative error); in_features must be a multiple of the
    block. Its gradient is the exact one of A . dequantize(B)^T.
    """
    if quant_state is None:
        raise ValueError("matmul_4bit needs the weight's quant_state")
    formats.check_activation_quant(activation_quant)
    if out is None:
        y = eager.matmul_4bit(A, B, quant_state, bias, activation_quant)
        if y is not None:
            return y
    _check_tensors(A=A, B=B, out=out, bias=bias)
    check_quant_state(quant_state, B)
    check_quant_storage(B.dtype, "the packed weight B's dtype")
    _check_devices(A=A, B=B, bias=bias, **_state_tensors(quant_state))
    if A.dim() == 0:
        raise ValueError(
            f"matmul_4bit needs an input with at least one dimension (features last), got a 0-d tensor; "
            f"the weight takes {quant_state.shape[-1] if len(quant_state.shape) == 2 else '?'} features"
        )
    if len(quant_state.shape) != 2:
        raise ValueError(f"matmul_4bit needs a 2-D weight, quant_state.shape is {tuple(quant_state.shape)}")
    n, k = (int(s) for s in quant_state.shape)
    packed = B if B.dtype == torch.uint8 else B.view(torch.uint8)
    nested = quant_state.nested
    if A.dim() >= 1 and A.shape[-1] == n and n != k:
        # a weight quantized from a [K, N] tensor (bitsandbytes accepts it, deprecated)
        warnings.warn(
            f"matmul_4bit: the weight was quantized from a [K, N] tensor (quant_state.shape={list(quant_state.shape)}). "
            "Re-quantize from the weight in [N, K] (out_features, in_features) orientation",
            DeprecationWarning,
            stacklevel=2,
        )
        if activation_quant is not None:
            raise ValueError("activation_quant needs a weight quantized in [N, K] orientation")
        y = _MatmulKN.apply(A, packed.reshape(-1), quant_state)
        y = y if bias is None else y + bias
        return y if out is None else out.copy_(y)
    if A.dim() >= 1 and A.numel() == 0 and A.shape[-1] == k:
        # no rows: an empty result that still joins the autograd graph
        y = torch.matmul(A, A.new_zeros((k, n)))
        y = y if bias is None else y + bias
        return y if out is None else out.copy_(y)
    op = ops.gemm_4bit if activation_quant is None else ops.gemm_4bit_w4a8
    y = op(
        A,
        packed.reshape(-1),
        quant_state.absmax,
        quant_state.state2.absmax if nested else None,
        quant_state.offset if nested else None,
        n,
        k,
        int(quant_state.blocksize),
        quant_state.quant_type,
        bias,
    )
    if out is not None:
        return out.copy_(y)
    return y


def _weight_operands(packed: torch.Tensor, qs: QuantState) -> tuple:
    nested = qs.nested
    return (
        packed,
        qs.absmax,
        qs.state2.absmax if nested else None,
        qs.offset if nested else None,
        int(qs.shape[0]),
        int(qs.shape[1]),
        int(qs.blocksize),
        qs.quant_type,
    )


class _MatmulKN(torch.autograd.Function):
    """A . W for a 4-bit W stored as [K, N] (quant_state.shape): the input-gradient
    kernel computes it (x . W), the forward kernel its gradient (g . W^T)."""

    @staticmethod
    def forward(ctx, A, packed, qs):
        ctx.save_for_backward(packed)
        ctx.qs = qs
        rows = A.reshape(-1, A.shape[-1]) if A.numel() else A.reshape(0, A.shape[-1])
        if rows.shape[0] == 0:
            return A.new_zeros(A.shape[:-1] + (int(qs.shape[1]),))
        return ops.gemm_4bit_grad_input(rows, *_weight_operands(packed, qs)).reshape(A.shape[:-1] + (-1,))

    @staticmethod
    def backward(ctx, grad):
        (packed,) = ctx.saved_tensors
        if grad.numel() == 0:
            return grad.new_zeros(grad.shape[:-1] + (int(ctx.qs.shape[0]),)), None, None
        g = grad.contiguous()
        return ops.gemm_4bit(g, *_weight_operands(packed, ctx.qs), None), None, None


def _int8_rows(A, fn: str, name: str = "A") -> torch.Tensor:
    """A [..., k] as its rows [m, k] (k >= 1), or ValueError naming ``fn`` and the shape."""
    _check_tensors(A=A)
    if A.dim() == 0 or A.shape[-1] == 0:
        raise ValueError(
            f"{fn}: {name} must have at least one dimension with a non-empty last (features) dimension, "
            f"got shape {tuple(A.shape)}"
        )
    return A.reshape(-1, A.shape[-1])


def _check_stats(stats, n: int, fn: str, name: str, what: str) -> None:
    if not isinstance(stats, torch.Tensor) or stats.numel() != n:
        got = f"{stats.dtype}{list(stats.shape)}" if isinstance(stats, torch.Tensor) else type(stats).__name__
        raise ValueError(f"{fn}: {name} must hold one value per {what} ({n}), got {got}")


def int8_vectorwise_quant(A: torch.Tensor, threshold: float = 0.0):
    """LLM.int8 row-wise quantization, as bitsandbytes.functional.int8_vectorwise_quant:
    (int8 rows, fp32 row_stats, outlier column indices or None when threshold is 0)."""
    rows = _int8_rows(A, "int8_vectorwise_quant")
    q, stats, cols = ops.int8_quantize_rows(rows, float(threshold))
    outlier_cols = torch.nonzero(cols).reshape(-1) if threshold > 0 else None
    return q.reshape(A.shape), stats, outlier_cols


def int8_linear(
    A: torch.Tensor,
    CB: torch.Tensor,
    SCB: torch.Tensor,
    threshold: float = 0.0,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """LLM.int8 linear through the fused kernel, differentiable in A and bias:
    y ~= A . (CB * SCB / 127)^T (+ bias); input columns with any |A| >= threshold
    (threshold > 0) go through fp32 unquantized."""
    y = eager.int8_linear(A, CB, SCB, threshold, bias)  # (the op's bytes, without the dispatcher)
    return ops.int8_linear(A, CB, SCB, float(threshold), bias) if y is None else y


# ------------------------------------------------------------ bitsandbytes' functional API


def has_avx512bf16() -> bool:
    """Whether this CPU (and OS) supports AVX512_BF16, from q4's feature detection."""
    return bool(q4.cpu_features()["features"]["avx512_bf16"])


def _convert_weight_packed_for_cpu(qweight: torch.Tensor, quant_state: QuantState, block_n: int = 32):
    """bitsandbytes repacks a 4-bit weight for its CPU gemv; q4's kernels read
    the packed bytes as they are, so this returns copies in the same layout
    (a pure function: the arguments are not modified)."""
    check_quant_state(quant_state, qweight)
    return qweight.detach().clone(), copy.copy(quant_state)


def gemv_4bit(
    A: torch.Tensor,
    B: torch.Tensor,
    out: torch.Tensor | None = None,
    transposed_A=False,
    transposed_B=False,
    state: QuantState | None = None,
) -> torch.Tensor:
    """A . dequantize(B)^T for the packed 4-bit B (any view of it), as
    bitsandbytes.functional.gemv_4bit: the fused kernel (any batch)."""
    if state is None:
        raise ValueError("state cannot be None: gemv_4bit needs the state from quantize_4bit()")
    return matmul_4bit(A, B, state, out=out)


def int8_linear_matmul(A: torch.Tensor, B: torch.Tensor, out: torch.Tensor | None = None, dtype=torch.int32):
    """The exact int32 product A . B^T of int8 A [..., k] and int8 B [n, k]."""
    for name, t in (("A", A), ("B", B)):
        if not isinstance(t, torch.Tensor) or t.dtype != torch.int8:
            raise TypeError(f"int8_linear_matmul: {name} must be an int8 tensor, got {getattr(t, 'dtype', type(t))}")
    if dtype != torch.int32:
        raise ValueError(f"int8_linear_matmul computes int32, got dtype={dtype}")
    if B.dim() != 2 or A.dim() < 1 or A.shape[-1] != B.shape[-1]:
        raise ValueError(f"int8_linear_matmul: A {tuple(A.shape)} and B {tuple(B.shape)} do not share k")
    if A.shape[-1] > 2**37:  # |sum| < 128^2 k must stay exact in fp64 (2^53)
        raise ValueError(f"int8_linear_matmul: k = {A.shape[-1]} is too long")
    # every partial sum is an integer below 2^53: fp64 products and sums are exact
    result = torch.matmul(A.to(torch.float64), B.to(torch.float64).t()).to(torch.int32)
    if out is not None:
        return out.copy_(result)
    return result


def int8_mm_dequant(
    A: torch.Tensor,
    row_stats: torch.Tensor,
    col_stats: torch.Tensor,
    out: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """fp16 (A * (row_stats * col_stats) / 127^2 + bias) for the int32 product
    A of int8_linear_matmul (q4's LLM.int8 epilogue order)."""
    if not isinstance(A, torch.Tensor) or A.dtype != torch.int32:
        raise ValueError(f"A must be int32, got {getattr(A, 'dtype', type(A).__name__)}")
    a = _int8_rows(A, "int8_mm_dequant")
    for name, t in (("row_stats", row_stats), ("col_stats", col_stats)):
        if not isinstance(t, torch.Tensor) or t.dtype != torch.float32:
            raise ValueError(f"{name} must be float32, got {getattr(t, 'dtype', type(t).__name__)}")
    _check_stats(row_stats, a.shape[0], "int8_mm_dequant", "row_stats", "row of A")
    _check_stats(col_stats, a.shape[1], "int8_mm_dequant", "col_stats", "column of A")
    scale = row_stats.reshape(-1, 1) * col_stats.reshape(1, -1)
    result = a.to(torch.float32) * scale * _INV_127_SQ
    if bias is not None:
        result = result + bias.to(torch.float32)
    result = result.to(torch.float16).reshape(A.shape)
    if out is not None:
        return out.copy_(result)
    return result


def int8_vectorwise_dequant(A: torch.Tensor, stats: torch.Tensor) -> torch.Tensor:
    """fp32 A * stats[row] / 127 (rows of A: all but its last dim)."""
    if not isinstance(A, torch.Tensor) or A.dtype != torch.int8:
        raise TypeError(f"A must be int8, got {getattr(A, 'dtype', type(A).__name__)}")
    rows = _int8_rows(A, "int8_vectorwise_dequant")
    _check_stats(stats, rows.shape[0], "int8_vectorwise_dequant", "stats", "row of A")
    return A.to(torch.float32) * stats.reshape(-1, *([1] * (A.dim() - 1))).reshape(*A.shape[:-1], 1) * _INV_127


def int8_double_quant(A: torch.Tensor, col_stats=None, row_stats=None, out_col=None, out_row=None, threshold=0.0):
    """LLM.int8 quantization row-wise and column-wise: (row-quantized int8,
    column-quantized int8, row_stats, col_stats, outlier column indices or
    None). Outlier columns (any |A| >= threshold) are zero in both."""
    for name, v in (("col_stats", col_stats), ("row_stats", row_stats), ("out_col", out_col), ("out_row", out_row)):
        if v is not None:
            raise ValueError(f"{name} must be None: int8_double_quant does not take pre-allocated outputs")
    rows = _int8_rows(A, "int8_double_quant")
    q_row, s_row, outliers = int8_vectorwise_quant(rows, threshold)
    cols = rows
    if outliers is not None and outliers.numel():
        cols = rows.clone()
        cols[:, outliers] = 0
    q_col_t, s_col, _ = int8_vectorwise_quant(cols.t().contiguous(), 0.0)
    return q_row.reshape(A.shape), q_col_t.t().contiguous().reshape(A.shape), s_row, s_col, outliers
