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


MSE_FRACTIONS = np.array([(32 - j) / 32 for j in range(16)], F32)


def mse_errors(blk: np.ndarray, quant_type: str) -> tuple[np.ndarray, np.ndarray]:
    """(candidate scales [16], their errors [16]) of one full block as the
    'mse' search defines them: d_i = x_i - fp32(value * s) with the value of
    the nearest code of fp32(x_i * fp32(1 / floor(s))); per lane l = i mod 8 a
    sequential fp32 sum of fp32(d_i^2); lanes combined ((0+1)+(2+3))+((4+5)+(6+7))."""
    blk = np.asarray(blk, F32)
    amax = _absmax(blk)
    scales = (amax * MSE_FRACTIONS).astype(F32)
    errs = np.empty(16, F32)
    with np.errstate(over="ignore"):
        for j, s in enumerate(scales):
            errs[j] = _mse_error(blk, s, quant_type)
    return scales, errs


def _mse_error(blk: np.ndarray, s: F32, quant_type: str) -> F32:
    inv = F32(1.0) / _floor(s)
    v = (blk * inv).astype(F32)
    d = (blk - (TABLES[quant_type][encode4(v, quant_type)] * s).astype(F32)).astype(F32)
    d2 = (d * d).astype(F32)
    lane = [np.cumsum(d2[k::8], dtype=F32)[-1] for k in range(8)]
    return ((lane[0] + lane[1]) + (lane[2] + lane[3])) + ((lane[4] + lane[5]) + (lane[6] + lane[7]))


def mse_scale(blk: np.ndarray, quant_type: str) -> F32:
    """The 'mse' scale of a full block: the candidate of smallest error (ties:
    the first, the larger scale); a block whose absmax is 0, NaN or inf keeps it."""
    amax = _absmax(np.asarray(blk, F32))
    if not (amax > 0) or not np.isfinite(amax):
        return amax
    scales, errs = mse_errors(blk, quant_type)
    return scales[int(np.argmin(errs))]


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


# ------------------------------------------------------------------ 8-bit
# The 8-bit blockwise format as bitsandbytes 0.50.2 computes it on the CPU:
# each value is scaled into [-1, 1], placed in one of 65536 bins, and the bin
# is mapped to a code through a table built from the code book's midpoints.

BINS = 65536
_TABLES: dict[bytes, np.ndarray] = {}


def bin_positions() -> np.ndarray:
    """Position of bin k in [-1, 1]: fp32(fp32(2k) / 65535) - 1."""
    k = np.arange(BINS).astype(F32)
    return ((F32(2) * k) / F32(BINS - 1) - F32(1)).astype(F32)


def bin_table(code: np.ndarray) -> np.ndarray:
    """bin -> code index. With mid[j] = fp32(fp32(code[j] + code[j+1]) * 0.5),
    table[k] = the first j < 255 with not(mid[j] < pos(k)), else 255. (The
    format builds it as one scan over the bins with a never-decreasing j; since
    pos(k) never decreases, that scan stops at exactly this j.)"""
    code = np.asarray(code, F32)
    key = code.tobytes()
    if key not in _TABLES:
        with np.errstate(invalid="ignore", over="ignore"):
            mids = ((code[:-1] + code[1:]) * F32(0.5)).astype(F32)
            stop = ~(mids[:, None] < bin_positions()[None, :])  # [255, BINS]
        _TABLES[key] = np.where(stop.any(axis=0), stop.argmax(axis=0), 255).astype(np.uint8)
    return _TABLES[key]


def bins_of(s: np.ndarray) -> np.ndarray:
    """Bin of s = x * (1/absmax): c = s clamped to [-1, 1] (NaN stays NaN),
    t = fp32(fp32(c + 1) * 0.5), bin = trunc(fp32(65535 t + 0.5)) with a single
    rounding (a fused multiply-add); NaN -> 0. Evaluated in integers: t is a
    multiple of 2^-25, so 65535 t + 0.5 = Y / 2^25 exactly with an integer Y,
    rounded here to 24 significant bits, half to even."""
    s = np.asarray(s, F32)
    with np.errstate(invalid="ignore"):
        c = np.where(F32(-1) > s, F32(-1), np.where(s > F32(1), F32(1), s)).astype(F32)
        t = ((c + F32(1)) * F32(0.5)).astype(F32)
    nan = np.isnan(t)
    scaled = np.where(nan, 0.0, t.astype(np.float64)) * 2.0**25
    m = scaled.astype(np.int64)
    assert np.array_equal(m, scaled), "t must be a multiple of 2^-25"
    y = 65535 * m + 2**24  # < 2^42
    width = np.frexp(y.astype(np.float64))[1].astype(np.int64)  # bit length (y < 2^53 is exact)
    shift = np.maximum(width - 24, 0)
    q = y >> shift
    rem = y - (q << shift)
    half = np.int64(1) << np.maximum(shift - 1, 0)
    q = q + ((shift > 0) & ((rem > half) | ((rem == half) & ((q & 1) == 1))))
    k = (q << shift) >> 25
    return np.where(nan, 0, k).astype(np.int64)


