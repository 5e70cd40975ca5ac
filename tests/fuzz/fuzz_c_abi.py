"""Fuzz target: the size checks of every C ABI entry point.

# q4-fuzz: asan

Each input picks an op and its sizes (element counts, dimensions, block size,
dtype and quant_type codes; values near powers of two and near INT64_MAX are
likely). An independent rule written from the layouts in q4/kernels.h (exact
integer arithmetic in Python, no overflow) says whether the call is valid:

- valid and small enough to allocate: buffers of exactly the declared sizes,
  the call must succeed;
- invalid: the call must return kInvalidArgument with a message and write
  nothing (every output buffer keeps its canary).

Valid calls too large to allocate are not made. Run under the sanitizer
build (scripts/asan_run.sh) an out-of-bounds access is reported even where a
wrong answer would not show. `check(data)` is the whole property; the atheris
campaign (scripts/fuzz.sh) and tests/kernels/test_sizes.py (replaying
tests/fuzz/corpus/c_abi and random inputs) both call it.
"""

from __future__ import annotations

import struct
import sys

import numpy as np

from q4._src import native

MAX_ELEMENTS = 1 << 48  # kMaxElements in q4/common.h
ALLOC_LIMIT = 1 << 16  # largest buffer (elements) the harness allocates
CANARY = 0x5A
ELEM_BYTES = {0: 4, 1: 2, 2: 2}


class Input:
    """Integers decoded from fuzz bytes; exhausted input reads as zeros."""

    def __init__(self, data: bytes):
        self.data, self.pos = data, 0

    def _take(self, n: int) -> bytes:
        b = self.data[self.pos : self.pos + n]
        self.pos += n
        return b.ljust(n, b"\0")

    def byte(self) -> int:
        return self._take(1)[0]

    def count(self) -> int:
        """A size: small, a power of two +- a little, huge, negative or raw."""
        sel = self.byte()
        kind, low = sel >> 5, sel & 31
        if kind <= 2:
            return self.byte() + (low << 8)  # 0 .. 8191
        if kind == 3:
            return (1 << (low + 5)) + (self.byte() % 5) - 2
        if kind == 4:
            return (1 << (low + 32)) + (self.byte() % 5) - 2 if low < 31 else (1 << 63) - 1 - self.byte()
        if kind == 5:
            return -(self.byte() + 1)
        return struct.unpack("<q", self._take(8))[0]

    def code(self, valid: int) -> int:
        """A dtype / quant_type code, usually one of `valid` values."""
        b = self.byte()
        return b % valid if b < 224 else b - 224 + valid


def _pow2_block(bs: int, top: int = 4096) -> bool:
    """A block size the library takes: a power of two in [32, 4096] (8-bit
    blockwise ops: up to 16384)."""
    return 32 <= bs <= top and bs & (bs - 1) == 0


def _count_ok(*xs: int) -> bool:
    return all(0 < x <= MAX_ELEMENTS for x in xs)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class _Buffers:
    """Buffers keyed by name; outputs carry a canary to prove nothing was written."""

    def __init__(self):
        self.arrays: dict[str, np.ndarray] = {}
        self.outputs: list[str] = []

    def make(self, name: str, nbytes: int, output: bool = False) -> int:
        nbytes = max(0, min(nbytes, ALLOC_LIMIT * 4))
        a = np.full(nbytes + 64, CANARY, np.uint8)
        if not output:
            a[:] = 0x3C  # finite inputs (0x3c3c3c3c is ~0.0115 as fp32)
        self.arrays[name] = a
        if output:
            self.outputs.append(name)
        return a.ctypes.data

    def untouched(self) -> bool:
        return all(np.all(self.arrays[o] == CANARY) for o in self.outputs)

    def tails_untouched(self, used: dict[str, int]) -> bool:
        return all(np.all(self.arrays[o][used[o] :] == CANARY) for o in self.outputs)


