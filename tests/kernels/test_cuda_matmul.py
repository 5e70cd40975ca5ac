"""The CUDA fused matmuls and LLM.int8 kernels against the CPU kernels, through the two C ABIs.

Invariants checked (CPU results from the q4 numpy API, CUDA results from the
q4_cuda_* entry points on torch CUDA tensors and torch's current stream):

- gemm_4bit / gemm_4bit_grad_input accumulate in fp32 in a different order
  than the CPU, so they are compared with an fp64 reference of the same
  product (the weight dequantized exactly as the kernels decode it): the
  worst error relative to sum |x| |w| is at most 4x the CPU path's error, or
  4x sqrt(reduction length) fp32 units when the CPU happens to be closer than
  that, plus one unit roundoff of the output dtype.
- int8_quantize_rows writes the CPU's bytes and bits (NaN at the same places).
- int8_linear (exact int32 accumulation, the fp32 epilogue and outlier sums
  in the CPU's order) and int8_grad_input (sums over n in order, one rounded
  multiply and add per term) are designed bit-exact with the CPU: checked
  both within the tolerance above and bit for bit.

Shapes cover the fast paths (k % 32 == 0: 16-byte gemv loads; k % 8 == 0:
word decode) and the per-element fallbacks (k odd, blocks straddling rows),
m from 1 (gemv) to 300 (tiled). Kernel launches need a GPU; the argument
checks run on any build with the CUDA kernels.
"""

from __future__ import annotations

import ctypes
import dataclasses
import zlib

import ml_dtypes
import numpy as np
import pytest

import q4
from q4._src import native

torch = pytest.importorskip("torch")

if not q4.has_cuda():
    pytest.skip(f"{q4.library_path()} was built without the CUDA kernels", allow_module_level=True)

# q4's loader declares every op of the library's op list, CPU and CUDA
LIB = native.lib()

requires_gpu = pytest.mark.skipif(q4.cuda_device_count() == 0, reason="no CUDA device")

DEVICE = "cuda"
DTYPES = ("float32", "float16", "bfloat16")
NP_DTYPES = {"float32": np.float32, "float16": np.float16, "bfloat16": ml_dtypes.bfloat16}
TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
DTYPE_CODES = {"float32": 0, "float16": 1, "bfloat16": 2}
QUANT_TYPE_CODES = {"nf4": 0, "fp4": 1}
UNIT_ROUNDOFF = {"float32": 2.0**-24, "float16": 2.0**-11, "bfloat16": 2.0**-8}
NESTED_BLOCKSIZE = 256

MS = (1, 2, 7, 64, 300)
# (n, k): k % 32 == 0 with two gemv chunks per lane; k % 8 == 0 with blocks
# straddling rows; k odd (per-element paths, n*k odd: a padded last nibble)
SHAPES = ((128, 2048), (72, 200), (37, 77))


# ------------------------------------------------------------------ helpers


def rng_for(test_id: str) -> np.random.Generator:
    return np.random.default_rng(zlib.crc32(test_id.encode()))


def stream() -> ctypes.c_void_p:
    return ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)


def to_device(a: np.ndarray) -> torch.Tensor:
    """A device tensor holding a's bytes (bfloat16 travels as its uint16 bits)."""
    a = np.ascontiguousarray(a)
    if a.dtype == ml_dtypes.bfloat16:
        return torch.from_numpy(a.view(np.uint16).copy()).view(torch.bfloat16).to(DEVICE)
    return torch.from_numpy(a.copy()).to(DEVICE)


def to_host(t: torch.Tensor) -> np.ndarray:
    t = t.cpu()
    if t.dtype == torch.bfloat16:
        return t.view(torch.uint16).numpy().view(ml_dtypes.bfloat16)
    return t.numpy()


def empty(shape, dtype: str) -> torch.Tensor:
    return torch.empty(shape, dtype=TORCH_DTYPES[dtype], device=DEVICE)


