"""The contributor checklists of kernels/README.md stay true: the files that
list every 4-bit format, every op or every ISA level are counted here, so a
change that adds another such list fails (and the checklist is updated, or the
list is generated from the one source instead)."""

import io
import re
import tokenize
from pathlib import Path

import pytest
from q4_reference import oracle

from q4._src import formats, native

ROOT = Path(__file__).resolve().parents[2]
# the library's sources: where a format, an op or a level must be added
LIBRARY = ("kernels", "q4", "q4torch", "q4jax")
CPP = {".h", ".cc", ".cu", ".cuh", ".inc"}


def _cpp_code(text: str) -> str:
    """C++ text without its comments."""
    return re.sub(r"//[^\n]*", "", re.sub(r"/\*.*?\*/", "", text, flags=re.S))


def _py_strings(text: str) -> set[str]:
    """The values of a Python file's plain string literals (not docstrings or messages that quote a name)."""
    out = set()
    for tok in tokenize.generate_tokens(io.StringIO(text).readline):
        if tok.type == tokenize.STRING:
            s = tok.string.lstrip("rbuRBU")
            if len(s) >= 2 and s[0] in "\"'" and s[-1] == s[0]:
                out.add(s[1:-1])
    return out


def _files_naming_all(names, dirs=LIBRARY, cpp_regex=lambda n: rf"\b{re.escape(n)}\b"):
    """Source files (under dirs) whose code names every one of `names` (C++:
    cpp_regex(name) outside comments; Python: a string literal equal to the
    name): the lists that a new member has to join."""
    found = set()
    for d in dirs:
        for path in sorted((ROOT / d).rglob("*")):
            if path.suffix in CPP:
                code = _cpp_code(path.read_text())
                if all(re.search(cpp_regex(n), code) for n in names):
                    found.add(path.relative_to(ROOT).as_posix())
            elif path.suffix == ".py":
                strings = _py_strings(path.read_text())
                if all(n in strings for n in names):
                    found.add(path.relative_to(ROOT).as_posix())
    return found


def _format_rows():
    """(name, id) of each row of Q4_FORMATS in kernels/include/q4/formats.h."""
    text = (ROOT / "kernels/include/q4/formats.h").read_text()
    block = re.search(r"#define Q4_FORMATS\(X\)((?:.*\\\n)*.*\n)", text).group(1)
    return [(m[0], int(m[1])) for m in re.findall(r"X\((\w+),\s*\w+,\s*(\d+),", block)]


def test_the_format_list_is_the_library_s():
    """q4_formats() is formats.h's list, Python's names are the library's, and
    the independent oracle knows every format (a new one fails here until the
    oracle has it)."""
    rows = _format_rows()
    assert dict(rows) == native.formats() == formats.QUANT_TYPE_CODES
    assert formats.QUANT_TYPES == tuple(name for name, _ in rows)
    assert set(oracle.TABLES) == set(formats.QUANT_TYPES) == set(oracle.W4A8_TABLE_SCALE)


def test_a_format_touches_at_most_four_files():
    """Adding a 4-bit format: its header q4/<name>.h, its row in q4/formats.h,
    the oracle (tests/q4_reference/oracle.py) and the tests' parametrisation
    (tests/kernels/test_quant4.py). No other library file lists the formats
    (the per-format bitsandbytes classes LinearNF4 / LinearFP4 and the
    quantize_nf4 / quantize_fp4 functions are not lists)."""
    lists = _files_naming_all(formats.QUANT_TYPES, cpp_regex=lambda n: rf"\bk{n.upper()}\b|\b{n}\b")
    known = {"kernels/include/q4/formats.h"}
    # q4torch's and q4jax's per-format classes and functions name one each
    extra = (
        lists
        - known
        - {
            "q4torch/_src/linear4bit.py",
            "q4torch/_src/embedding.py",
            "q4torch/functional.py",
            "q4jax/_src/embedding.py",
        }
    )
    assert not extra, f"these files list every 4-bit format; make them read q4/formats.h's list: {sorted(extra)}"
    touched = {"kernels/include/q4/<name>.h", *known, "tests/q4_reference/oracle.py", "tests/kernels/test_quant4.py"}
    assert len(touched) <= 4


