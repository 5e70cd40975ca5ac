"""The CUDA kernels against the CPU kernels, through the two C ABIs.

Invariant: for every op, the CUDA entry point (q4_cuda_*) writes the same
bytes as the CPU entry point (q4_*) given the same input: packed nibbles and
8-bit codes byte for byte, absmax / offsets / dequantized values bit for bit.
The one exception is the payload of a NaN (x86 propagates an operand's
payload, CUDA returns the canonical NaN): NaN positions must match, payloads
are not part of the format.

The library is loaded with ctypes from $Q4_LIBRARY (else the library the q4
package loads); device memory comes from torch CUDA tensors and work is
enqueued on torch's current stream. Tests that launch kernels run only where a
GPU is present; the argument-check tests run on any build with CUDA kernels.
"""

from __future__ import annotations

import ctypes
import os
import zlib

import numpy as np
import pytest
from q4_reference import inputs

from q4._src import formats

torch = pytest.importorskip("torch")

_PATH = os.environ.get("Q4_LIBRARY")
if not _PATH:
    import q4

    _PATH = str(q4.library_path())
LIB = ctypes.CDLL(_PATH)
if not LIB.q4_has_cuda():
    pytest.skip(f"{_PATH} was built without the CUDA kernels", allow_module_level=True)

_v, _i32, _i64, _f32 = ctypes.c_void_p, ctypes.c_int32, ctypes.c_int64, ctypes.c_float
_ARGS = {
    "quantize_4bit": [_v, _i32, _i64, _i64, _i32, _v, _i64, _v, _i64],
    "dequantize_4bit": [_v, _i64, _v, _i64, _i64, _i64, _i32, _v, _i32],
    "quantize_blockwise": [_v, _i32, _i64, _i64, _v, _v, _i64, _v, _i64],
    "dequantize_blockwise": [_v, _i64, _v, _i64, _i64, _v, _i32, _f32, _v, _i32],
    "quantize_nested": [_v, _i64, _v, _v, _i64, _v],
}
for _name, _argtypes in _ARGS.items():
    getattr(LIB, "q4_" + _name).argtypes = _argtypes
    getattr(LIB, "q4_" + _name).restype = _i32
    getattr(LIB, "q4_cuda_" + _name).argtypes = [*_argtypes, _v]
    getattr(LIB, "q4_cuda_" + _name).restype = _i32
for _name in ("q4_last_error", "q4_cuda_last_error"):
    getattr(LIB, _name).restype = ctypes.c_char_p
    getattr(LIB, _name).argtypes = []
LIB.q4_cuda_device_count.restype = _i32
LIB.q4_cuda_device_count.argtypes = []

requires_gpu = pytest.mark.skipif(LIB.q4_cuda_device_count() == 0, reason="no CUDA device")

# the C ABI's codes, as the library's Python side defines them
DTYPES = {
    "f32": (torch.float32, formats.DTYPE_CODES["float32"]),
    "f16": (torch.float16, formats.DTYPE_CODES["float16"]),
    "bf16": (torch.bfloat16, formats.DTYPE_CODES["bfloat16"]),
}
DTYPE_CODE = {t: code for t, code in DTYPES.values()}
QUANT_TYPES = formats.QUANT_TYPE_CODES
NESTED_BLOCKSIZE = 256


def _ptr(t: torch.Tensor | None) -> ctypes.c_void_p | None:
    return None if t is None else ctypes.c_void_p(t.data_ptr())


def _call(name: str, device: torch.device, *args) -> None:
    if device.type == "cuda":
        stream = ctypes.c_void_p(torch.cuda.current_stream(device).cuda_stream)
        status = getattr(LIB, "q4_cuda_" + name)(*args, stream)
        message = LIB.q4_cuda_last_error
    else:
        status = getattr(LIB, "q4_" + name)(*args)
        message = LIB.q4_last_error
    assert status == 0, f"{name} on {device}: status {status}: {message().decode()}"


