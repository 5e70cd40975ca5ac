"""The C ABI directly: argument validation (error code + message, no crash,
nothing written out of bounds) and randomised sizes against the oracle."""

import ctypes
import os

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from q4_reference import oracle

from q4._src import native

CANARY = 0xA5


def _lib():
    return native.lib()


def _quantize(x, n, blocksize, qt=0, dtype=0, packed_size=None, absmax_size=None):
    packed_size = (n + 1) // 2 if packed_size is None else packed_size
    absmax_size = -(-n // blocksize) if absmax_size is None else absmax_size
    packed = np.full(max(packed_size, 0) + 64, CANARY, np.uint8)
    absmax = np.full(max(absmax_size, 0) + 16, np.nan, np.float32)
    rc = _lib().q4_quantize_4bit(
        x.ctypes.data if x is not None else None,
        dtype,
        n,
        blocksize,
        qt,
        packed.ctypes.data,
        packed_size,
        absmax.ctypes.data,
        absmax_size,
    )
    return rc, packed, absmax


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(blocksize=48), "blocksize must be a power of two in \\[32, 4096\\], got 48"),
        (dict(blocksize=8192), "got 8192"),
        (dict(blocksize=16), "got 16"),
        (dict(dtype=7), "input dtype must be float32, float16 or bfloat16.*got code 7"),
        (dict(qt=2), "quant_type must be 0 \\(nf4\\) or 1 \\(fp4\\), got 2"),
        (dict(packed_size=10), "packed output has 10 elements, expected 50"),
        (dict(absmax_size=1), "absmax output has 1 elements, expected 2"),
    ],
)
def test_bad_arguments_are_rejected_with_message(kwargs, message):
    x = np.ones(100, np.float32)
    args = dict(blocksize=64, qt=0, dtype=0) | kwargs
    rc, packed, _ = _quantize(x, 100, **args)
    assert rc == 1
    assert __import__("re").search(message, _lib().q4_last_error().decode())
    assert np.all(packed == CANARY)  # nothing written


def test_empty_and_null_inputs_are_rejected():
    rc, _, _ = _quantize(np.ones(1, np.float32), 0, 64)
    assert rc == 1 and "element count must be positive, got 0" in _lib().q4_last_error().decode()
    rc, _, _ = _quantize(None, 10, 64)
    assert rc == 1 and "input is a null pointer" in _lib().q4_last_error().decode()
    rc = _lib().q4_dequantize_4bit(None, 5, None, 1, 10, 64, 0, None, 0)
    assert rc == 1 and "null pointer" in _lib().q4_last_error().decode()


def test_error_message_is_per_thread():
    import threading

    _quantize(np.ones(4, np.float32), 4, 48)
    seen = []
    t = threading.Thread(target=lambda: seen.append(_lib().q4_last_error().decode()))
    t.start()
    t.join()
    assert seen == [""] and "48" in _lib().q4_last_error().decode()


@settings(max_examples=150, deadline=None)
@given(
    n=st.integers(1, 20000),
    log_bs=st.integers(5, 12),
    qt=st.sampled_from([0, 1]),
    seed=st.integers(0, 2**32 - 1),
)
def test_random_sizes_match_oracle_and_stay_in_bounds(n, log_bs, qt, seed):
    blocksize = 1 << log_bs
    x = np.random.default_rng(seed).standard_normal(n).astype(np.float32)
    rc, packed, absmax = _quantize(x, n, blocksize, qt)
    assert rc == 0, _lib().q4_last_error()
    ps, nb = (n + 1) // 2, -(-n // blocksize)
    want_packed, want_absmax = oracle.quantize_4bit(x, blocksize, ("nf4", "fp4")[qt])
    assert np.array_equal(packed[:ps], want_packed) and np.all(packed[ps:] == CANARY)
    assert np.array_equal(absmax[:nb], want_absmax) and np.all(np.isnan(absmax[nb:]))
    out = np.full(n + 16, -7.0, np.float32)
    rc = _lib().q4_dequantize_4bit(packed.ctypes.data, ps, absmax.ctypes.data, nb, n, blocksize, qt, out.ctypes.data, 0)
    assert rc == 0
    assert np.array_equal(out[:n], oracle.dequantize_4bit(want_packed, want_absmax, n, blocksize, ("nf4", "fp4")[qt]))
    assert np.all(out[n:] == -7.0)


