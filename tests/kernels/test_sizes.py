"""Sizes that overflow int64 arithmetic are rejected by every C ABI entry point
before any memory is touched (q4/kernels.h: no kernel touches memory outside
the given sizes), and the fuzz target's rule agrees with the library on
random and on every stored input."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
from q4_testing.fuzz import fuzz_target

from q4._src import native

fuzz_c_abi = fuzz_target("c_abi")

CORPUS = Path(__file__).resolve().parent.parent / "fuzz" / "corpus" / "c_abi"
HUGE = 2**62 + 1
TOO_BIG = "overflows or exceeds the largest supported count|exceeds the largest supported count"


def _lib():
    return native.lib()


def _buf(nbytes=256, fill=0xA5):
    return np.full(nbytes, fill, np.uint8)


def _error():
    return _lib().q4_last_error().decode()


def _gemm(m, n, k, n_blocks, packed_size, grad=False):
    x, packed, absmax, out = _buf(), _buf(), _buf(), _buf()
    args = [x.ctypes.data, 0, m, n, k, packed.ctypes.data, packed_size, absmax.ctypes.data]
    args += [None, None, 0, None, 0.0, n_blocks, 64, 0]
    if grad:
        rc = _lib().q4_gemm_4bit_grad_input(*args, out.ctypes.data, 0)
    else:
        rc = _lib().q4_gemm_4bit(*args, None, 0, out.ctypes.data, 0)
    return rc, out


@pytest.mark.parametrize("grad", [False, True], ids=["forward", "grad_input"])
@pytest.mark.parametrize(
    "m, n, k",
    [(1, HUGE, 4), (1, 4, HUGE), (HUGE, 4, 4), (2**40, 2**40, 1), (2**31, 1, 2**31), (2**63 - 1, 1, 1)],
    ids=["n", "k", "m", "m*n", "m*k", "int64-max"],
)
def test_gemm_4bit_rejects_dimensions_whose_products_overflow(m, n, k, grad):
    # the sizes an attacker would pass: what the wrapped n*k asks for, so a
    # check done in wrapped arithmetic would pass
    nk = (n * k) % 2**64
    rc, out = _gemm(m, n, k, -(-nk // 64), (nk + 1) // 2, grad)
    assert rc == 1
    assert re.search(TOO_BIG, _error()), _error()
    assert np.all(out == 0xA5)


@pytest.mark.parametrize("n", [2**48 + 1, HUGE, 2**63 - 1])
def test_element_counts_above_the_limit_are_rejected(n):
    x, packed, absmax, out = _buf(), _buf(), _buf(), _buf()
    lib = _lib()
    calls = {
        "quantize_4bit": lambda: lib.q4_quantize_4bit(
            x.ctypes.data, 0, n, 64, 0, packed.ctypes.data, (n + 1) // 2, absmax.ctypes.data, -(-n // 64)
        ),
        "dequantize_4bit": lambda: lib.q4_dequantize_4bit(
            packed.ctypes.data, (n + 1) // 2, absmax.ctypes.data, -(-n // 64), n, 64, 0, out.ctypes.data, 0
        ),
        "quantize_blockwise": lambda: lib.q4_quantize_blockwise(
            x.ctypes.data, 0, n, 64, None, packed.ctypes.data, n, absmax.ctypes.data, -(-n // 64)
        ),
        "dequantize_blockwise": lambda: lib.q4_dequantize_blockwise(
            packed.ctypes.data, n, absmax.ctypes.data, -(-n // 64), 64, None, 0, 0.0, out.ctypes.data, 0
        ),
        "quantize_nested": lambda: lib.q4_quantize_nested(
            x.ctypes.data, n, packed.ctypes.data, absmax.ctypes.data, -(-n // 256), out.ctypes.data
        ),
        "int8_quantize_rows": lambda: lib.q4_int8_quantize_rows(
            x.ctypes.data, 0, n, 2, 0.0, packed.ctypes.data, absmax.ctypes.data, None
        ),
    }
    for name, call in calls.items():
        assert call() == 1, name
        assert re.search(TOO_BIG, _error()), (name, _error())
    assert np.all(packed == 0xA5) and np.all(absmax == 0xA5) and np.all(out == 0xA5)


@pytest.mark.parametrize("m, n, k", [(1, HUGE, 4), (2**40, 2**40, 1), (2**31, 2, 2**31)], ids=["n*k", "m*n", "m*k"])
def test_int8_matmuls_reject_dimensions_whose_products_overflow(m, n, k):
    x, w, scale, out = _buf(), _buf(), _buf(), _buf()
    lib = _lib()
    rc = lib.q4_int8_linear(
        x.ctypes.data, 0, m, n, k, w.ctypes.data, scale.ctypes.data, 0.0, None, 0, out.ctypes.data, 0
    )
    assert rc == 1 and re.search(TOO_BIG, _error()), _error()
    rc = lib.q4_int8_grad_input(x.ctypes.data, 0, m, n, k, w.ctypes.data, scale.ctypes.data, out.ctypes.data, 0)
    assert rc == 1 and re.search(TOO_BIG, _error()), _error()
    assert np.all(out == 0xA5)


def test_numpy_dequantize_blockwise_refuses_a_short_code_book():
    import q4

    codes, absmax = q4.quantize_blockwise(np.linspace(-1, 1, 128, dtype=np.float32), 64)
    with pytest.raises(ValueError, match="code must hold 256 values, got 16"):
        q4.dequantize_blockwise(codes, absmax, 64, code=np.linspace(-1, 1, 16, dtype=np.float32))
    with pytest.raises(ValueError, match="code must hold 256 values, got 16"):
        q4.quantize_blockwise(np.ones(128, np.float32), 64, code=np.linspace(-1, 1, 16, dtype=np.float32))


def test_fuzz_rule_agrees_with_the_library_on_random_inputs():
    rng = np.random.default_rng(7)
    seen = set()
    for _ in range(4000):
        data = rng.integers(0, 256, int(rng.integers(1, 64)), dtype=np.uint8).tobytes()
        seen.add(fuzz_c_abi.check(data))
    assert {name for name, _ in fuzz_c_abi.CASES} <= seen


def test_fuzz_corpus_replays():
    files = sorted(p for p in CORPUS.iterdir() if p.is_file())
    assert files, f"no corpus under {CORPUS}"
    for path in files:
        fuzz_c_abi.check(path.read_bytes())
