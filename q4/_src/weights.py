"""Whole weight matrices in the checkpoint formats, numpy in and out.

The one place that turns a float W [out, in] into what a quantized layer
stores (and back): used by the ``q4 quantize`` / ``q4 parity`` commands and by
the front ends' host-side quantization, so the checkpoint bytes have a single
source.
"""

from __future__ import annotations

import numpy as np

from q4._src import formats, quantizers
from q4._src.kernels import dequantize_4bit, dequantize_blockwise, int8_quantize_rows, quantize_4bit
from q4._src.quant_state import QuantState


def quantize_weight_4bit(
    w: np.ndarray,
    blocksize: int = 64,
    quant_type: str = "nf4",
    nested: bool = True,
    method: str = "absmax",
    *,
    hessian: np.ndarray | None = None,
    damp: float = 0.01,
    dtype: str | None = None,
) -> tuple[np.ndarray, QuantState]:
    """(packed uint8 [ceil(n/2), 1], QuantState) of a float array, as a
    bitsandbytes Linear4bit stores it; the state's dtype is ``dtype`` or w's.
    ``method``: 'absmax' (bitsandbytes'), 'mse' (each block's scale chosen by
    error) or 'gptq' (a 2-D W [out, in] with its layer's ``hessian`` and
    ``damp``); q4/_src/quantizers.py."""
    w = np.asarray(w)
    if quantizers.check_method(method) == "mse":
        return quantizers.quantize_mse(w, blocksize, quant_type, nested, dtype)
    if method == "gptq":
        if hessian is None:
            raise ValueError(
                "method='gptq' needs the layer's Hessian (calibration data): use replace_linear / quantize_model"
            )
        return quantizers.gptq(w.astype(np.float32), hessian, blocksize, quant_type, nested, damp=damp,
                               dtype=dtype or w.dtype.name)  # fmt: skip
    packed, absmax = quantize_4bit(w, blocksize, quant_type)
    return packed, quantizers.quant_state(w, absmax, blocksize, quant_type, nested, dtype)


def state_absmax(state: QuantState) -> np.ndarray:
    """The fp32 per-block absmax of a state (decoding nested statistics)."""
    if not state.nested:
        return np.asarray(state.absmax, np.float32)
    return dequantize_blockwise(
        state.absmax,
        state.nested_absmax,
        state.nested_blocksize,
        code=formats.code_table("dynamic"),
        offset=float(state.nested_offset),  # type: ignore[arg-type]  # nested: validated
    )


def dequantize_weight_4bit(packed: np.ndarray, state: QuantState, dtype: str = "float32") -> np.ndarray:
    state.validate()
    return dequantize_4bit(
        np.asarray(packed).view(np.uint8), state_absmax(state), state.shape, state.blocksize, state.quant_type, dtype
    )


def quantize_weight_int8(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(CB int8 [out, in], SCB fp32 [out]) of a 2-D float weight, as a
    bitsandbytes Linear8bitLt stores it: rounded to float16 first."""
    w = np.asarray(w)
    if w.ndim != 2 or w.dtype.kind != "f" and w.dtype.name != "bfloat16":
        raise ValueError(f"an int8 weight must be quantized from a 2-D float matrix, got {w.dtype} {w.shape}")
    with np.errstate(over="ignore"):
        w16 = np.ascontiguousarray(w.astype(np.float32).astype(np.float16))
    cb, scb, _ = int8_quantize_rows(w16, 0.0)
    check_int8_scales(scb)
    return cb, scb


def check_int8_scales(scb) -> None:
    """The one check of an int8 weight's row scales: a row that is not finite
    after the float16 rounding (|w| > 65504) is refused, named by index."""
    bad = np.nonzero(~np.isfinite(np.asarray(scb)))[0]
    if bad.size:
        raise ValueError(
            f"cannot quantize: weight rows {bad[:8].tolist()} are not finite after rounding to "
            "float16 (float16 holds at most 65504)"
        )


def dequantize_weight_int8(cb: np.ndarray, scb: np.ndarray) -> np.ndarray:
    return (np.asarray(cb, np.float32) * (np.asarray(scb, np.float32)[:, None] / np.float32(127))).astype(np.float32)