def absmax8(blk: np.ndarray) -> F32:
    """max |x| over the non-NaN elements; 0 when there are none."""
    a = np.abs(blk[~np.isnan(blk)])
    return F32(max(F32(0), a.max())) if a.size else F32(0)


def quantize_blockwise(x: np.ndarray, blocksize: int, code: np.ndarray | None = None):
    """8-bit: per block absmax = absmax8; a zero absmax gives code 0 for the
    whole block, else code = bin_table(code)[bins_of(fp32(x * fp32(1/absmax)))]."""
    code = dynamic_map() if code is None else np.asarray(code, F32)
    table = bin_table(code)
    x = np.asarray(x, F32).reshape(-1)
    out = np.zeros(x.size, np.uint8)
    absmax = []
    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
        for start, end in _blocks(x.size, blocksize):
            amax = absmax8(x[start:end])
            absmax.append(amax)
            if amax != 0:
                s = (x[start:end] * (F32(1) / amax)).astype(F32)
                out[start:end] = table[bins_of(s)]
    return out, np.array(absmax, F32)


def dequantize_blockwise(codes, absmax, blocksize: int, code=None, offset=None) -> np.ndarray:
    code = dynamic_map() if code is None else np.asarray(code, F32)
    codes = np.asarray(codes).reshape(-1)
    scale = np.repeat(np.asarray(absmax, F32), blocksize)[: codes.size]
    with np.errstate(invalid="ignore", over="ignore"):
        out = (code[codes] * scale).astype(F32)
        return out if offset is None else (out + F32(offset)).astype(F32)


# ------------------------------------------------------------------ nested
# offset = PyTorch's CPU float32 mean of the absmax vector: a cascade sum in
# fp32 with a fixed order, divided by fp32(n).


def _ceil_log2(x: int) -> int:
    return 1 if x <= 2 else int(x - 1).bit_length()


