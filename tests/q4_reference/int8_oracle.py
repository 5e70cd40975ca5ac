"""Independent numpy oracle for the LLM.int8 kernels (row-wise quantization,
the int8 linear and its input gradient).

Written from the definitions (kernels.h, the header of kernels/cpu/int8.cc
and bitsandbytes 0.50.2's int8_vectorwise_quant), not from the kernels.
Two kinds of answer:

- exact values: the quantization (fp32 element operations, as defined), the
  int32 dot products (computed in int64), and the fp64 value of each formula
  (`*_f64`), which is what a tolerance is measured against;
- the documented fp32 evaluation order (`*_f32`), which the kernels promise
  to follow bit for bit in both the scalar and the AVX2 path.

Inputs are fp32 arrays (fp16 / bf16 widen exactly to fp32).
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

F32 = np.float32
INV127 = F32(1) / F32(127)  # fp32(1/127)
INV127SQ = F32(1) / F32(16129)  # fp32(1/127^2)
U32 = 2.0**-24  # unit roundoff of fp32


STORAGE = {"float32": np.float32, "float16": np.float16, "bfloat16": ml_dtypes.bfloat16}


def outlier_cut(threshold: float, dtype: str = "float32") -> np.float32:
    """The value |x| is compared with: fp32(threshold) rounded to x's storage
    dtype (torch compares `A.abs() >= threshold` in A's dtype)."""
    with np.errstate(over="ignore"):
        return F32(np.array(F32(threshold)).astype(STORAGE[dtype]).astype(F32))


def quantize_rows(x: np.ndarray, threshold: float = 0.0, dtype: str = "float32"):
    """LLM.int8 row-wise quantization of x [rows, cols] (fp32 values of an
    array stored as `dtype`).

    Returns (q int8 [rows, cols], row_stats fp32 [rows], outlier_cols bool [cols]):
      outlier element: threshold > 0 and |x| >= outlier_cut(threshold, dtype);
      outlier column: holds one;
      row_stats = max |x| over the row's non-outlier elements (NaN propagates);
      mult = fp32(fp32(1 / row_stats) * 127)  (torch's `127.0 / t` is t.reciprocal() * 127);
      q = round_half_even(clamp(fp32(x * mult), -127, 127)), 0 for a NaN product,
      0 in every outlier column.
    """
    x = np.asarray(x, F32)
    a = np.abs(x)
    outlier = a >= outlier_cut(threshold, dtype) if threshold > 0 else np.zeros(x.shape, bool)
    cols = outlier.any(axis=0)
    row_stats = np.where(outlier, F32(0), a).max(axis=1).astype(F32)
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        mult = (F32(1) / row_stats) * F32(127)
        s = x * mult[:, None]
    s = np.where(np.isnan(s), F32(0), s)
    q = np.rint(np.clip(s, F32(-127), F32(127))).astype(np.int8)
    q[:, cols] = 0
    return q, row_stats, cols


def int_dot(q: np.ndarray, weight: np.ndarray) -> np.ndarray:
    """acc[m, n] = sum_k q[m, k] * weight[n, k], exact (int64)."""
    return q.astype(np.int64) @ weight.astype(np.int64).T


def dequantize_weight_f64(weight: np.ndarray, weight_scale: np.ndarray) -> np.ndarray:
    """W = CB * SCB / 127 in fp64."""
    return weight.astype(np.float64) * np.asarray(weight_scale, np.float64)[:, None] / 127.0


def linear_f64(x, weight, weight_scale, threshold=0.0, bias=None, dtype="float32"):
    """Exact value of the int8 linear given its quantization of x:
    acc * row_stats * SCB / 127^2 + x[:, outlier cols] . W[:, outlier cols]^T (+ bias), in fp64.
    Returns (y fp64 [m, n], terms fp64 [m, n]) where terms bounds the sum of
    the magnitudes of everything added (for error bounds)."""
    x = np.asarray(x, F32)
    q, row_stats, cols = quantize_rows(x, threshold, dtype)
    acc = int_dot(q, weight).astype(np.float64)
    scale = np.asarray(row_stats, np.float64)[:, None] * np.asarray(weight_scale, np.float64)[None, :]
    y = acc * scale / 16129.0
    terms = np.abs(y)
    if threshold > 0 and cols.any():
        xo = x[:, cols].astype(np.float64)
        wo = dequantize_weight_f64(weight[:, cols], weight_scale)
        y = y + xo @ wo.T
        terms = terms + np.abs(xo) @ np.abs(wo).T
    if bias is not None:
        b = np.asarray(bias, np.float64)[None, :]
        y = y + b
        terms = terms + np.abs(b)
    return y, terms


def linear_f32(x, weight, weight_scale, threshold=0.0, bias=None, dtype="float32") -> np.ndarray:
    """The int8 linear in its documented fp32 evaluation order (before the
    final rounding to the output dtype):
      y = fp32(fp32(float(acc) * fp32(row_stats[m] * SCB[n])) * fp32(1/127^2))
      wd[n, c] = fp32(fp32(float(CB[n, c]) * SCB[n]) * fp32(1/127))
      o = ((0 + x[m, c0] * wd[n, c0]) + x[m, c1] * wd[n, c1]) + ...   (ascending c)
      y = y + o (when there is an outlier column); y = y + bias[n]."""
    x = np.asarray(x, F32)
    scb = np.asarray(weight_scale, F32)
    q, row_stats, cols = quantize_rows(x, threshold, dtype)
    acc = int_dot(q, weight)
    assert np.abs(acc).max(initial=0) < 2**31
    with np.errstate(over="ignore", invalid="ignore"):
        y = (acc.astype(np.int32).astype(F32) * (row_stats[:, None] * scb[None, :])) * INV127SQ
        if threshold > 0 and cols.any():
            o = np.zeros(y.shape, F32)
            for c in np.flatnonzero(cols):
                wd = (weight[:, c].astype(F32) * scb) * INV127
                o = o + x[:, c : c + 1] * wd[None, :]
            y = y + o
        if bias is not None:
            y = y + np.asarray(bias, F32)[None, :]
    return y.astype(F32)


def linear_error_bound(terms: np.ndarray, n_outlier_cols: int) -> np.ndarray:
    """Bound on |linear_f32 - linear_f64| from fp32 rounding, each rounding a
    relative error <= u on a quantity bounded by `terms`: the integer part
    has 5 (float(acc), row_stats * SCB, fp32(1/127^2), two products); an
    outlier term has 4 (SCB product, fp32(1/127), its product, x * wd) plus
    one per addition of the running sum; then y + o and + bias."""
    return (7 + 4 * n_outlier_cols) * 1.01 * U32 * terms


def grad_input_f64(grad_out, weight, weight_scale) -> np.ndarray:
    """dX = dY . (CB * SCB / 127), fp64."""
    return np.asarray(grad_out, np.float64) @ dequantize_weight_f64(weight, weight_scale)


def grad_input_error_bound(grad_out, weight, weight_scale) -> np.ndarray:
    """Bound on the fp32 error of dX summed over n terms: each term is
    rounded twice before the sum (scale, product) and the running sum adds
    one rounding per term, so |err| <= (n + 3) u sum_n |term|."""
    n = weight.shape[0]
    mag = np.abs(np.asarray(grad_out, np.float64)) @ np.abs(dequantize_weight_f64(weight, weight_scale))
    return (n + 3) * 1.01 * U32 * mag


def grad_input_f32(grad_out, weight, weight_scale) -> np.ndarray:
    """dX in the documented fp32 order: g = fp32(dY * fp32(SCB * fp32(1/127)));
    acc = 0; for n in order: acc = fp32(acc + fp32(g[:, n] * CB[n, :]))."""
    dy = np.asarray(grad_out, F32)
    g = dy * (np.asarray(weight_scale, F32) * INV127)[None, :]
    wf = weight.astype(F32)
    acc = np.zeros((dy.shape[0], weight.shape[1]), F32)
    for j in range(weight.shape[0]):
        acc = acc + g[:, j : j + 1] * wf[j][None, :]
    return acc
