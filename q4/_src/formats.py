"""Format constants, read from the kernel library (the single source of truth).

Everything here is derived from libq4's tables; nothing is restated in Python.
"""

from __future__ import annotations

import ctypes
import functools
from typing import Any

import numpy as np

from q4._src import native

# dtype name -> kernel dtype code (part of the C ABI)
DTYPE_CODES = {"float32": 0, "float16": 1, "bfloat16": 2}
# q4_code_table's indices of the 8-bit dynamic maps (every other index is a 4-bit format's code)
_DYNAMIC_TABLES = {"dynamic": 2, "udynamic": 3}


def quant_type_codes() -> dict[str, int]:
    """The 4-bit formats, name -> kernel code (quant_type), in the library's
    order: its format list (kernels/include/q4/formats.h, read through
    q4_formats()) is the only list of them. Read once; afterwards
    QUANT_TYPE_CODES, QUANT_TYPES and LAYER_TYPES are plain module attributes
    (no call inside a torch.compile graph)."""
    codes = globals().get("QUANT_TYPE_CODES")
    if codes is None:
        codes = native.formats()
        globals().update(QUANT_TYPE_CODES=codes, QUANT_TYPES=tuple(codes), LAYER_TYPES=(*codes, "int8"))
    return codes


def __getattr__(name: str) -> Any:
    # The format names are the library's, read when first asked for (which
    # loads it): QUANT_TYPES (the 4-bit formats), QUANT_TYPE_CODES (name ->
    # kernel code) and LAYER_TYPES (what a layer can be quantized to: a 4-bit
    # format, or LLM.int8).
    if name in ("QUANT_TYPE_CODES", "QUANT_TYPES", "LAYER_TYPES"):
        quant_type_codes()
        return globals()[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _quoted(names) -> str:
    """'a', 'b' or 'c'."""
    names = [repr(n) for n in names]
    return names[0] if len(names) == 1 else ", ".join(names[:-1]) + " or " + names[-1]


@functools.cache
def code_table(which: str) -> np.ndarray:
    """The code book of a 4-bit format ('nf4', 'fp4': 16 fp32 values indexed
    by nibble), 'dynamic' (the 256-entry signed 8-bit dynamic map) or
    'udynamic' (the unsigned one, of the 8-bit optimizers' second state), as a
    read-only array."""
    index = {**quant_type_codes(), **_DYNAMIC_TABLES}
    if which not in index:
        raise ValueError(f"code table must be one of {sorted(index)}, got {which!r}")
    out = np.empty(256 if which in _DYNAMIC_TABLES else 16, np.float32)
    native.check(native.lib().q4_code_table(index[which], out.ctypes.data_as(ctypes.POINTER(ctypes.c_float)), out.size))
    out.setflags(write=False)
    return out


def min_blocksize() -> int:
    """The smallest 4-bit block size (32), read from the library."""
    return int(native.lib().q4_min_blocksize())


def max_blocksize() -> int:
    """The largest 4-bit block size (4096), read from the library."""
    return int(native.lib().q4_max_blocksize())


def nested_blocksize() -> int:
    """The block size of the nested (8-bit) quantization of the absmax (256)."""
    return int(native.lib().q4_nested_blocksize())


def max_blocksize8() -> int:
    return int(native.lib().q4_max_blocksize8())


def check_blocksize8(blocksize: int) -> int:
    """Validate an 8-bit blockwise block size: a power of two in [32, 16384]."""
    return check_blocksize(blocksize, max_blocksize8())


def check_blocksize(blocksize: int, hi: int | None = None) -> int:
    """Validate a 4-bit block size: a power of two in [32, 4096] (or up to
    ``hi``), an int (not a bool or a float); anything else raises ValueError."""
    lo, hi = min_blocksize(), max_blocksize() if hi is None else hi
    if (
        isinstance(blocksize, bool)
        or not isinstance(blocksize, (int, np.integer))
        or not (lo <= blocksize <= hi)
        or blocksize & (blocksize - 1)
    ):
        raise ValueError(f"blocksize must be a power of two in [{lo}, {hi}], got {short_repr(blocksize)}")
    return int(blocksize)


# activation_quant of the 4-bit matmuls -> the kernel op (None: X as given)
ACTIVATION_QUANT_OPS = {None: "gemm_4bit", "int8": "gemm_4bit_w4a8"}


def check_activation_quant(activation_quant) -> str | None:
    """None (activations as given, the default) or 'int8' (W4A8: activations
    quantized to int8 per row in blocks, integer dot products); anything else
    raises ValueError."""
    if activation_quant is not None and (not isinstance(activation_quant, str) or activation_quant != "int8"):
        raise ValueError(f"activation_quant must be None or 'int8', got {short_repr(activation_quant)}")
    return activation_quant


def w4a8_act_block(blocksize: int) -> int:
    """W4A8's activation block for a weight block size: min(64, blocksize)."""
    return int(native.lib().q4_w4a8_act_block(int(blocksize)))


def check_w4a8_features(k: int, blocksize: int) -> None:
    """W4A8 needs in_features to be a multiple of its activation block."""
    ba = w4a8_act_block(blocksize)
    if k % ba:
        raise ValueError(
            f"activation_quant='int8' needs in_features to be a multiple of {ba} "
            f"(the activation block for blocksize {blocksize}), got in_features {k}"
        )


def check_quant_type(quant_type: str) -> int:
    """The kernel code of a 4-bit format ('nf4', 'fp4'); anything else
    (including a non-string) raises ValueError."""
    codes = quant_type_codes()
    if not isinstance(quant_type, str) or quant_type not in codes:
        raise ValueError(f"quant_type must be {_quoted(codes)}, got {short_repr(quant_type)}")
    return codes[quant_type]


def check_layer_type(quant_type: str, what: str = "quant_type") -> str:
    """'nf4', 'fp4' or 'int8' (what a layer is quantized to); anything else raises ValueError."""
    layer_types = (*quant_type_codes(), "int8")
    if not isinstance(quant_type, str) or quant_type not in layer_types:
        raise ValueError(f"{what} must be one of {', '.join(layer_types)}, got {short_repr(quant_type)}")
    return quant_type


def check_threshold(threshold) -> float:
    """LLM.int8's outlier threshold: >= 0 (0 disables outliers); NaN and
    negatives raise ValueError naming the value. Returns it as a float."""
    if not threshold >= 0:
        raise ValueError(f"threshold must be >= 0 (0 disables outliers), got {threshold}")
    return float(threshold)


def check_layer_options(quant_type: str, blocksize: int, activation_quant) -> None:
    """The options every whole-model quantizer takes (replace_linear,
    quantize_model, Q4Config): a layer type, a 4-bit block size, and
    activation_quant only for the 4-bit layers; ValueError naming the value."""
    check_layer_type(quant_type)
    check_activation_quant(activation_quant)
    if quant_type != "int8":
        check_blocksize(blocksize)
    elif activation_quant is not None:
        raise ValueError("activation_quant applies to the 4-bit layers (quant_type 'nf4' or 'fp4'), not to 'int8'")


def check_dtype_name(name: str) -> int:
    """The kernel code of a dtype name; anything else (including a non-string) raises ValueError."""
    if not isinstance(name, str) or name not in DTYPE_CODES:
        raise ValueError(f"dtype must be float32, float16 or bfloat16, got {short_repr(name)}")
    return DTYPE_CODES[name]


def short_repr(value, limit: int = 80) -> str:
    """repr(value), cut to ``limit`` characters (error messages quote untrusted values)."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def num_blocks(n: int, blocksize: int) -> int:
    return -(-n // blocksize)


def packed_bytes(n: int) -> int:
    return (n + 1) // 2


def check_packed_size(nbytes: int, n: int, what: str, described: str, error: type[ValueError] = ValueError) -> None:
    """The one size check of packed 4-bit bytes: n elements take ceil(n/2)
    bytes; `error` (a ValueError) "<what> has <nbytes> bytes, <described> needs <need>"."""
    need = packed_bytes(n)
    if nbytes != need:
        raise error(f"{what} has {nbytes} bytes, {described} needs {need}")
