"""Independent numpy oracle for the q4 formats.

Written from the format definitions in DESIGN.md, not from the kernels: the
tables are restated here on purpose (the one deliberate copy), and every
operation is plain vectorised numpy in fp32 (fp64 only where the definition
says so). Inputs are fp32 arrays (fp16/bf16 inputs widen exactly to fp32).
"""

from __future__ import annotations

import numpy as np

F32 = np.float32

NF4 = np.array(
    [
        -1.0,
        -0.6961928009986877,
        -0.5250730514526367,
        -0.39491748809814453,
        -0.28444138169288635,
        -0.18477343022823334,
        -0.09105003625154495,
        0.0,
        0.07958029955625534,
        0.16093020141124725,
        0.24611230194568634,
        0.33791524171829224,
        0.44070982933044434,
        0.5626170039176941,
        0.7229568362236023,
        1.0,
    ],
    F32,
)

# FP4: bit 3 = sign, bits 0..2 index these magnitudes; all / 12. The "-0"
# pattern (nibble 8) is +0.0 in the format.
_FP4_MAGNITUDES = np.array([0, 0.0625, 8, 12, 4, 6, 2, 3], F32)
FP4 = np.concatenate([_FP4_MAGNITUDES, -_FP4_MAGNITUDES]).astype(F32) / F32(12)
FP4[8] = F32(0.0)

TABLES = {"nf4": NF4, "fp4": FP4}
ABSMAX_FLOOR = F32(1e-38)


def dynamic_map() -> np.ndarray:
    """Signed 8-bit dynamic map: for i = 0..6, 2^i means of linspace(0.1, 1,
    2^i + 1) scaled by 10^(i-6), both signs; plus 0 and 1; rounded to fp32 and
    sorted. The format evaluates the linspace in fp32 with a platform routine, so
    this exact-arithmetic version agrees to within 2 ulp (the library table is
    compared bit for bit with bitsandbytes' separately)."""
    data = []
    for i in range(7):
        bounds = np.linspace(0.1, 1, 2**i + 1, dtype=np.float64).astype(F32)
        means = ((bounds[:-1] + bounds[1:]) / F32(2)).astype(np.float64)
        data += list(10.0 ** (-6 + i) * means)
        data += list(-(10.0 ** (-6 + i)) * means)
    data += [0.0, 1.0]
    return np.array(sorted(data), F32)


def _blocks(n: int, bs: int):
    for start in range(0, n, bs):
        yield start, min(n, start + bs)


def _absmax(x: np.ndarray) -> F32:
    return F32(np.max(np.abs(x))) if not np.isnan(x).any() else F32(np.nan)


def _floor(a: F32) -> F32:
    return a if np.isnan(a) else max(a, ABSMAX_FLOOR)


def encode4(s: np.ndarray, quant_type: str) -> np.ndarray:
    """Nearest code: rank = #midpoints m with not(s <= m) over the values sorted
    with a stable sort; NaN ranks above every midpoint."""
    table = TABLES[quant_type]
    order = np.argsort(table, kind="stable")
    v = table[order]
    mids = ((v[:-1] + v[1:]) / F32(2)).astype(F32)
    rank = np.sum(~(s[:, None] <= mids[None, :]), axis=1)
    return order[rank].astype(np.uint8)


def quantize_4bit(x: np.ndarray, blocksize: int, quant_type: str):
    """-> (packed uint8 [ceil(n/2)], absmax f32 [n_blocks])."""
    x = np.asarray(x, F32).reshape(-1)
    n = x.size
    codes = np.empty(n + (n & 1), np.uint8)
    absmax = []
    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
        for start, end in _blocks(n, blocksize):
            blk = x[start:end]
            amax = _absmax(blk)
            if end - start == blocksize:
                s = blk * (F32(1.0) / _floor(amax))
                absmax.append(amax)
            else:
                s = blk / _floor(amax)
                absmax.append(_floor(amax))
            codes[start:end] = encode4(s.astype(F32), quant_type)
    if n & 1:
        codes[n] = encode4(np.zeros(1, F32), quant_type)[0]
    packed = (codes[0::2] << 4) | codes[1::2]
    return packed.astype(np.uint8), np.array(absmax, F32)


def unpack(packed: np.ndarray, n: int) -> np.ndarray:
    p = np.asarray(packed, np.uint8).reshape(-1)
    codes = np.empty(p.size * 2, np.uint8)
    codes[0::2] = p >> 4
    codes[1::2] = p & 15
    return codes[:n]


def dequantize_4bit(packed, absmax, n: int, blocksize: int, quant_type: str) -> np.ndarray:
    """fp32 values: table[nibble] * absmax[block]."""
    codes = unpack(packed, n)
    scale = np.repeat(np.asarray(absmax, F32), blocksize)[:n]
    with np.errstate(invalid="ignore", over="ignore"):
        return (TABLES[quant_type][codes] * scale).astype(F32)


def quantize_blockwise(x: np.ndarray, blocksize: int, code: np.ndarray | None = None):
    """8-bit: per block absmax = max|x|; index = argmin_j |fp32(code[j]*absmax) - x|
    (first index on ties); NaN -> 255. A block with an infinite absmax uses the
    nearest code to x * (1/absmax) instead."""
    code = dynamic_map() if code is None else np.asarray(code, F32)
    x = np.asarray(x, F32).reshape(-1)
    out = np.empty(x.size, np.uint8)
    absmax = []
    with np.errstate(invalid="ignore", over="ignore"):
        for start, end in _blocks(x.size, blocksize):
            blk = x[start:end]
            amax = _absmax(blk)
            absmax.append(amax)
            if np.isinf(amax):
                s = blk * (F32(1) / amax)
                idx = np.argmin(np.abs(code[None, :] - s[:, None]), axis=1).astype(np.uint8)
                idx[np.isnan(s)] = 255
            else:
                recon = (code[None, :] * _floor(amax)).astype(F32)
                idx = np.argmin(np.abs(recon - blk[:, None]), axis=1).astype(np.uint8)
            idx[np.isnan(blk) | np.isnan(amax)] = 255
            out[start:end] = idx
    return out, np.array(absmax, F32)


def dequantize_blockwise(codes, absmax, blocksize: int, code=None, offset=None) -> np.ndarray:
    code = dynamic_map() if code is None else np.asarray(code, F32)
    codes = np.asarray(codes).reshape(-1)
    scale = np.repeat(np.asarray(absmax, F32), blocksize)[: codes.size]
    with np.errstate(invalid="ignore", over="ignore"):
        out = (code[codes] * scale).astype(F32)
        return out if offset is None else (out + F32(offset)).astype(F32)


def quantize_nested(absmax: np.ndarray, code: np.ndarray | None = None):
    """offset = fp32(mean in fp64); 8-bit blockwise (256) of fp32(absmax - offset)."""
    absmax = np.asarray(absmax, F32)
    offset = F32(np.mean(absmax.astype(np.float64)))
    codes, absmax2 = quantize_blockwise((absmax - offset).astype(F32), 256, code)
    return codes, absmax2, offset