def test_code_tables_reject_wrong_sizes():
    buf = (ctypes.c_float * 256)()
    assert _lib().q4_code_table(0, buf, 256) == 1
    assert _lib().q4_code_table(3, buf, 16) == 1  # 3: the unsigned dynamic map, 256 entries
    assert _lib().q4_code_table(4, buf, 16) == 1
    assert "table must be" in _lib().q4_last_error().decode()


# The op list (kernels/bind/c_api_ops.inc) as the library reports it: every
# op has its C entry point and its XLA FFI handler, and the declared argtypes
# are those of the C parameters (an independent reading of the header).
def _header_ops() -> dict[str, list[str]]:
    import re
    from pathlib import Path

    text = (Path(__file__).resolve().parents[2] / "kernels/bind/c_api_ops.inc").read_text()
    text = re.sub(r"/\*.*?\*/", "", text, flags=re.S)
    ops = {}
    for name, params in re.findall(r"Q4_OP\(\s*(\w+),\s*\(([^()]*)\)", text):
        ops[name] = [" ".join(p.split()[:-1]) for p in params.split(",")]
    return ops


def test_op_list_matches_the_def_file_and_every_symbol_exists():
    header = _header_ops()
    assert tuple(header) == native.op_names()
    to_ctypes = {
        "int32_t": ctypes.c_int32,
        "int64_t": ctypes.c_int64,
        "float": ctypes.c_float,
        "double": ctypes.c_double,
    }
    lib = _lib()
    for op, types in header.items():
        fn = getattr(lib, "q4_" + op)
        assert fn.restype is ctypes.c_int32
        assert fn.argtypes == [ctypes.c_void_p if t.endswith("*") else to_ctypes[t] for t in types], op
        getattr(lib, "q4_ffi_" + op)
        if native.has_cuda():
            assert getattr(lib, "q4_cuda_" + op).argtypes == [*fn.argtypes, ctypes.c_void_p]
            getattr(lib, "q4_ffi_cuda_" + op)


@pytest.mark.parametrize(
    "text, message",
    [
        ("gemm(int32_t a", "malformed op entry"),
        ("1bad(int32_t a)", "malformed op entry"),
        ("gemm(char a)", "parameter type 'char'"),
    ],
)
def test_malformed_op_list_is_refused(text, message):
    with pytest.raises(native.NativeLibraryError, match=message):
        native.parse_ops(text)


def test_op_list_parser_reads_c_declarations():
    """Pointers in either spelling are addresses; int32/int64/float map to ctypes."""
    ops = native.parse_ops("a(const float *x, int64_t n, float s, int32_t* out)\nb(void* p)\n")
    assert ops == {
        "a": [ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_void_p],
        "b": [ctypes.c_void_p],
    }


@pytest.mark.parametrize(
    "name, value, message",
    [
        ("Q4_ISA", "avx1024", "Q4_ISA must be one of .*'avx1024'"),
        ("Q4_L1D_BYTES", "48k", "Q4_L1D_BYTES must be a positive number of bytes, got '48k'"),
        ("Q4_L1D_BYTES", "0", "got '0'"),
        ("Q4_L1D_BYTES", "-1", "got '-1'"),
    ],
)
def test_bad_tuning_environment_is_refused(monkeypatch, name, value, message):
    """The loader names a bad Q4_ISA / Q4_L1D_BYTES (the library would ignore it)."""
    monkeypatch.setenv(name, value)
    with pytest.raises(native.NativeLibraryError, match=message):
        native._check_env()


def test_library_search_prefers_the_newest_build_tree(tmp_path, monkeypatch):
    # a checkout with several CMake trees: the one built last is loaded, not
    # the first by name (an older tree must not shadow a fresh build)
    monkeypatch.delenv("Q4_LIBRARY", raising=False)
    package_root = tmp_path / "checkout" / "src"
    package_root.mkdir(parents=True)
    libs = {}
    for tree, age in [("base", 1), ("exp", 3), ("cp311", 2)]:
        lib = tmp_path / "checkout" / "build" / tree / "libq4.so"
        lib.parent.mkdir(parents=True)
        lib.write_bytes(b"")
        os.utime(lib, ns=(10**18, age * 10**18))
        libs[tree] = lib
    found = native._candidates(package_root)
    assert found == [package_root / "libq4.so", libs["exp"], libs["cp311"], libs["base"]]
    monkeypatch.setenv("Q4_LIBRARY", str(libs["base"]))
    assert native._candidates(package_root) == [libs["base"]]