# Each op: allocate outputs next to the input and call the device's entry point.
def quantize_4bit(x, blocksize, qt):
    n = x.numel()
    packed = torch.empty((n + 1) // 2, dtype=torch.uint8, device=x.device)
    absmax = torch.empty(-(-n // blocksize), dtype=torch.float32, device=x.device)
    _call(
        "quantize_4bit",
        x.device,
        _ptr(x),
        DTYPE_CODE[x.dtype],
        n,
        blocksize,
        qt,
        _ptr(packed),
        packed.numel(),
        _ptr(absmax),
        absmax.numel(),
    )
    return packed, absmax


def dequantize_4bit(packed, absmax, n, blocksize, qt, dtype):
    out = torch.empty(n, dtype=dtype, device=packed.device)
    _call(
        "dequantize_4bit",
        packed.device,
        _ptr(packed),
        packed.numel(),
        _ptr(absmax),
        absmax.numel(),
        n,
        blocksize,
        qt,
        _ptr(out),
        DTYPE_CODE[dtype],
    )
    return out


def quantize_blockwise(x, blocksize, code):
    n = x.numel()
    codes = torch.empty(n, dtype=torch.uint8, device=x.device)
    absmax = torch.empty(-(-n // blocksize), dtype=torch.float32, device=x.device)
    _call(
        "quantize_blockwise",
        x.device,
        _ptr(x),
        DTYPE_CODE[x.dtype],
        n,
        blocksize,
        _ptr(code),
        _ptr(codes),
        n,
        _ptr(absmax),
        absmax.numel(),
    )
    return codes, absmax


def dequantize_blockwise(codes, absmax, blocksize, code, add_offset, offset, dtype):
    out = torch.empty(codes.numel(), dtype=dtype, device=codes.device)
    _call(
        "dequantize_blockwise",
        codes.device,
        _ptr(codes),
        codes.numel(),
        _ptr(absmax),
        absmax.numel(),
        blocksize,
        _ptr(code),
        int(add_offset),
        offset,
        _ptr(out),
        DTYPE_CODE[dtype],
    )
    return out


def quantize_nested(absmax):
    n = absmax.numel()
    codes = torch.empty(n, dtype=torch.uint8, device=absmax.device)
    absmax2 = torch.empty(-(-n // NESTED_BLOCKSIZE), dtype=torch.float32, device=absmax.device)
    offset = torch.empty(1, dtype=torch.float32, device=absmax.device)
    _call("quantize_nested", absmax.device, _ptr(absmax), n, _ptr(codes), _ptr(absmax2), absmax2.numel(), _ptr(offset))
    return codes, absmax2, offset


def assert_same_bits(cpu: torch.Tensor, cuda: torch.Tensor, what: str) -> None:
    """Equal bytes; for floats equal bits outside NaN and NaN at the same places."""
    got = cuda.cpu()
    assert got.dtype == cpu.dtype and got.shape == cpu.shape, what
    if cpu.dtype == torch.uint8:
        diff = (cpu != got).nonzero().flatten()
    else:
        nan = torch.isnan(cpu)
        assert torch.equal(nan, torch.isnan(got)), f"{what}: NaN positions differ"
        bits = torch.int32 if cpu.element_size() == 4 else torch.int16
        diff = ((cpu.view(bits) != got.view(bits)) & ~nan).nonzero().flatten()
    if diff.numel():
        i = int(diff[0])
        raise AssertionError(
            f"{what}: {diff.numel()} of {cpu.numel()} elements differ; first at {i}: cpu {cpu[i].item()!r}, "
            f"cuda {got[i].item()!r}"
        )


def rng_for(test_id: str) -> np.random.Generator:
    return np.random.default_rng(zlib.crc32(test_id.encode()))


def make_input(rng: np.random.Generator, n: int, blocksize: int, kind: str) -> np.ndarray:
    """fp32 test data. 'special': the shared special values (+-0, denormals,
    huge values, code points) plus an all-zero block, a denormal block, a
    constant block, a NaN and an inf."""
    if kind == "randn":
        return (rng.standard_normal(n) * 3.0).astype(np.float32)
    x = inputs.special_values(rng, n)
    starts = np.arange(0, n, blocksize)

    def block() -> slice:
        s = int(rng.choice(starts))
        return slice(s, min(n, s + blocksize))

    x[block()] = 0.0
    b = block()
    x[b] = (rng.standard_normal(b.stop - b.start) * 1e-39).astype(np.float32)
    x[block()] = np.float32(0.3)
    x[int(rng.integers(0, n))] = np.nan
    x[int(rng.integers(0, n))] = -np.inf
    return x


def to_torch(x: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    return torch.from_numpy(x).to(dtype)


SHAPES = [(7,), (64, 64), (33, 65), (3, 4099)]
QUANT4_CASES = [
    pytest.param(qt, bs, dt, shape, kind, id=f"{qt}-bs{bs}-{dt}-{'x'.join(map(str, shape))}-{kind}")
    for qt in QUANT_TYPES
    for bs in (32, 64, 256, 4096)
    for dt in DTYPES
    for shape in SHAPES
    for kind in ("randn", "special")
]


@requires_gpu
@pytest.mark.parametrize("qt, bs, dt, shape, kind", QUANT4_CASES)
def test_4bit_matches_cpu(request, qt, bs, dt, shape, kind):
    dtype, _ = DTYPES[dt]
    n = int(np.prod(shape))
    x = to_torch(make_input(rng_for(request.node.callspec.id), n, bs, kind), dtype)
    packed, absmax = quantize_4bit(x, bs, QUANT_TYPES[qt])
    packed_d, absmax_d = quantize_4bit(x.cuda(), bs, QUANT_TYPES[qt])
    assert_same_bits(packed, packed_d, "packed")
    assert_same_bits(absmax, absmax_d, "absmax")
    for out_dt, (out_dtype, _) in DTYPES.items():
        out = dequantize_4bit(packed, absmax, n, bs, QUANT_TYPES[qt], out_dtype)
        out_d = dequantize_4bit(packed_d, absmax_d, n, bs, QUANT_TYPES[qt], out_dtype)
        assert_same_bits(out, out_d, f"dequantized {out_dt}")


@requires_gpu
@pytest.mark.parametrize("qt", QUANT_TYPES)
@pytest.mark.parametrize("n", [1, 4097, 65536])
def test_dequantize_4bit_random_bytes(request, qt, n):
    """Every nibble value, with absmax of mixed magnitude, zero and NaN."""
    rng = rng_for(request.node.callspec.id)
    bs = 64
    packed = torch.from_numpy(rng.integers(0, 256, (n + 1) // 2, dtype=np.uint8))
    absmax_np = (rng.lognormal(0.0, 4.0, -(-n // bs))).astype(np.float32)
    absmax_np[:: max(1, len(absmax_np) // 3)] = 0.0
    if len(absmax_np) > 2:
        absmax_np[1] = np.nan
    absmax = torch.from_numpy(absmax_np)
    for dt, (dtype, _) in DTYPES.items():
        out = dequantize_4bit(packed, absmax, n, bs, QUANT_TYPES[qt], dtype)
        out_d = dequantize_4bit(packed.cuda(), absmax.cuda(), n, bs, QUANT_TYPES[qt], dtype)
        assert_same_bits(out, out_d, f"dequantized {dt}")


BLOCKWISE_CASES = [
    pytest.param(bs, dt, shape, book, kind, id=f"bs{bs}-{dt}-{'x'.join(map(str, shape))}-{book}-{kind}")
    for bs in (32, 256, 4096)
    for dt in DTYPES
    for shape in SHAPES
    for book in ("dynamic", "linear")
    for kind in ("randn", "special")
]


@requires_gpu
@pytest.mark.parametrize("bs, dt, shape, book, kind", BLOCKWISE_CASES)
def test_blockwise_matches_cpu(request, bs, dt, shape, book, kind):
    dtype, _ = DTYPES[dt]
    n = int(np.prod(shape))
    x = to_torch(make_input(rng_for(request.node.callspec.id), n, bs, kind), dtype)
    code = torch.linspace(-1.0, 1.0, 256, dtype=torch.float32) if book == "linear" else None
    code_d = code.cuda() if code is not None else None
    codes, absmax = quantize_blockwise(x, bs, code)
    codes_d, absmax_d = quantize_blockwise(x.cuda(), bs, code_d)
    assert_same_bits(codes, codes_d, "codes")
    assert_same_bits(absmax, absmax_d, "absmax")
    for out_dt, (out_dtype, _) in DTYPES.items():
        for add_offset, offset in ((False, 0.0), (True, 0.3125), (True, -1.7e-3)):
            out = dequantize_blockwise(codes, absmax, bs, code, add_offset, offset, out_dtype)
            out_d = dequantize_blockwise(codes_d, absmax_d, bs, code_d, add_offset, offset, out_dtype)
            assert_same_bits(out, out_d, f"dequantized {out_dt} offset={add_offset}:{offset}")


def _absmax_vector(rng: np.random.Generator, n: int, kind: str) -> np.ndarray:
    if kind == "from-weights":  # absmax of a real 4-bit quantization (bs 64)
        _, absmax = quantize_4bit(torch.from_numpy(rng.standard_normal(n * 64).astype(np.float32) * 0.02), 64, 0)
        return absmax.numpy()
    if kind == "lognormal":
        return rng.lognormal(-3.0, 1.0, n).astype(np.float32)
    if kind == "wide-range":  # beyond the exact-parallel-sum bound: sequential path
        return np.exp2(rng.uniform(-60.0, 40.0, n)).astype(np.float32)
    if kind == "with-nan":
        a = rng.lognormal(-3.0, 1.0, n).astype(np.float32)
        a[n // 2] = np.nan
        return a
    raise ValueError(kind)


@requires_gpu
@pytest.mark.parametrize("kind", ["from-weights", "lognormal", "wide-range", "with-nan"])
@pytest.mark.parametrize("n_blocks", [1, 255, 256, 1000, 65536])
def test_nested_matches_cpu(request, kind, n_blocks):
    absmax = torch.from_numpy(_absmax_vector(rng_for(request.node.callspec.id), n_blocks, kind))
    codes, absmax2, offset = quantize_nested(absmax)
    codes_d, absmax2_d, offset_d = quantize_nested(absmax.cuda())
    assert_same_bits(offset, offset_d, "offset")
    assert_same_bits(codes, codes_d, "nested codes")
    assert_same_bits(absmax2, absmax2_d, "nested absmax")
    # the decode the 4-bit dequantize uses: code[q] * absmax2 + offset
    off = float(offset.item())
    decoded = dequantize_blockwise(codes, absmax2, NESTED_BLOCKSIZE, None, True, off, torch.float32)
    decoded_d = dequantize_blockwise(codes_d, absmax2_d, NESTED_BLOCKSIZE, None, True, off, torch.float32)
    assert_same_bits(decoded, decoded_d, "decoded absmax")


@requires_gpu
def test_on_a_side_stream():
    """Launched on a non-default stream (torch's current one inside the context):
    same bytes once that stream is synchronised."""
    x = to_torch(make_input(rng_for("side-stream"), 1 << 20, 64, "randn"), torch.bfloat16)
    packed, absmax = quantize_4bit(x, 64, 0)
    stream = torch.cuda.Stream()
    x_d = x.cuda()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        packed_d, absmax_d = quantize_4bit(x_d, 64, 0)
    stream.synchronize()
    assert_same_bits(packed, packed_d, "packed")
    assert_same_bits(absmax, absmax_d, "absmax")


# Argument checks happen on the host before any launch: no GPU needed.
def test_device_count_is_never_an_error():
    assert LIB.q4_cuda_device_count() >= 0


def test_cuda_rejects_bad_blocksize():
    status = LIB.q4_cuda_quantize_4bit(None, 0, 100, 48, 0, None, 50, None, 3, None)
    assert status == 1
    assert LIB.q4_cuda_last_error() == b"blocksize must be a power of two in [32, 4096], got 48"


def test_cuda_rejects_wrong_sizes_and_null_pointers():
    assert LIB.q4_cuda_dequantize_blockwise(None, 10, None, 1, 32, None, 0, 0.0, None, 0, None) == 1
    assert LIB.q4_cuda_last_error() == b"codes is a null pointer"
    fake = ctypes.c_void_p(16)  # never dereferenced: the size check fails first
    assert LIB.q4_cuda_quantize_nested(fake, 300, fake, fake, 1, fake, None) == 1
    assert LIB.q4_cuda_last_error() == b"nested absmax output has 1 elements, expected 2"


def test_cuda_and_cpu_entry_points_share_the_thread_error_slot():
    LIB.q4_cuda_quantize_4bit(None, 0, 100, 48, 0, None, 50, None, 3, None)
    assert LIB.q4_last_error() == b"blocksize must be a power of two in [32, 4096], got 48"
    assert LIB.q4_quantize_4bit(None, 7, 100, 64, 0, None, 50, None, 2) == 1
    assert b"dtype" in LIB.q4_cuda_last_error()