def _alloc_size(declared: int, valid: bool) -> int:
    return declared if valid else (declared if 0 <= declared <= ALLOC_LIMIT else 16)


def _case_quant4(inp: Input, lib, buf: _Buffers, dequant: bool):
    n, bs, dt, qt = inp.count(), inp.count() if inp.byte() & 1 else 64, inp.code(3), inp.code(2)
    ps = inp.count() if inp.byte() < 32 else (n + 1) // 2
    ab = inp.count() if inp.byte() < 32 else (_cdiv(n, bs) if bs > 0 else 0)
    valid = (
        _count_ok(n) and _pow2_block(bs) and dt in ELEM_BYTES and qt in (0, 1) and ps == (n + 1) // 2
    ) and ab == _cdiv(n, bs)
    eb = ELEM_BYTES.get(dt, 4)
    sizes = {"x": _alloc_size(n, valid) * eb, "packed": _alloc_size(ps, valid), "absmax": _alloc_size(ab, valid) * 4}
    if valid and max(n, ps, ab) > ALLOC_LIMIT:
        return None
    if dequant:
        pk, am, out = buf.make("packed", sizes["packed"]), buf.make("absmax", sizes["absmax"]), None
        out = buf.make("out", sizes["x"], output=True)
        rc = lib.q4_dequantize_4bit(pk, ps, am, ab, n, bs, qt, out, dt)
        return rc, valid, {"out": sizes["x"]}
    x = buf.make("x", sizes["x"])
    pk, am = buf.make("packed", sizes["packed"], output=True), buf.make("absmax", sizes["absmax"], output=True)
    rc = lib.q4_quantize_4bit(x, dt, n, bs, qt, pk, ps, am, ab)
    return rc, valid, {"packed": sizes["packed"], "absmax": sizes["absmax"]}


def _case_blockwise(inp: Input, lib, buf: _Buffers, dequant: bool):
    n, bs, dt = inp.count(), inp.count() if inp.byte() & 1 else 256, inp.code(3)
    cs = inp.count() if inp.byte() < 32 else n
    ab = inp.count() if inp.byte() < 32 else (_cdiv(n, bs) if bs > 0 else 0)
    valid = _count_ok(n) and _pow2_block(bs, 16384) and dt in ELEM_BYTES and ab == _cdiv(n, bs) and (dequant or cs == n)
    if valid and max(n, ab) > ALLOC_LIMIT:
        return None
    eb = ELEM_BYTES.get(dt, 4)
    sx, sa = _alloc_size(n, valid) * eb, _alloc_size(ab, valid) * 4
    if dequant:
        codes, am = buf.make("codes", _alloc_size(n, valid)), buf.make("absmax", sa)
        out = buf.make("out", sx, output=True)
        rc = lib.q4_dequantize_blockwise(codes, n, am, ab, bs, None, inp.byte() & 1, 0.5, out, dt)
        return rc, valid, {"out": sx}
    x = buf.make("x", sx)
    codes, am = buf.make("codes", _alloc_size(cs, valid), output=True), buf.make("absmax", sa, output=True)
    rc = lib.q4_quantize_blockwise(x, dt, n, bs, None, codes, cs, am, ab)
    return rc, valid, {"codes": _alloc_size(cs, valid), "absmax": sa}


def _case_nested(inp: Input, lib, buf: _Buffers):
    nb = inp.count()
    a2 = inp.count() if inp.byte() < 32 else _cdiv(nb, 256)
    valid = _count_ok(nb) and a2 == _cdiv(nb, 256)
    if valid and nb > ALLOC_LIMIT:
        return None
    am = buf.make("absmax", _alloc_size(nb, valid) * 4)
    codes = buf.make("codes", _alloc_size(nb, valid), output=True)
    absmax2 = buf.make("absmax2", _alloc_size(a2, valid) * 4, output=True)
    off = buf.make("offset", 4, output=True)
    rc = lib.q4_quantize_nested(am, nb, codes, absmax2, a2, off)
    return rc, valid, {"codes": _alloc_size(nb, valid), "absmax2": _alloc_size(a2, valid) * 4, "offset": 4}


