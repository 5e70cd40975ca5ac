"""Error-minimising 4-bit quantizers that write the bitsandbytes format.

Any loader computes ``decode(nibble) * absmax[block]``, so a quantizer may
choose each block's stored absmax (its scale) and each code to lower the
error; the bytes stay bitsandbytes' format. Framework-neutral numpy, shared by
both front ends (identical inputs give identical bytes); the code book, its
midpoints and the packing come from the kernel library's tables.

Encoding rule (the kernels' quantize_4bit, q4/nf4.h, q4/fp4.h): with scale s,
``v = fp32(x * fp32(1 / max(s, 1e-38)))`` and the code is the rank of v among
the sorted midpoints (``!(v <= midpoint)``) mapped to its nibble. With s the
block's absmax this is exactly quantize_4bit (tested), so both methods start
from the plain result and only move away from it where the error drops.

- ``mse`` (no data): per block, the stored absmax is the candidate
  ``fp32(absmax * (32 - j) / 32)``, j = 0..15, whose nearest-code encoding has
  the smallest squared error (fp32, summed in a fixed order: the kernels'
  search_scales_4bit, vectorised); ties keep the larger scale. Values beyond
  the chosen scale clip to the end codes.
- ``gptq`` (calibration data): GPTQ (Frantar et al. 2022) on W [out, in] with
  the Hessian H = sum x x^T of the layer's inputs: columns quantized in
  order, each one's error fed forward through the upper Cholesky factor of
  H^-1 (damping ``damp * mean(diag H)``); a block's scales are fixed when its
  first column is reached (``scales="mse"`` or ``"absmax"`` over the current,
  error-updated block), so in_features must be a multiple of the block.
"""

from __future__ import annotations

import functools
import math

import numpy as np

from q4._src import formats
from q4._src.kernels import encode_4bit, quantize_4bit, quantize_blockwise, quantize_nested, search_scales_4bit
from q4._src.quant_state import QuantState

METHODS = ("absmax", "mse", "gptq")
_FLOOR = np.float32(1e-38)


def check_method(method) -> str:
    if not isinstance(method, str) or method not in METHODS:
        raise ValueError(f"method must be one of {', '.join(METHODS)}, got {formats.short_repr(method)}")
    return method


def check_method_options(method, quant_type: str, calibration, damp: float = 0.01) -> None:
    """What replace_linear / quantize_model accept: a known method, for the
    4-bit types, with calibration exactly when it is 'gptq', and a positive
    GPTQ damping."""
    check_method(method)
    if not (isinstance(damp, (int, float)) and damp > 0):
        raise ValueError(f"gptq_damp must be > 0, got {formats.short_repr(damp)}")
    if not math.isfinite(damp):
        raise ValueError(f"gptq_damp must be finite, got {damp}")
    if method != "absmax" and quant_type == "int8":
        raise ValueError(f"method={method!r} applies to the 4-bit layers (quant_type 'nf4' or 'fp4'), not to 'int8'")
    if (method == "gptq") != (calibration is not None):
        raise ValueError("method='gptq' needs calibration=<batches of model inputs>, and only it takes calibration")


