"""Loads libq4 (the framework-free kernel library) and declares its C ABI.

Search order: the path in ``Q4_LIBRARY``; ``libq4.so`` installed next to this
package; the CMake build trees under ``<checkout>/build`` (development), the
most recently built first (a checkout holds several trees, and an older one
must not shadow the build just made). The first that exists is loaded;
failures name the path and the reason.
"""

from __future__ import annotations

import ctypes
import json
import os
from pathlib import Path
from typing import Any

_LIB_NAME = "libq4.so"
_EXPECTED_ABI = 2


class NativeLibraryError(RuntimeError):
    """libq4 could not be found or loaded."""


class KernelError(ValueError):
    """A kernel rejected its arguments (the message names the bad value)."""


def _candidates(package_root: Path | None = None) -> list[Path]:
    env = os.environ.get("Q4_LIBRARY")
    if env:
        return [Path(env)]
    here = package_root or Path(__file__).resolve().parent.parent
    found = [here / _LIB_NAME]
    build = here.parent / "build"
    if build.is_dir():
        # newest first; equal times by name, so the order never depends on the directory listing
        found += sorted(build.glob(f"*/{_LIB_NAME}"), key=lambda p: (-p.stat().st_mtime_ns, str(p)))
    return found


c_void_p, c_int32, c_int64, c_float = ctypes.c_void_p, ctypes.c_int32, ctypes.c_int64, ctypes.c_float
_f32p = ctypes.POINTER(ctypes.c_float)
_i32p = ctypes.POINTER(ctypes.c_int32)

# name -> (restype, argtypes)
_SIGNATURES: dict[str, tuple[Any, list[Any]]] = {
    "q4_last_error": (ctypes.c_char_p, []),
    "q4_abi_version": (c_int32, []),
    "q4_has_cuda": (c_int32, []),
    "q4_code_table": (c_int32, [c_int32, _f32p, c_int64]),
    "q4_fp4_rank_order": (c_int32, [_i32p, c_int64]),
    "q4_min_blocksize": (c_int64, []),
    "q4_max_blocksize": (c_int64, []),
    "q4_max_blocksize8": (c_int64, []),
    "q4_nested_blocksize": (c_int64, []),
    "q4_w4a8_act_block": (c_int64, [c_int64]),
    "q4_search_scales_4bit": (c_int32, [c_void_p, c_int64, c_int64, c_int32, c_void_p]),
    "q4_encode_4bit": (c_int32, [c_void_p, c_int64, c_int64, c_int32, c_void_p, c_void_p]),
    "q4_cpu_isa": (c_int32, []),
    "q4_cpu_has_avx2": (c_int32, []),
    "q4_cpu_has_avx512": (c_int32, []),
    "q4_cpu_has_avx512_bf16": (c_int32, []),
    "q4_cpu_has_amx": (c_int32, []),
    "q4_cpu_features_json": (ctypes.c_char_p, []),
    "q4_set_cpu_isa": (c_int32, [c_int32]),
    "q4_cpu_num_threads": (c_int32, []),
    "q4_set_cpu_num_threads": (None, [c_int32]),
    "q4_set_cpu_fork_join": (None, [c_void_p]),
    "q4_cpu_fork_join": (c_void_p, []),
    "q4_ops": (ctypes.c_char_p, []),
    "q4_formats": (ctypes.c_char_p, []),
    "q4_cpu_isa_names": (ctypes.c_char_p, []),
    "q4_cpu_has_isa": (c_int32, [c_int32]),
}

# C parameter types of the op list -> ctypes (every pointer is passed as an address)
_C_TYPES = {"int32_t": c_int32, "int64_t": c_int64, "float": c_float, "double": ctypes.c_double}


def parse_ops(text: str) -> dict[str, list[Any]]:
    """The op list returned by q4_ops() ("name(type name, ...)" per line) as
    {name: ctypes argtypes}; the ops' single source is kernels/bind/c_api_ops.inc."""
    ops: dict[str, list[Any]] = {}
    for line in text.splitlines():
        if not line.strip():
            continue
        name, _, params = line.partition("(")
        if not params.endswith(")") or not name.isidentifier():
            raise NativeLibraryError(f"malformed op entry {line!r} in the library's op list")
        argtypes: list[Any] = []
        for param in params[:-1].split(","):
            ctype, _, pname = param.strip().rpartition(" ")
            if ctype.endswith("*") or pname.startswith("*"):
                argtypes.append(c_void_p)
            elif ctype.strip() in _C_TYPES:
                argtypes.append(_C_TYPES[ctype.strip()])
            else:
                raise NativeLibraryError(f"op {name}: parameter type {ctype!r} has no ctypes mapping")
        ops[name] = argtypes
    return ops