def _case_blocks4(inp: Input, lib, buf: _Buffers, encode: bool):
    """q4_search_scales_4bit / q4_encode_4bit: n_blocks full fp32 blocks."""
    nb, bs, qt = inp.count(), inp.count() if inp.byte() & 1 else 64, inp.code(2)
    valid = _count_ok(nb) and _pow2_block(bs) and qt in (0, 1) and nb * bs <= MAX_ELEMENTS
    if valid and nb * bs > ALLOC_LIMIT:
        return None
    n = nb * bs if valid else 16
    x = buf.make("x", n * 4)
    if encode:
        sc = buf.make("scales", (nb if valid else 16) * 4)
        pk = buf.make("packed", n // 2, output=True)
        rc = lib.q4_encode_4bit(x, nb, bs, qt, sc, pk)
        return rc, valid, {"packed": n // 2}
    out = buf.make("scales", (nb if valid else 16) * 4, output=True)
    rc = lib.q4_search_scales_4bit(x, nb, bs, qt, out)
    return rc, valid, {"scales": (nb if valid else 16) * 4}


def _dims(inp: Input) -> tuple[int, int, int]:
    return inp.count(), inp.count(), inp.count()


def _dims_ok(m: int, n: int, k: int) -> bool:
    return _count_ok(m, n, k, m * k, n * k, m * n)


def _case_gemm4(inp: Input, lib, buf: _Buffers, grad: bool):
    m, n, k = _dims(inp)
    bs, dt, qt, nested = inp.count() if inp.byte() & 1 else 64, inp.code(3), inp.code(2), inp.byte() & 1
    nk = n * k
    ps = inp.count() if inp.byte() < 32 else (nk + 1) // 2
    nblk = inp.count() if inp.byte() < 32 else (_cdiv(nk, bs) if bs > 0 else 0)
    n2 = inp.count() if inp.byte() < 32 else _cdiv(nblk, 256)
    valid = (
        _dims_ok(m, n, k)
        and _pow2_block(bs)
        and dt in ELEM_BYTES
        and qt in (0, 1)
        and ps == (nk + 1) // 2
        and nblk == _cdiv(nk, bs)
        and (not nested or n2 == _cdiv(nblk, 256))
    )
    if valid and max(m * k, m * n, ps, nblk) > ALLOC_LIMIT:
        return None
    eb = ELEM_BYTES.get(dt, 4)
    pk = buf.make("packed", _alloc_size(ps, valid))
    absmax = buf.make("absmax", _alloc_size(nblk, valid) * (1 if nested else 4))
    nab = buf.make("nested_absmax", _alloc_size(n2, valid) * 4)
    scales = (None, absmax, nab, n2, None, 0.25, nblk) if nested else (absmax, None, None, 0, None, 0.0, nblk)
    if grad:
        dy = buf.make("dy", _alloc_size(m * n, valid) * eb)
        dx = buf.make("dx", _alloc_size(m * k, valid) * eb, output=True)
        rc = lib.q4_gemm_4bit_grad_input(dy, dt, m, n, k, pk, ps, *scales, bs, qt, dx, dt)
        return rc, valid, {"dx": _alloc_size(m * k, valid) * eb}
    x = buf.make("x", _alloc_size(m * k, valid) * eb)
    out = buf.make("out", _alloc_size(m * n, valid) * eb, output=True)
    rc = lib.q4_gemm_4bit(x, dt, m, n, k, pk, ps, *scales, bs, qt, None, 0, out, dt)
    return rc, valid, {"out": _alloc_size(m * n, valid) * eb}


def _case_int8(inp: Input, lib, buf: _Buffers, which: int):
    m, n, k = _dims(inp)
    dt = inp.code(3)
    eb = ELEM_BYTES.get(dt, 4)
    if which == 0:  # quantize rows: rows = m, cols = k
        valid = _count_ok(m, k, m * k) and dt in ELEM_BYTES
        if valid and m * k > ALLOC_LIMIT:
            return None
        x = buf.make("x", _alloc_size(m * k, valid) * eb)
        q = buf.make("q", _alloc_size(m * k, valid), output=True)
        stats = buf.make("stats", _alloc_size(m, valid) * 4, output=True)
        cols = buf.make("cols", _alloc_size(k, valid), output=True)
        rc = lib.q4_int8_quantize_rows(x, dt, m, k, 1.5, q, stats, cols)
        return (
            rc,
            valid,
            {"q": _alloc_size(m * k, valid), "stats": _alloc_size(m, valid) * 4, "cols": k if valid else 0},
        )
    valid = _dims_ok(m, n, k) and dt in ELEM_BYTES
    if valid and max(m * k, n * k, m * n) > ALLOC_LIMIT:
        return None
    w = buf.make("w", _alloc_size(n * k, valid))
    scale = buf.make("scale", _alloc_size(n, valid) * 4)
    if which == 1:
        x = buf.make("x", _alloc_size(m * k, valid) * eb)
        out = buf.make("out", _alloc_size(m * n, valid) * eb, output=True)
        rc = lib.q4_int8_linear(x, dt, m, n, k, w, scale, 1.5, None, 0, out, dt)
        return rc, valid, {"out": _alloc_size(m * n, valid) * eb}
    dy = buf.make("dy", _alloc_size(m * n, valid) * eb)
    dx = buf.make("dx", _alloc_size(m * k, valid) * eb, output=True)
    rc = lib.q4_int8_grad_input(dy, dt, m, n, k, w, scale, dx, dt)
    return rc, valid, {"dx": _alloc_size(m * k, valid) * eb}


# hyperparameters of the 8-bit optimizer step: values every one takes, and (one pick in
# eight) each way one can be bad (1.0: a bad beta, a good learning rate)
_GOOD_REALS = (1e-3, 0.0, 0.5, 0.9, 0.999)
_BAD_REALS = (-1e-3, float("nan"), float("inf"), 1.0)


def _real(inp: Input) -> float:
    b = inp.byte()
    return _GOOD_REALS[b % len(_GOOD_REALS)] if b < 224 else _BAD_REALS[b % len(_BAD_REALS)]


def _case_optim8(inp: Input, lib, buf: _Buffers):
    """optimizer_update_8bit: optimizer 0-3 (adam keeps two states), n elements
    in blocks of 256 (absmax_size = ceil(n / 256)), float parameter and gradient
    dtypes, step >= 1, lr / eps / weight_decay / gnorm_scale finite and >= 0,
    betas in [0, 1); the update output and the skipped-block count optional."""
    opt, n, pdt, gdt = inp.code(4), inp.count(), inp.code(3), inp.code(3)
    ab = inp.count() if inp.byte() < 32 else (_cdiv(n, 256) if n > 0 else 0)
    step = inp.count() if inp.byte() < 64 else 1 + inp.byte()
    lr, b1, b2, eps, wd, gs = (_real(inp) for _ in range(6))
    with_update, with_skipped = inp.byte() & 1, inp.byte() & 1

    def ok(v: float) -> bool:
        return 0.0 <= v < float("inf")

    valid = (
        0 <= opt <= 3
        and _count_ok(n)
        and pdt in ELEM_BYTES
        and gdt in ELEM_BYTES
        and ab == _cdiv(n, 256)
        and step >= 1
        and all(ok(v) for v in (lr, eps, wd, gs))
        and all(0.0 <= b < 1.0 for b in (b1, b2))
    )
    if valid and n > ALLOC_LIMIT:
        return None
    nn, na = _alloc_size(n, valid), _alloc_size(ab, valid)
    used = {"param": nn * ELEM_BYTES.get(pdt, 4), "state1": nn, "absmax1": na * 4}
    param = buf.make("param", used["param"], output=True)
    grad = buf.make("grad", nn * ELEM_BYTES.get(gdt, 4))
    s1, a1 = buf.make("state1", nn, output=True), buf.make("absmax1", na * 4, output=True)
    q1 = buf.make("qmap1", 256 * 4)
    s2 = a2 = q2 = None
    if opt == 0:
        used.update(state2=nn, absmax2=na * 4)
        s2, a2 = buf.make("state2", nn, output=True), buf.make("absmax2", na * 4, output=True)
        q2 = buf.make("qmap2", 256 * 4)
    update = skipped = None
    if with_update:
        used["update"] = nn * 4
        update = buf.make("update", nn * 4, output=True)
    if with_skipped:
        used["skipped"] = 4
        skipped = buf.make("skipped", 4, output=True)
    rc = lib.q4_optimizer_update_8bit(
        opt, param, pdt, grad, gdt, n, s1, a1, q1, s2, a2, q2, ab, step, lr, b1, b2, eps, wd, gs, skipped, update
    )
    return rc, valid, used


CASES = (
    ("quantize_4bit", lambda i, lib, b: _case_quant4(i, lib, b, False)),
    ("dequantize_4bit", lambda i, lib, b: _case_quant4(i, lib, b, True)),
    ("quantize_blockwise", lambda i, lib, b: _case_blockwise(i, lib, b, False)),
    ("dequantize_blockwise", lambda i, lib, b: _case_blockwise(i, lib, b, True)),
    ("quantize_nested", _case_nested),
    ("gemm_4bit", lambda i, lib, b: _case_gemm4(i, lib, b, False)),
    ("gemm_4bit_grad_input", lambda i, lib, b: _case_gemm4(i, lib, b, True)),
    ("int8_quantize_rows", lambda i, lib, b: _case_int8(i, lib, b, 0)),
    ("int8_linear", lambda i, lib, b: _case_int8(i, lib, b, 1)),
    ("int8_grad_input", lambda i, lib, b: _case_int8(i, lib, b, 2)),
    ("search_scales_4bit", lambda i, lib, b: _case_blocks4(i, lib, b, False)),
    ("encode_4bit", lambda i, lib, b: _case_blocks4(i, lib, b, True)),
    ("optimizer_update_8bit", _case_optim8),
)


def check(data: bytes) -> str | None:
    """Run one input; raise AssertionError if the library disagrees with the
    rule above or writes where it must not. Returns the op name (None when the
    call was valid but too large to make)."""
    inp = Input(data)
    name, case = CASES[inp.byte() % len(CASES)]
    buf = _Buffers()
    lib = native.lib()
    got = case(inp, lib, buf)
    if got is None:
        return None
    rc, valid, used = got
    msg = lib.q4_last_error().decode()
    if valid:
        assert rc == 0, f"{name}: a valid call was rejected: {msg}"
        assert buf.tails_untouched(used), f"{name}: wrote past the declared sizes"
    else:
        assert rc == 1, f"{name}: an invalid call returned {rc} (message {msg!r})"
        assert msg, f"{name}: rejected without a message"
        assert buf.untouched(), f"{name}: a rejected call wrote output"
    return name


def main() -> None:
    import atheris

    native.lib()  # load outside the instrumented callback
    atheris.instrument_func(check)
    for _, case in CASES:
        atheris.instrument_func(case)
    for fn in (
        _case_quant4,
        _case_blockwise,
        _case_nested,
        _case_gemm4,
        _case_int8,
        _case_blocks4,
        _case_optim8,
        Input.count,
        Input.code,
    ):
        atheris.instrument_func(fn)
    atheris.Setup(sys.argv, lambda data: check(bytes(data)))
    atheris.Fuzz()


if __name__ == "__main__":
    main()