@functools.cache
def _book(quant_type: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(midpoints of the sorted values [15], nibble of each rank [16], value of
    each nibble [16]) in fp32, from the library's code table."""
    values = formats.code_table(quant_type).astype(np.float32)
    order = np.argsort(values, kind="stable")  # ties (fp4's +-0) keep the lower nibble first
    s = values[order]
    mids = ((s[:-1] + s[1:]) / np.float32(2)).astype(np.float32)
    return mids, order.astype(np.uint8), values


def encode(x: np.ndarray, scale: np.ndarray, quant_type: str) -> np.ndarray:
    """Nibbles (uint8, x's shape) of fp32 ``x`` [..., k] with per-row scales
    ``scale`` [..., 1] by the kernels' rule (module docstring)."""
    mids, nibble_of_rank, _ = _book(quant_type)
    inv = (np.float32(1) / np.maximum(scale.astype(np.float32), _FLOOR)).astype(np.float32)
    with np.errstate(invalid="ignore", over="ignore"):
        v = (x.astype(np.float32) * inv).astype(np.float32)
    # rank = #midpoints m with !(v <= m) = #midpoints < v (NaN sorts last: 15)
    return nibble_of_rank[np.searchsorted(mids, v, side="left")]


def decode(nibbles: np.ndarray, scale: np.ndarray, quant_type: str) -> np.ndarray:
    """fp32 values decode(nibble) * scale, as dequantize_4bit computes them."""
    return (_book(quant_type)[2][nibbles] * scale.astype(np.float32)).astype(np.float32)


def search_scales(blocks: np.ndarray, quant_type: str) -> np.ndarray:
    """The ``mse`` scale [nb, 1] of each row of fp32 ``blocks`` [nb, bs]: the
    kernels' search (q4/kernels.h search_scales_4bit; its error sum is fp32 in
    a fixed order); a block with a NaN or inf keeps its absmax."""
    return search_scales_4bit(blocks, quant_type)[:, None]


def pack(nibbles: np.ndarray) -> np.ndarray:
    """Flattened nibbles (an even count) -> bytes (n/2, 1), the even element in the high nibble."""
    flat = nibbles.reshape(-1)
    if flat.size % 2:
        raise ValueError(f"pack takes an even number of nibbles, got {flat.size}")
    return ((flat[0::2] << 4) | flat[1::2]).astype(np.uint8).reshape(-1, 1)


def quant_state(
    w: np.ndarray, absmax: np.ndarray, blocksize: int, quant_type: str, nested: bool, dtype: str | None = None
) -> QuantState:
    """The validated QuantState of a 4-bit ``w`` quantized with per-block
    ``absmax`` (fp32), nested by the kernels when ``nested``; its dtype is
    ``dtype`` or w's. Every host-side 4-bit quantizer ends here."""
    state = QuantState(quant_type, blocksize, tuple(int(s) for s in w.shape), dtype or w.dtype.name, absmax)
    if nested:
        codes, absmax2, offset = quantize_nested(absmax)
        if not np.isfinite(offset):
            codes, absmax2, offset = nested_fallback(absmax, blocksize)
        state.absmax, state.nested_absmax, state.nested_offset = codes, absmax2, float(offset)
    return state.validate()


def check_nested_absmax(absmax: np.ndarray, blocksize: int) -> None:
    """Nested statistics hold finite scales only: a block whose absmax is NaN
    or Inf (a NaN or Inf in the weight) would make the nested offset, and so
    every block of the layer, decode to NaN. ValueError naming the blocks."""
    bad = np.nonzero(~np.isfinite(absmax))[0]
    if bad.size:
        first = bad[0] * blocksize
        raise ValueError(
            f"the weight holds NaN or Inf (in {bad.size} of {absmax.size} blocks of {blocksize}, the first one "
            f"starting at element {first}: absmax {absmax[bad[0]]}); nested statistics (compress_statistics / nested) would "
            "turn every block of the layer into NaN: fix the weight, or quantize it without nested statistics"
        )


def nested_fallback(absmax: np.ndarray, blocksize: int):
    """The nested statistics of finite ``absmax`` whose float32 mean overflows
    (scales near the float32 limit: the kernel's cascade sum, bitsandbytes',
    reaches Inf): the offset is the float64 mean rounded to float32, then the
    same 8-bit quantize of fp32(absmax - offset) in blocks of 256. Non-finite
    absmax: check_nested_absmax's error."""
    check_nested_absmax(absmax, blocksize)
    offset = np.float32(np.mean(absmax, dtype=np.float64))
    centred = (absmax.astype(np.float32) - offset).astype(np.float32)
    codes, absmax2 = quantize_blockwise(centred, formats.nested_blocksize(), formats.code_table("dynamic"))
    return codes, absmax2, offset


def quantize_mse(
    w: np.ndarray, blocksize: int, quant_type: str, nested: bool, dtype: str | None = None
) -> tuple[np.ndarray, QuantState]:
    """(packed, QuantState) of ``w`` with the ``mse`` scales. Starts from the
    plain kernel result (its blocks, including a partial last block, and its
    bytes wherever the full absmax stays the best scale)."""
    w = np.asarray(w)
    packed, absmax = quantize_4bit(w, blocksize, quant_type)
    x = w.astype(np.float32).reshape(-1)
    n_full = x.size // blocksize
    if n_full:
        blocks = x[: n_full * blocksize].reshape(n_full, blocksize)
        s = search_scales(blocks, quant_type)
        moved = (s[:, 0] != absmax[:n_full]) & np.isfinite(s[:, 0])
        if moved.any():
            nib = encode_4bit(blocks[moved], s[moved, 0], quant_type).reshape(-1, blocksize // 2)
            full = packed[: n_full * blocksize // 2].reshape(n_full, blocksize // 2)
            full[moved] = nib
            absmax = absmax.copy()
            absmax[:n_full] = np.where(moved, s[:, 0], absmax[:n_full])
    return packed, quant_state(w, absmax, blocksize, quant_type, nested, dtype)


def gptq(
    w: np.ndarray,
    hessian: np.ndarray,
    blocksize: int,
    quant_type: str,
    nested: bool,
    *,
    scales: str = "mse",
    damp: float = 0.01,
    dtype: str | None = None,
) -> tuple[np.ndarray, QuantState]:
    """(packed, QuantState) of W [out, in] by GPTQ with ``hessian`` [in, in]
    (sum of x x^T over the calibration inputs; module docstring). ``dtype``
    names the weight's dtype in the state (default: w's)."""
    w = np.asarray(w)
    if w.ndim != 2:
        raise ValueError(f"gptq quantizes a 2-D weight [out, in], got shape {tuple(w.shape)}")
    n_out, n_in = w.shape
    if n_in % blocksize:
        raise ValueError(f"gptq needs in_features to be a multiple of the block size {blocksize}, got {n_in}")
    h = np.array(hessian, np.float64)
    if h.shape != (n_in, n_in) or not np.isfinite(h).all():
        raise ValueError(f"the Hessian must be a finite [{n_in}, {n_in}] matrix, got shape {tuple(h.shape)}")
    if scales not in ("mse", "absmax"):
        raise ValueError(f"scales must be 'mse' or 'absmax', got {formats.short_repr(scales)}")
    if not damp > 0:
        raise ValueError(f"damp must be > 0, got {damp}")
    if not math.isfinite(damp):
        raise ValueError(f"damp must be finite, got {damp}")
    dead = np.diag(h) <= 0  # inputs never seen: no error to feed them
    h[dead, dead] = 1.0
    h[np.diag_indices(n_in)] += damp * float(np.mean(np.diag(h)))
    try:
        u = np.linalg.cholesky(np.linalg.inv(h)).T  # upper: H^-1 = U^T U
    except np.linalg.LinAlgError as exc:
        raise ValueError(
            f"gptq: the damped Hessian ({n_in}x{n_in}, damp={damp}) is not positive definite ({exc}): raise the "
            "damping (e.g. 0.01 to 0.1) or add calibration data"
        ) from None
    work = w.astype(np.float64)
    nibbles = np.zeros((n_out, n_in), np.uint8)
    absmax = np.zeros((n_out, n_in // blocksize), np.float32)
    for g0 in range(0, n_in, blocksize):
        g1 = g0 + blocksize
        block = work[:, g0:g1].astype(np.float32)
        s = search_scales(block, quant_type) if scales == "mse" else np.abs(block).max(axis=1, keepdims=True)
        absmax[:, g0 // blocksize] = s[:, 0]
        err = np.zeros((n_out, blocksize))
        for i in range(g0, g1):
            col = work[:, i : i + 1].astype(np.float32)
            q = encode(col, s, quant_type)
            nibbles[:, i] = q[:, 0]
            e = (work[:, i] - decode(q, s, quant_type)[:, 0].astype(np.float64)) / u[i, i]
            err[:, i - g0] = e
            work[:, i + 1 : g1] -= np.outer(e, u[i, i + 1 : g1])
        work[:, g1:] -= err @ u[g0:g1, g1:]
    return pack(nibbles), quant_state(w, absmax.reshape(-1), blocksize, quant_type, nested, dtype)


class HessianAccumulator:
    """Sum of x x^T (fp64) over a layer's calibration inputs, fed as arrays
    [..., in] (with an optional mask over the leading dimensions: rows where
    it is 0 are padding and left out). Rows are buffered and summed in
    chunks of at least ``chunk`` rows, in the order they arrive, so the same
    inputs in the same order give the same sum."""

    def __init__(self, n_in: int, chunk: int = 4096):
        self._h = np.zeros((n_in, n_in), np.float64)
        self._pending: list[np.ndarray] = []
        self._pending_rows = 0
        self._chunk = chunk
        self.rows = 0

    def add(self, x: np.ndarray, mask: np.ndarray | None = None) -> None:
        x = np.asarray(x)
        rows = x.reshape(-1, x.shape[-1])
        if mask is not None and tuple(mask.shape) == tuple(x.shape[:-1]):
            rows = rows[np.asarray(mask).reshape(-1) != 0]
        self._pending.append(np.asarray(rows, np.float64))
        self._pending_rows += rows.shape[0]
        self.rows += rows.shape[0]
        if self._pending_rows >= self._chunk:
            self._flush()

    def _flush(self) -> None:
        if self._pending:
            rows = np.concatenate(self._pending)
            self._h += rows.T @ rows
            self._pending, self._pending_rows = [], 0

    @property
    def h(self) -> np.ndarray:
        self._flush()
        return self._h


def check_gptq_layers(layers: list[tuple[str, int]], blocksize: int) -> None:
    """(name, in_features) of the layers GPTQ will quantize: each must hold whole blocks per row."""
    bad = [name for name, k in layers if k % blocksize]
    if bad:
        raise ValueError(
            f"method='gptq' needs in_features to be a multiple of the block size {blocksize}: {bad[:8]}; "
            "skip them (skip=...) or use method='mse'"
        )


def run_calibration(model, calibration, mask: list, to_numpy, log) -> None:
    """Call ``model`` on each calibration item (a dict: keyword arguments, its
    'attention_mask' put in ``mask[0]`` as numpy; a tuple / list: positional
    arguments; anything else: the one argument), logging progress."""
    for i, batch in enumerate(calibration):
        if isinstance(batch, dict) or hasattr(batch, "keys") and hasattr(batch, "__getitem__"):
            m = batch.get("attention_mask")
            mask[0] = None if m is None else to_numpy(m)
            model(**batch)
        elif isinstance(batch, (tuple, list)):
            mask[0] = None
            model(*batch)
        else:
            mask[0] = None
            model(batch)
        log("calibration batch %d", i + 1)


def hessians(accs: dict, names: dict) -> dict:
    """The accumulated Hessians by key; a layer that saw no input is an error naming it."""
    unseen = [names[i] for i, a in accs.items() if a.rows == 0]
    if unseen:
        raise ValueError(f"method='gptq': these layers saw no calibration input: {unseen[:8]}; skip them (skip=...)")
    return {i: a.h for i, a in accs.items()}