def _cascade(rows: np.ndarray) -> np.ndarray:
    """Column sums of rows [size, W]: groups of 2^p rows (p = max(4,
    ceil_log2(size) // 4)) summed in order; group sums pushed through three
    accumulator levels that carry up at multiples of 2^2p and 2^3p rows; the
    rows after the last whole group summed in order, then + the levels."""
    size, width = rows.shape
    p = max(4, _ceil_log2(size) // 4)
    step, mask = 1 << p, (1 << p) - 1
    acc = np.zeros((4, width), F32)
    groups = size // step
    gsum = np.zeros((groups, width), F32)
    g = rows[: groups * step].reshape(groups, step, width)
    for r in range(step):
        gsum += g[:, r]
    i = 0
    for grp in range(groups):
        acc[0] += gsum[grp]
        i += step
        for j in range(1, 4):
            acc[j] += acc[j - 1]
            acc[j - 1] = 0
            if i & (mask << (j * p)):
                break
    for r in range(groups * step, size):
        acc[0] += rows[r]
    for j in range(1, 4):
        acc[0] += acc[j]
    return acc[0]


def _serial_sum(x: np.ndarray) -> F32:
    n = x.size
    if n < 8:  # scalar path: 4 columns of rows of 4, the rest into column 0
        q = n // 4
        p = _cascade(x[: q * 4].reshape(q, 4))
        for k in range(q * 4, n):
            p[0] += x[k]
        s = p[0]
        for k in range(1, 4):
            s = F32(s + p[k])
    else:  # 8-lane vectors, 4 per row: rows of 32 columns
        vecs = n // 8
        rows = vecs // 4
        p = _cascade(x[: rows * 32].reshape(rows, 32)).reshape(4, 8)
        for v in range(rows * 4, vecs):
            p[0] += x[8 * v : 8 * v + 8]
        for k in range(1, 4):
            p[0] += p[k]
        s = F32(0)
        for k in range(vecs * 8, n):
            s = F32(s + x[k])
        for lane in range(8):
            s = F32(s + p[0][lane])
    return F32(F32(0) + s)


def torch_sum(x: np.ndarray, threads: int = 1) -> F32:
    """PyTorch's CPU float32 sum of a contiguous vector with `threads`
    intra-op threads: from 32768 values on, one chunk of ceil(n / T) values per
    thread (T = min(threads, ceil(n / 32768))), the chunk sums then summed."""
    x = np.asarray(x, F32).reshape(-1)
    n = x.size
    if n < 32768 or threads == 1:
        return _serial_sum(x)
    used = min(threads, -(-n // 32768))
    chunk = -(-n // used)
    partial = np.zeros(threads, F32)
    for t in range(used):
        if t * chunk < n:
            partial[t] = F32(F32(0) + _serial_sum(x[t * chunk : min(n, (t + 1) * chunk)]))
    return F32(F32(0) + _serial_sum(partial))


def torch_mean(x: np.ndarray, threads: int = 1) -> F32:
    x = np.asarray(x, F32).reshape(-1)
    with np.errstate(invalid="ignore", over="ignore"):
        return F32(torch_sum(x, threads) / F32(x.size))


def quantize_nested(absmax: np.ndarray, code: np.ndarray | None = None, threads: int = 1):
    """offset = torch_mean(absmax) (q4: one thread); 8-bit blockwise (256) of fp32(absmax - offset)."""
    absmax = np.asarray(absmax, F32).reshape(-1)
    offset = torch_mean(absmax, threads)
    with np.errstate(invalid="ignore", over="ignore"):
        centred = (absmax - offset).astype(F32)
    codes, absmax2 = quantize_blockwise(centred, 256, code)
    return codes, absmax2, offset


# ------------------------------------------------------------------ W4A8
# gemm_4bit_w4a8, from its definition (README "W4A8", kernels/include/q4/w4a8.h):
# activations quantized to int8 per row in blocks of Ba = min(64, blocksize),
# codes as int8 values round(S * table) (S = 112 for NF4, 120 for FP4, halves
# away from zero), sw = absmax * fp32(1 / S), exact integer block sums, then
# acc = acc + fp32(fp32(isum) * fp32(sx * sw)) block by block, + bias.

W4A8_TABLE_SCALE = {"nf4": F32(112), "fp4": F32(120)}


def w4a8_table(quant_type: str) -> np.ndarray:
    s = TABLES[quant_type].astype(np.float64) * np.float64(W4A8_TABLE_SCALE[quant_type])
    return (np.sign(s) * np.floor(np.abs(s) + 0.5)).astype(np.int64)


def w4a8_activations(x: np.ndarray, ba: int) -> tuple[np.ndarray, np.ndarray]:
    """(q int64 [m, k], sx fp32 [m, k // ba]) of fp32 x [m, k]."""
    m, k = x.shape
    blocks = x.reshape(m, k // ba, ba).astype(F32)
    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
        amax = np.max(np.abs(blocks), axis=2)  # NaN if a value is NaN
        nonfinite = ~np.isfinite(amax)
        inv = np.where(nonfinite | (amax == 0), F32(0), F32(127) / np.where(amax == 0, F32(1), amax)).astype(F32)
    tiny = ~np.isfinite(inv)  # 127 / amax overflows
    inv = np.where(tiny, F32(0), inv).astype(F32)
    sx = np.where(nonfinite, F32(np.nan), np.where(tiny | (amax == 0), F32(0), amax / F32(127))).astype(F32)
    with np.errstate(invalid="ignore"):
        q = np.rint(blocks * inv[:, :, None]).astype(F32)
    q = np.where(inv[:, :, None] == 0, F32(0), q).astype(np.int64)
    return q.reshape(m, k), sx


def gemm_4bit_w4a8(x, packed, absmax, n: int, k: int, blocksize: int, quant_type: str, bias=None) -> np.ndarray:
    """fp32 Y [m, n] (before the rounding to the output dtype) for fp32 x [m, k]
    and a 4-bit W [n, k] (packed, fp32 absmax per block)."""
    ba = min(64, blocksize)
    x = np.asarray(x, F32)
    m = x.shape[0]
    q, sx = w4a8_activations(x, ba)
    w8 = w4a8_table(quant_type)[unpack(packed, n * k)].reshape(n, k)
    nb = k // ba
    first = (np.arange(n)[:, None] * k + np.arange(nb)[None, :] * ba) // blocksize
    sw = (np.asarray(absmax, F32)[first] * (F32(1) / W4A8_TABLE_SCALE[quant_type])).astype(F32)  # [n, nb]
    acc = np.zeros((m, n), F32)
    with np.errstate(invalid="ignore", over="ignore"):
        for b in range(nb):
            isum = q[:, b * ba : (b + 1) * ba] @ w8[:, b * ba : (b + 1) * ba].T  # exact int64
            s = (sx[:, b, None] * sw[None, :, b]).astype(F32)
            acc = (acc + (isum.astype(F32) * s).astype(F32)).astype(F32)
        if bias is not None:
            acc = (acc + np.asarray(bias, F32)[None, :]).astype(F32)
    return acc