def ptr(t: torch.Tensor | None) -> ctypes.c_void_p | None:
    return None if t is None else ctypes.c_void_p(t.data_ptr())


def call_cuda(op: str, *args) -> None:
    status = getattr(LIB, "q4_cuda_" + op)(*args, stream())
    assert status == 0, f"q4_cuda_{op}: status {status}: {LIB.q4_cuda_last_error().decode()}"


def relative_error(y: np.ndarray, ref: np.ndarray, bound: np.ndarray) -> float:
    """max |y - ref| / bound, bound = the matching sum of |products|."""
    err = np.abs(np.asarray(y, np.float64) - ref)
    return float(np.max(err / np.maximum(bound, np.finfo(np.float64).tiny)))


def assert_close(cuda: np.ndarray, cpu: np.ndarray, ref: np.ndarray, bound: np.ndarray, length: int, dtype: str):
    """The CUDA error is at most 4x the CPU's (floored at sqrt(length) fp32
    units, the typical fp32 accumulation error) plus one output unit roundoff."""
    assert cuda.shape == cpu.shape and cuda.dtype == cpu.dtype
    assert np.isfinite(np.asarray(cuda, np.float64)).all(), "non-finite CUDA result"
    e_cpu = relative_error(cpu, ref, bound)
    e_cuda = relative_error(cuda, ref, bound)
    limit = 4.0 * max(e_cpu, np.sqrt(length) * UNIT_ROUNDOFF["float32"]) + UNIT_ROUNDOFF[dtype]
    assert e_cuda <= limit, f"CUDA relative error {e_cuda:.3g} > {limit:.3g} (CPU {e_cpu:.3g})"


def assert_same_bits(cuda: np.ndarray, cpu: np.ndarray, what: str) -> None:
    """Equal bits, except that NaN payloads may differ (NaN at the same places)."""
    assert cuda.shape == cpu.shape and cuda.dtype == cpu.dtype, what
    if cpu.dtype.kind == "f" or cpu.dtype == ml_dtypes.bfloat16:
        nan = np.isnan(np.asarray(cpu, np.float32))
        assert np.array_equal(nan, np.isnan(np.asarray(cuda, np.float32))), f"{what}: NaN positions differ"
        bits = np.uint32 if cpu.dtype.itemsize == 4 else np.uint16
        diff = np.flatnonzero((cpu.view(bits) != cuda.view(bits)) & ~nan)
    else:
        diff = np.flatnonzero(cpu != cuda)
    if diff.size:
        i = int(diff[0])
        raise AssertionError(
            f"{what}: {diff.size} of {cpu.size} elements differ; first at {i}: cpu {cpu.flat[i]!r}, cuda {cuda.flat[i]!r}"
        )


# ------------------------------------------------------------------ 4-bit


@dataclasses.dataclass
class Weight4:
    """A quantized W [n, k] on the host and the device, plus W as the kernels decode it."""

    packed: np.ndarray
    state: q4.QuantState
    dequantized: np.ndarray  # fp32 [n, k]: decode(nibble) * scale, the value every kernel uses
    device: dict  # device tensors: packed, absmax (plain) or codes + absmax2 (nested)

    def scale_args(self, nested_code: torch.Tensor | None = None) -> tuple:
        """The 7 scale arguments of the C ABI, pointing at device memory."""
        d, s = self.device, self.state
        if s.nested:
            n2 = d["absmax2"].numel()
            args = (None, ptr(d["codes"]), ptr(d["absmax2"]), n2, ptr(nested_code), float(s.nested_offset))
        else:
            args = (ptr(d["absmax"]), None, None, 0, None, 0.0)
        return (*args, s.n_blocks)