def test_an_op_is_one_entry():
    """Adding an op (README 'Checklist: adding an op'): kernels.h, validate.cc,
    cpu/<op>.cc, cuda/<op>.cu, c_api_ops.inc, xla_ffi_batched.h, xla_ffi.cc,
    xla_ffi_cuda.cu. The C ABI, its ctypes signatures and the FFI registrations
    come from the c_api_ops.inc entry; the builds take every cpu/*.cc and
    cuda/*.cu (no list to add to)."""
    ops = re.findall(r"^Q4_OP\((\w+),", (ROOT / "kernels/bind/c_api_ops.inc").read_text(), flags=re.M)
    assert ops and set(ops) == set(native.op_names())
    lists = _files_naming_all(ops, dirs=("kernels", "q4"))
    assert lists <= {
        "kernels/bind/c_api_ops.inc",
        "kernels/bind/xla_ffi.cc",
        "kernels/bind/xla_ffi_cuda.cu",
        "kernels/bind/xla_ffi_batched.h",
        "kernels/include/q4/kernels.h",
        "kernels/validate.cc",
    }, sorted(lists)
    for build in ("CMakeLists.txt", "BUILD"):
        text = (ROOT / build).read_text()
        assert "kernels/cpu/*.cc" in text and "kernels/cpu/int8.cc" not in text, build
    assert "kernels/cuda/*.cu" in (ROOT / "CMakeLists.txt").read_text()
    touched = {
        "kernels/include/q4/kernels.h",
        "kernels/validate.cc",
        "kernels/cpu/<op>.cc",
        "kernels/cuda/<op>.cu",
        "kernels/bind/c_api_ops.inc",
        "kernels/bind/xla_ffi_batched.h",
        "kernels/bind/xla_ffi.cc",
        "kernels/bind/xla_ffi_cuda.cu",
    }
    assert len(touched) <= 8


def test_the_isa_units_have_no_stubs_or_own_preamble():
    """Every x86 unit opens its level with x86/unit.h's Q4_UNIT_BEGIN (no
    `#pragma GCC target` of its own, no non-x86 stub: the builds compile
    cpu/x86/ on x86 only), and no kernel outside the table tests the level."""
    for path in sorted((ROOT / "kernels/cpu/x86").rglob("*.cc")):
        text = path.read_text()
        level = path.parent.name
        assert f"Q4_UNIT_BEGIN({level})" in text and "Q4_UNIT_END" in text, path
        assert "#pragma GCC target" not in text and "#else" not in text, path
    for path in sorted((ROOT / "kernels/cpu").rglob("*")):
        if path.suffix in CPP and path.name != "isa.cc":
            assert "cpu_isa()" not in _cpp_code(path.read_text()), path


def test_an_isa_level_touches_at_most_six_files():
    """Adding an ISA level (README 'Checklist: adding an ISA level'): its row
    in Q4_ISA_LEVELS (include/q4/kernels.h), its feature test and kernels in
    cpu/isa.cc, its entries in cpu/dispatch.h, its target features in
    cpu/x86/unit.h, its units cpu/x86/<level>/*.cc (the builds take the
    folder), and its row in README's level table. Python reads the names
    through q4_cpu_isa_names(). Beyond these, only tests name every level
    (their per-level expectations)."""
    names = native.isa_names()
    assert list(names) == list(range(len(names))) and names[0] == "scalar"
    camel = {n: "".join(part.capitalize() for part in n.split("_")) for n in names.values()}
    lists = _files_naming_all(names.values(), cpp_regex=lambda n: rf"\bkIsa{camel[n]}\b|\b{n}\b")
    assert lists <= {"kernels/include/q4/kernels.h", "kernels/cpu/isa.cc", "kernels/cpu/dispatch.h"}, sorted(lists)
    unit = (ROOT / "kernels/cpu/x86/unit.h").read_text()
    assert all(f"#define Q4_FEATURES_{n} " in unit for n in names.values() if n != "scalar")
    touched = {
        "kernels/include/q4/kernels.h",
        "kernels/cpu/isa.cc",
        "kernels/cpu/dispatch.h",
        "kernels/cpu/x86/unit.h",
        "kernels/cpu/x86/<level>/<op>.cc",
        "kernels/README.md",
    }
    assert len(touched) <= 6


def test_each_level_s_support_is_asked_by_name():
    """native.cpu_has_isa answers for every level of the library's list (what
    the tests' level fixtures skip on), agrees with the per-level functions,
    and refuses a name the list lacks."""
    names = list(native.isa_names().values())
    assert native.cpu_has_isa("scalar")
    named = {
        "avx2": native.cpu_has_avx2,
        "avx512": native.cpu_has_avx512,
        "avx512_bf16": native.cpu_has_avx512_bf16,
        "amx": native.cpu_has_amx,
    }
    for name in names[1:]:
        assert native.cpu_has_isa(name) == named[name]()
    # each level implies the ones below it
    has = [native.cpu_has_isa(n) for n in names]
    assert has == sorted(has, reverse=True)
    with pytest.raises(ValueError, match="isa must be one of scalar"):
        native.cpu_has_isa("avx1024")