def parse_formats(text: str) -> dict[str, int]:
    """The format list returned by q4_formats() ("name id" per line) as
    {name: kernel code}; the formats' single source is kernels/include/q4/formats.h."""
    formats: dict[str, int] = {}
    for line in text.splitlines():
        if not line.strip():
            continue
        name, _, code = line.partition(" ")
        if not name.isidentifier() or not code.isdigit():
            raise NativeLibraryError(f"malformed format entry {line!r} in the library's format list")
        formats[name] = int(code)
    return formats


def formats() -> dict[str, int]:
    """The loaded library's 4-bit formats, name -> kernel code (quant_type)."""
    return dict(parse_formats(lib().q4_formats().decode()))


_CUDA_SIGNATURES: dict[str, tuple[Any, list[Any]]] = {
    "q4_cuda_last_error": (ctypes.c_char_p, []),
    "q4_cuda_device_count": (c_int32, []),
}
_OPS: dict[str, list[Any]] = {}  # the loaded library's op list (op name -> argtypes)

_lib: ctypes.CDLL | None = None
_path: Path | None = None


def _load() -> ctypes.CDLL:
    global _lib, _path
    if _lib is not None:
        return _lib
    tried = []
    for path in _candidates():
        if not path.exists():
            tried.append(f"{path} (not found)")
            continue
        try:
            lib = ctypes.CDLL(str(path))
        except OSError as e:
            raise NativeLibraryError(f"cannot load q4 kernel library {path}: {e}") from e
        for name, (restype, argtypes) in _SIGNATURES.items():
            try:
                fn = getattr(lib, name)
            except AttributeError as e:
                raise NativeLibraryError(f"{path} lacks symbol {name}: rebuild q4 (pip install .)") from e
            fn.restype, fn.argtypes = restype, argtypes
        ops = parse_ops(lib.q4_ops().decode())
        signatures = {"q4_" + op: (c_int32, argtypes) for op, argtypes in ops.items()}
        if lib.q4_has_cuda():
            signatures.update(_CUDA_SIGNATURES)
            signatures.update({"q4_cuda_" + op: (c_int32, [*argtypes, c_void_p]) for op, argtypes in ops.items()})
        for name, (restype, argtypes) in signatures.items():
            fn = getattr(lib, name)
            fn.restype, fn.argtypes = restype, argtypes
        _check_env(lib)
        _OPS.clear()
        _OPS.update(ops)
        abi = lib.q4_abi_version()
        if abi != _EXPECTED_ABI:
            raise NativeLibraryError(f"{path} has ABI version {abi}, this q4 needs {_EXPECTED_ABI}: rebuild q4")
        _lib, _path = lib, path
        return lib
    raise NativeLibraryError(
        "cannot find the q4 kernel library; tried: "
        + "; ".join(tried)
        + ". Install q4 (pip install . or make test), or set Q4_LIBRARY to a built libq4.so"
    )


def lib() -> ctypes.CDLL:
    """The loaded kernel library (loaded on first use)."""
    return _load()


def library_path() -> Path:
    """The path of the libq4.so this process loaded (Q4_LIBRARY, else the installed or built one)."""
    _load()
    assert _path is not None
    return _path


def check(status: int) -> None:
    """Raise KernelError with the library's message for a non-zero status."""
    if status != 0:
        msg = lib().q4_last_error().decode("utf-8", "replace")
        raise KernelError(msg or f"q4 kernel failed with status {status}")


def check_cuda(status: int) -> None:
    if status != 0:
        msg = lib().q4_cuda_last_error().decode("utf-8", "replace")
        raise KernelError(msg or f"q4 CUDA kernel failed with status {status}")


def op_names() -> tuple[str, ...]:
    """The library's ops (kernels/bind/c_api_ops.inc): q4_<op> and, with CUDA,
    q4_cuda_<op>, plus the XLA FFI handlers q4_ffi_<op> / q4_ffi_cuda_<op>."""
    lib()
    return tuple(_OPS)


def has_cuda() -> bool:
    """Whether the library was built with the CUDA kernels."""
    return bool(lib().q4_has_cuda())


def cuda_device_count() -> int:
    """The CUDA devices the library can use: 0 without CUDA kernels or without a GPU."""
    return int(lib().q4_cuda_device_count()) if has_cuda() else 0