def make_weight(rng: np.random.Generator, n: int, k: int, blocksize: int, quant_type: str, nested: bool) -> Weight4:
    w = (rng.standard_normal((n, k)) * 0.05).astype(np.float32)
    packed, absmax = q4.quantize_4bit(w, blocksize, quant_type)
    if nested:
        codes, absmax2, offset = q4.quantize_nested(absmax)
        state = q4.QuantState(quant_type, blocksize, (n, k), "float32", codes, absmax2, float(offset))
        scales = q4.dequantize_blockwise(codes, absmax2, NESTED_BLOCKSIZE, offset=offset)
        device = {"codes": to_device(codes), "absmax2": to_device(absmax2)}
    else:
        state = q4.QuantState(quant_type, blocksize, (n, k), "float32", absmax)
        scales = absmax
        device = {"absmax": to_device(absmax)}
    device["packed"] = to_device(packed.reshape(-1))
    dequantized = q4.dequantize_4bit(packed, scales, (n, k), blocksize, quant_type)
    return Weight4(packed, state, dequantized, device)


def make_input(rng: np.random.Generator, shape, dtype: str) -> np.ndarray:
    return rng.standard_normal(shape).astype(np.float32).astype(NP_DTYPES[dtype])


def cuda_gemm_4bit(x, w: Weight4, bias=None, packed=None, nested_code=None, op="gemm_4bit") -> np.ndarray:
    """x: device tensor [m, k]; returns Y [m, n] on the host (x's dtype);
    op="gemm_4bit_w4a8": the W4A8 kernel, same arguments."""
    (n, k), m = w.state.shape, x.shape[0]
    dtype = str(x.dtype).removeprefix("torch.")
    out = empty((m, n), dtype)
    packed = w.device["packed"] if packed is None else packed
    call_cuda(
        op,
        ptr(x),
        DTYPE_CODES[dtype],
        m,
        n,
        k,
        ptr(packed),
        (n * k + 1) // 2,
        *w.scale_args(nested_code),
        w.state.blocksize,
        QUANT_TYPE_CODES[w.state.quant_type],
        ptr(bias),
        DTYPE_CODES[dtype] if bias is not None else 0,
        ptr(out),
        DTYPE_CODES[dtype],
    )
    return to_host(out)


def cuda_gemm_4bit_grad_input(dy, w: Weight4, packed=None) -> np.ndarray:
    (n, k), m = w.state.shape, dy.shape[0]
    dtype = str(dy.dtype).removeprefix("torch.")
    dx = empty((m, k), dtype)
    packed = w.device["packed"] if packed is None else packed
    call_cuda(
        "gemm_4bit_grad_input",
        ptr(dy),
        DTYPE_CODES[dtype],
        m,
        n,
        k,
        ptr(packed),
        (n * k + 1) // 2,
        *w.scale_args(),
        w.state.blocksize,
        QUANT_TYPE_CODES[w.state.quant_type],
        ptr(dx),
        DTYPE_CODES[dtype],
    )
    return to_host(dx)


def forward_reference(x: np.ndarray, w: np.ndarray, bias: np.ndarray | None):
    """(Y, sum |products|) in fp64."""
    x64, w64 = np.asarray(x, np.float64), np.asarray(w, np.float64)
    ref, bound = x64 @ w64.T, np.abs(x64) @ np.abs(w64).T
    if bias is not None:
        b = np.asarray(bias, np.float64)
        ref, bound = ref + b, bound + np.abs(b)
    return ref, bound


GEMM_CASES = [
    pytest.param(m, n, k, bs, qt, nested, dt, id=f"m{m}-{n}x{k}-{qt}-bs{bs}-{'nested' if nested else 'plain'}-{dt}")
    for m in MS
    for n, k in SHAPES
    for bs in (64, 256)
    for qt in QUANT_TYPE_CODES
    for nested in (False, True)
    for dt in DTYPES
]


@requires_gpu
@pytest.mark.parametrize("m, n, k, bs, qt, nested, dt", GEMM_CASES)
def test_gemm_4bit(request, m, n, k, bs, qt, nested, dt):
    """Y = x W^T (+ bias for odd m) within the tolerance of the CPU kernel."""
    rng = rng_for(request.node.callspec.id)
    w = make_weight(rng, n, k, bs, qt, nested)
    x = make_input(rng, (m, k), dt)
    bias = make_input(rng, (n,), dt) if m % 2 else None
    cpu = q4.gemm_4bit(x, w.packed, w.state, bias)
    cuda = cuda_gemm_4bit(to_device(x), w, None if bias is None else to_device(bias))
    ref, bound = forward_reference(x, w.dequantized, bias)
    assert_close(cuda, cpu, ref, bound, k, dt)


W4A8_CASES = [
    (m, n, k, bs, qt, nested, dt)
    for m in (1, 7, 64)
    for n, k in ((128, 2048), (72, 192))
    for bs in (32, 64, 256)
    for qt in QUANT_TYPE_CODES
    for nested in (False, True)
    for dt in DTYPES
]


@requires_gpu
@pytest.mark.parametrize("m, n, k, bs, qt, nested, dt", W4A8_CASES)
def test_gemm_4bit_w4a8_equals_the_cpu_bits(request, m, n, k, bs, qt, nested, dt):
    """W4A8's contract (q4/w4a8.h) fixes every operation and its order: the
    CUDA kernel gives the CPU's bytes."""
    rng = rng_for(request.node.callspec.id)
    w = make_weight(rng, n, k, bs, qt, nested)
    x = make_input(rng, (m, k), dt)
    bias = make_input(rng, (n,), dt) if m % 2 else None
    cpu = q4.gemm_4bit(x, w.packed, w.state, bias, activation_quant="int8")
    cuda = cuda_gemm_4bit(to_device(x), w, None if bias is None else to_device(bias), op="gemm_4bit_w4a8")
    assert cuda.dtype == cpu.dtype and cuda.tobytes() == cpu.tobytes()


@requires_gpu
@pytest.mark.parametrize("m, n, k, bs, qt, nested, dt", GEMM_CASES)
def test_gemm_4bit_grad_input(request, m, n, k, bs, qt, nested, dt):
    """dX = dY W within the tolerance of the CPU kernel."""
    rng = rng_for(request.node.callspec.id)
    w = make_weight(rng, n, k, bs, qt, nested)
    dy = make_input(rng, (m, n), dt)
    cpu = q4.gemm_4bit_grad_input(dy, w.packed, w.state)
    cuda = cuda_gemm_4bit_grad_input(to_device(dy), w)
    dy64, w64 = np.asarray(dy, np.float64), np.asarray(w.dequantized, np.float64)
    assert_close(cuda, cpu, dy64 @ w64, np.abs(dy64) @ np.abs(w64), n, dt)


@requires_gpu
@pytest.mark.parametrize("m", [1, 2, 64])
def test_misaligned_pointers_take_the_fallback_paths(request, m):
    """x and the packed weight one element / byte off alignment: the 16-byte
    and 4-byte paths are skipped, the results stay within tolerance."""
    rng = rng_for(request.node.callspec.id)
    n, k, dt = 128, 2048, "float16"
    w = make_weight(rng, n, k, 64, "nf4", True)
    x = make_input(rng, (m, k), dt)
    x_buf = to_device(np.concatenate([np.zeros(1, x.dtype), x.reshape(-1)]))
    packed_buf = to_device(np.concatenate([np.zeros(1, np.uint8), w.packed.reshape(-1)]))
    cuda = cuda_gemm_4bit(x_buf[1:].view(m, k), w, packed=packed_buf[1:])
    ref, bound = forward_reference(x, w.dequantized, None)
    assert_close(cuda, q4.gemm_4bit(x, w.packed, w.state), ref, bound, k, dt)

    dy = make_input(rng, (m, n), dt)
    dx = cuda_gemm_4bit_grad_input(to_device(dy), w, packed=packed_buf[1:])
    dy64, w64 = np.asarray(dy, np.float64), np.asarray(w.dequantized, np.float64)
    assert_close(dx, q4.gemm_4bit_grad_input(dy, w.packed, w.state), dy64 @ w64, np.abs(dy64) @ np.abs(w64), n, dt)