def isa_names(handle: ctypes.CDLL | None = None) -> dict[int, str]:
    """The library's ISA levels, isa code -> name, lowest first (the level
    list Q4_ISA_LEVELS in kernels/include/q4/kernels.h)."""
    text = (handle or lib()).q4_cpu_isa_names().decode()
    return dict(enumerate(line for line in text.splitlines() if line))


def _check_env(handle: ctypes.CDLL | None = None) -> None:
    """Q4_ISA must name a level, Q4_L1D_BYTES (the L1 data cache size the
    kernels tune for, instead of the detected one) be a positive byte count:
    the library itself ignores a value it cannot use."""
    env = os.environ.get("Q4_ISA")
    names = isa_names(handle).values() if env is not None else ()
    if env is not None and env not in names:
        raise NativeLibraryError(f"Q4_ISA must be one of {', '.join(names)}, got {env!r}")
    env = os.environ.get("Q4_L1D_BYTES")
    if env is not None and not (env.isascii() and env.isdigit() and int(env) > 0):
        raise NativeLibraryError(f"Q4_L1D_BYTES must be a positive number of bytes, got {env!r}")


def _isa_code(isa: str) -> int:
    """The library's code of ISA level `isa`; a name it lacks raises ValueError."""
    codes = {v: k for k, v in isa_names().items()}
    if not isinstance(isa, str) or isa not in codes:
        raise ValueError(f"isa must be one of {', '.join(codes)}, got {isa!r}")
    return codes[isa]


def cpu_isa() -> str:
    """The ISA level the CPU kernels use now: 'scalar', 'avx2', 'avx512',
    'avx512_bf16' or 'amx' (each implies the ones before it)."""
    return isa_names()[lib().q4_cpu_isa()]


def set_cpu_isa(isa: str) -> None:
    """Force the CPU kernels onto one ISA level (also: env Q4_ISA). A level the
    processor lacks raises KernelError; an unknown name ValueError."""
    check(lib().q4_set_cpu_isa(_isa_code(isa)))


def cpu_has_isa(isa: str) -> bool:
    """Whether this processor and OS support ISA level `isa` (a name of isa_names())."""
    return bool(lib().q4_cpu_has_isa(_isa_code(isa)))


def cpu_has_avx2() -> bool:
    """Whether this processor and OS support the avx2 level (AVX2 + FMA)."""
    return bool(lib().q4_cpu_has_avx2())


def cpu_has_avx512() -> bool:
    """Whether this processor and OS support the avx512 level (AVX-512 F/BW/VL)."""
    return bool(lib().q4_cpu_has_avx512())


def cpu_has_avx512_bf16() -> bool:
    """AVX-512 with AVX512_BF16 and AVX512_VNNI (the avx512_bf16 level)."""
    return bool(lib().q4_cpu_has_avx512_bf16())


def cpu_has_amx() -> bool:
    """The amx level: avx512_bf16 plus AMX-TILE, AMX-BF16 and AMX-INT8, with the
    operating system's permission to use the tile data (Linux, asked for once
    per process)."""
    return bool(lib().q4_cpu_has_amx())


def cpu_features() -> dict:
    """What the processor supports and what the kernels use: ``features``
    (cpuid + OS state), ``best_isa``, ``isa`` (active level), ``l1d_bytes``
    (the L1 data cache size the kernels tune for: env Q4_L1D_BYTES, else
    the operating system's figure), ``kernels``
    (each op's kernel chain, tried in order) and ``last_kernel`` (the kernel
    each op ran last, '' before the first call)."""
    return json.loads(lib().q4_cpu_features_json().decode())


def num_threads() -> int:
    """The threads the CPU kernels use (Q4_NUM_THREADS, else OMP_NUM_THREADS, else all cores; set_num_threads)."""
    return int(lib().q4_cpu_num_threads())


def set_fork_join(gomp_parallel: int | None) -> None:
    """Run the CPU kernels' threads through an OpenMP runtime's GOMP_parallel
    (its address), so they are that runtime's threads rather than a second
    pool competing with them; None: q4's own pool. q4torch sets PyTorch's."""
    lib().q4_set_cpu_fork_join(gomp_parallel)


def fork_join() -> int | None:
    """The fork-join entry point in use (an address), or None for q4's own pool."""
    return lib().q4_cpu_fork_join()


def set_num_threads(n: int) -> None:
    """Threads used by the CPU kernels; n <= 0 restores the default
    (Q4_NUM_THREADS, else OMP_NUM_THREADS, else all cores)."""
    lib().q4_set_cpu_num_threads(int(n))