@requires_gpu
@pytest.mark.parametrize("m", [1, 64])
def test_explicit_nested_code_book_equals_the_default(request, m):
    """nested_code = the dynamic map in device memory gives the bits of nested_code = NULL."""
    rng = rng_for(request.node.callspec.id)
    w = make_weight(rng, 72, 256, 64, "fp4", True)
    x = to_device(make_input(rng, (m, 256), "float32"))
    book = to_device(np.array(q4.code_table("dynamic")))
    assert_same_bits(cuda_gemm_4bit(x, w, nested_code=book), cuda_gemm_4bit(x, w), "gemm_4bit output")


@requires_gpu
def test_gemm_on_a_side_stream():
    """Enqueued on a non-default stream (torch's current one inside the context)."""
    rng = rng_for("gemm-side-stream")
    w = make_weight(rng, 128, 2048, 64, "nf4", False)
    x = make_input(rng, (7, 2048), "bfloat16")
    x_d = to_device(x)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        cuda = cuda_gemm_4bit(x_d, w)
    ref, bound = forward_reference(x, w.dequantized, None)
    assert_close(cuda, q4.gemm_4bit(x, w.packed, w.state), ref, bound, 2048, "bfloat16")


# ------------------------------------------------------------------ LLM.int8


def make_int8_input(rng: np.random.Generator, shape, dtype: str, threshold: float) -> np.ndarray:
    """randn with, for threshold > 0, a few outlier columns (and values exactly at the threshold)."""
    x = rng.standard_normal(shape).astype(np.float32)
    if threshold > 0:
        cols = rng.choice(shape[1], size=max(1, shape[1] // 16), replace=False)
        x[:, cols] *= 4.0
        x[rng.integers(0, shape[0]), cols[0]] = threshold
    return x.astype(NP_DTYPES[dtype])


def make_int8_weight(rng: np.random.Generator, n: int, k: int):
    cb = rng.integers(-127, 128, (n, k)).astype(np.int8)
    cb.flat[rng.integers(0, cb.size, max(1, cb.size // 97))] = -128  # dp4a sign handling
    scb = (np.abs(rng.standard_normal(n)) * 0.1 + 0.01).astype(np.float32)
    return cb, scb


def cuda_int8_quantize_rows(x: np.ndarray, threshold: float, with_cols: bool = True):
    rows, cols = x.shape
    q = torch.empty((rows, cols), dtype=torch.int8, device=DEVICE)
    stats = torch.empty(rows, dtype=torch.float32, device=DEVICE)
    flags = torch.empty(cols, dtype=torch.uint8, device=DEVICE) if with_cols else None
    x_d = to_device(x)
    call_cuda(
        "int8_quantize_rows",
        ptr(x_d),
        DTYPE_CODES[x.dtype.name],
        rows,
        cols,
        float(threshold),
        ptr(q),
        ptr(stats),
        ptr(flags),
    )
    return to_host(q), to_host(stats), None if flags is None else to_host(flags).astype(bool)


QUANTIZE_ROWS_CASES = [
    pytest.param(rows, cols, thr, dt, id=f"{rows}x{cols}-thr{thr:g}-{dt}")
    for rows, cols in ((1, 77), (7, 256), (300, 200))
    for thr in (0.0, 3.0)
    for dt in DTYPES
]


@requires_gpu
@pytest.mark.parametrize("rows, cols, thr, dt", QUANTIZE_ROWS_CASES)
def test_int8_quantize_rows_matches_cpu_bits(request, rows, cols, thr, dt):
    """Same q bytes, row_stats bits and outlier columns, including an all-zero
    row and a row with a NaN."""
    rng = rng_for(request.node.callspec.id)
    x = make_int8_input(rng, (rows, cols), "float32", thr)
    if rows >= 7:
        x[3] = 0.0
        x[4, cols // 2] = np.nan
    x = x.astype(NP_DTYPES[dt])
    q, stats, flags = q4.int8_quantize_rows(x, thr)
    q_d, stats_d, flags_d = cuda_int8_quantize_rows(x, thr)
    assert_same_bits(q_d, q, "q")
    assert_same_bits(stats_d, stats, "row_stats")
    assert np.array_equal(flags_d, flags), "outlier columns"
    q_d, stats_d, _ = cuda_int8_quantize_rows(x, thr, with_cols=False)  # temporary flags on the device
    assert_same_bits(q_d, q, "q (no outlier_cols output)")
    assert_same_bits(stats_d, stats, "row_stats (no outlier_cols output)")


INT8_CASES = [
    pytest.param(m, n, k, thr, dt, id=f"m{m}-{n}x{k}-thr{thr:g}-{dt}")
    for m in MS
    for n, k in ((128, 512), (72, 200), (37, 77))
    for thr in (0.0, 3.0)
    for dt in DTYPES
]


@requires_gpu
@pytest.mark.parametrize("m, n, k, thr, dt", INT8_CASES)
def test_int8_linear(request, m, n, k, thr, dt):
    rng = rng_for(request.node.callspec.id)
    cb, scb = make_int8_weight(rng, n, k)
    x = make_int8_input(rng, (m, k), dt, thr)
    bias = make_input(rng, (n,), dt) if m % 2 else None
    cpu = q4.int8_linear(x, cb, scb, thr, bias)

    out = empty((m, n), dt)
    x_d, cb_d, scb_d = to_device(x), to_device(cb), to_device(scb)
    bias_d = None if bias is None else to_device(bias)
    call_cuda(
        "int8_linear",
        ptr(x_d),
        DTYPE_CODES[dt],
        m,
        n,
        k,
        ptr(cb_d),
        ptr(scb_d),
        float(thr),
        ptr(bias_d),
        DTYPE_CODES[dt] if bias is not None else 0,
        ptr(out),
        DTYPE_CODES[dt],
    )
    cuda = to_host(out)

    # fp64 reference of the op's definition, from the CPU's (bit-identical) row quantization
    q, stats, cols = q4.int8_quantize_rows(x, thr)
    q64, cb64, x64 = q.astype(np.float64), cb.astype(np.float64), np.asarray(x, np.float64)
    s = stats.astype(np.float64)[:, None] * scb.astype(np.float64)[None, :] / 127.0**2
    wd = cb64[:, cols] * scb.astype(np.float64)[:, None] / 127.0
    ref = (q64 @ cb64.T) * s + x64[:, cols] @ wd.T
    bound = (np.abs(q64) @ np.abs(cb64).T) * s + np.abs(x64[:, cols]) @ np.abs(wd).T
    if bias is not None:
        ref, bound = ref + np.asarray(bias, np.float64), bound + np.abs(np.asarray(bias, np.float64))
    assert_close(cuda, cpu, ref, bound, k, dt)
    assert_same_bits(cuda, cpu, "int8_linear output")


@requires_gpu
@pytest.mark.parametrize("m, n, k, thr, dt", [c for c in INT8_CASES if c.values[3] == 0.0])
def test_int8_grad_input(request, m, n, k, thr, dt):
    del thr  # the backward has no threshold
    rng = rng_for(request.node.callspec.id)
    cb, scb = make_int8_weight(rng, n, k)
    dy = make_input(rng, (m, n), dt)
    cpu = q4.int8_grad_input(dy, cb, scb)

    dx = empty((m, k), dt)
    dy_d, cb_d, scb_d = to_device(dy), to_device(cb), to_device(scb)
    call_cuda("int8_grad_input", ptr(dy_d), DTYPE_CODES[dt], m, n, k, ptr(cb_d), ptr(scb_d), ptr(dx), DTYPE_CODES[dt])
    cuda = to_host(dx)

    dy64 = np.asarray(dy, np.float64)
    w64 = cb.astype(np.float64) * scb.astype(np.float64)[:, None] / 127.0
    assert_close(cuda, cpu, dy64 @ w64, np.abs(dy64) @ np.abs(w64), n, dt)
    assert_same_bits(cuda, cpu, "int8_grad_input output")


# ---------------------------------------------- argument checks (no GPU needed)
# Validation happens on the host before any launch; the fake pointer is never
# dereferenced because a check fails first. CPU and CUDA share the messages.

FAKE = ctypes.c_void_p(16)


def both(op: str, *args) -> tuple[int, bytes]:
    """Status and message of the CUDA entry point, checked equal to the CPU's."""
    cuda_status = getattr(LIB, "q4_cuda_" + op)(*args, None)
    cuda_message = LIB.q4_cuda_last_error()
    cpu_status = getattr(LIB, "q4_" + op)(*args)
    assert (cuda_status, cuda_message) == (cpu_status, LIB.q4_last_error())
    return cuda_status, cuda_message


def gemm_args(blocksize=64, packed_size=50, n_blocks=2, nested_absmax_size=0, nested=False):
    """gemm_4bit arguments for x [1, 100] and W [1, 100] with one field off."""
    scales = (
        (None, FAKE, FAKE, nested_absmax_size, None, 0.0, n_blocks)
        if nested
        else (FAKE, None, None, 0, None, 0.0, n_blocks)
    )
    return (FAKE, 0, 1, 1, 100, FAKE, packed_size, *scales, blocksize, 0, None, 0, FAKE, 0)


def test_gemm_4bit_rejects_a_bad_blocksize():
    assert both("gemm_4bit", *gemm_args(blocksize=48)) == (
        1,
        b"blocksize must be a power of two in [32, 4096], got 48",
    )


def test_gemm_4bit_w4a8_rejects_k_off_the_block():
    status, message = both("gemm_4bit_w4a8", *gemm_args())
    assert status == 1 and b"multiple of 64" in message and b"got k = 100" in message


def test_gemm_4bit_rejects_wrong_sizes():
    assert both("gemm_4bit", *gemm_args(packed_size=49)) == (1, b"packed weight has 49 elements, expected 50")
    assert both("gemm_4bit", *gemm_args(n_blocks=3)) == (
        1,
        b"absmax has 3 elements, expected 2 (ceil(100 / blocksize 64))",
    )
    assert both("gemm_4bit", *gemm_args(nested=True, nested_absmax_size=2)) == (
        1,
        b"nested absmax has 2 elements, expected 1",
    )


def test_gemm_4bit_grad_input_rejects_bad_arguments():
    scales = (FAKE, None, None, 0, None, 0.0, 2)
    status, message = both("gemm_4bit_grad_input", FAKE, 0, 0, 1, 100, FAKE, 50, *scales, 64, 0, FAKE, 0)
    assert status == 1 and b"dimensions must be positive" in message
    status, message = both("gemm_4bit_grad_input", FAKE, 0, 1, 1, 100, FAKE, 50, *scales, 64, 2, FAKE, 0)
    assert (status, message) == (1, b"quant_type must be 0 (nf4) or 1 (fp4), got 2")


def test_int8_ops_reject_bad_arguments():
    status, message = both("int8_quantize_rows", FAKE, 0, 2, 3, -1.0, FAKE, FAKE, None)
    assert status == 1 and message.startswith(b"threshold must be >= 0")
    assert both("int8_grad_input", FAKE, 0, 1, 1, 1, None, FAKE, FAKE, 0) == (1, b"int8 weight is a null pointer")
    status, message = both("int8_linear", FAKE, 0, 1, 1, 1, FAKE, FAKE, 0.0, None, 0, FAKE, 7)
    assert status == 1 and b"output dtype" in message


def test_int8_linear_rejects_k_beyond_the_int32_accumulator():
    k_max = (1 << 31) // (128 * 127) - 1
    status, message = both("int8_linear", FAKE, 0, 1, 1, k_max + 1, FAKE, FAKE, 0.0, None, 0, FAKE, 0)
    assert status == 1
    assert message == f"int8 linear: k = {k_max + 1} overflows the int32 accumulator (max {k_max})".encode()
