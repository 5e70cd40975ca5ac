"""The 4-bit quantization state, framework-neutral (numpy arrays).

Both front ends convert their QuantState to and from this one, so the
checkpoint keys and their validation live in one place. Keys (relative to a
weight's prefix, e.g. ``weight.``), as the bitsandbytes format defines them:

  absmax                 fp32 [n_blocks], or uint8 codes [n_blocks] if nested
  quant_map              fp32 [16], the code book (must be q4's NF4/FP4 table)
  nested_absmax          fp32 [ceil(n_blocks/256)]          (nested only)
  nested_quant_map       fp32 [256], the dynamic map        (nested only)
  quant_state.bitsandbytes__<nf4|fp4>
                         uint8 UTF-8 JSON: quant_type, blocksize, dtype, shape
                         (+ nested_blocksize, nested_dtype, nested_offset)
"""

from __future__ import annotations

import dataclasses
import json
import math

import numpy as np

from q4._src import formats
from q4._src.formats import short_repr

# The one spelling of a 4-bit state's JSON entry: "<weight>.quant_state.bitsandbytes__<nf4|fp4>"
# (bitsandbytes' name). Internal API shared by q4, q4torch and q4jax.
JSON_KEY_PREFIX = "quant_state.bitsandbytes__"
_JSON_PREFIX = JSON_KEY_PREFIX


class QuantStateError(ValueError):
    """A quantization state (or its checkpoint entries) is malformed."""


@dataclasses.dataclass
class QuantState:
    """Everything needed to dequantize a packed 4-bit tensor.

    Invariants (checked by validate()): absmax has ceil(prod(shape)/blocksize)
    entries; when nested, absmax holds uint8 codes and nested_absmax has
    ceil(n_blocks/nested_blocksize) entries.
    """

    quant_type: str
    blocksize: int
    shape: tuple[int, ...]
    dtype: str  # 'float32' | 'float16' | 'bfloat16': the dtype dequantize returns
    absmax: np.ndarray
    nested_absmax: np.ndarray | None = None
    nested_offset: float | None = None
    nested_blocksize: int = 256

    @property
    def nested(self) -> bool:
        return self.nested_absmax is not None

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def n_blocks(self) -> int:
        return formats.num_blocks(self.numel, self.blocksize)

    def validate(self) -> QuantState:
        formats.check_quant_type(self.quant_type)
        formats.check_blocksize(self.blocksize)
        formats.check_dtype_name(self.dtype)
        if any(int(s) < 0 for s in self.shape) or self.numel == 0:
            raise QuantStateError(f"quant_state shape must be non-empty with positive sizes, got {self.shape}")
        want_dtype = np.uint8 if self.nested else np.float32
        if self.absmax.dtype != want_dtype or self.absmax.size != self.n_blocks:
            raise QuantStateError(
                f"absmax must be {np.dtype(want_dtype).name}[{self.n_blocks}] for shape {self.shape} and blocksize "
                f"{self.blocksize}, got {self.absmax.dtype}[{self.absmax.size}]"
            )
        if self.nested:
            if self.nested_blocksize != formats.nested_blocksize():
                raise QuantStateError(
                    f"nested_blocksize must be {formats.nested_blocksize()}, got {self.nested_blocksize}"
                )
            n2 = formats.num_blocks(self.n_blocks, self.nested_blocksize)
            na = np.asarray(self.nested_absmax)
            if na.dtype != np.float32 or na.size != n2:
                raise QuantStateError(f"nested_absmax must be float32[{n2}], got {na.dtype}[{na.size}]")
            if self.nested_offset is None or not math.isfinite(float(self.nested_offset)):
                raise QuantStateError(f"nested_offset must be a finite number, got {self.nested_offset!r}")
        return self

    # ---------------------------------------------------------- checkpoints

    def json_dict(self) -> dict:
        d = {
            "quant_type": self.quant_type,
            "blocksize": int(self.blocksize),
            "dtype": self.dtype,
            "shape": [int(s) for s in self.shape],
        }
        if self.nested:
            d.update(
                nested_blocksize=int(self.nested_blocksize),
                nested_dtype="float32",
                nested_offset=float(self.nested_offset),  # type: ignore[arg-type]  # nested: validated
            )
        return d

    def to_dict(self) -> dict[str, np.ndarray]:
        """The checkpoint entries of this state (keys without the weight prefix)."""
        out = {"absmax": self.absmax, "quant_map": formats.code_table(self.quant_type).copy()}
        if self.nested:
            out["nested_absmax"] = np.asarray(self.nested_absmax)
            out["nested_quant_map"] = formats.code_table("dynamic").copy()
        out[_JSON_PREFIX + self.quant_type] = pack_json(self.json_dict())
        return out

    @classmethod
    def from_dict(cls, entries: dict[str, np.ndarray]) -> QuantState:
        """Rebuild and validate a state from its checkpoint entries (keys without
        the weight prefix). Every malformed entry raises QuantStateError naming
        the key: the JSON must hold quant_type / dtype as strings, blocksize,
        shape and nested_blocksize as JSON integers (not bools, not floats) and
        nested_offset as a finite JSON number."""
        json_keys = sorted(k for k in entries if k.startswith(_JSON_PREFIX))
        if len(json_keys) != 1:
            raise QuantStateError(f"expected exactly one '{_JSON_PREFIX}<nf4|fp4>' entry, found {json_keys or 'none'}")
        jkey = json_keys[0]
        meta = unpack_json(entries[jkey], jkey)
        for key in ("quant_type", "blocksize", "dtype", "shape"):
            if key not in meta:
                raise QuantStateError(f"{jkey} lacks '{key}'")
        qt = meta["quant_type"]
        if not isinstance(qt, str) or jkey != _JSON_PREFIX + qt:
            raise QuantStateError(f"{jkey} holds quant_type {short_repr(qt)}")
        try:
            formats.check_quant_type(qt)
            formats.check_blocksize(meta["blocksize"])
            formats.check_dtype_name(meta["dtype"])
        except ValueError as e:
            raise QuantStateError(f"{jkey}: {e}") from e
        shape = meta["shape"]
        if (
            not isinstance(shape, list)
            or len(shape) > 32
            or not all(is_json_int(s) and 0 <= s <= _INT64_MAX for s in shape)
        ):
            raise QuantStateError(
                f"{jkey}: shape must be a list of at most 32 non-negative JSON integers, got {short_repr(shape)}"
            )
        numel = 1
        for s in shape:  # stop early: a list of many huge sizes would make a huge product
            numel *= s
            if numel > _INT64_MAX:
                break
        if numel > _INT64_MAX:
            raise QuantStateError(f"{jkey}: shape {short_repr(shape)} has more than 2**63 - 1 elements")
        nested = "nested_offset" in meta
        if nested:
            offset = meta["nested_offset"]
            if isinstance(offset, bool) or not isinstance(offset, (int, float)) or not _finite(offset):
                raise QuantStateError(f"{jkey}: nested_offset must be a finite JSON number, got {short_repr(offset)}")
            nbs = meta.get("nested_blocksize", formats.nested_blocksize())
            if not is_json_int(nbs):
                raise QuantStateError(f"{jkey}: nested_blocksize must be a JSON integer, got {short_repr(nbs)}")
            if meta.get("nested_dtype", "float32") != "float32":
                raise QuantStateError(f"{jkey}: nested_dtype must be 'float32', got {short_repr(meta['nested_dtype'])}")
        required = ["absmax", "quant_map"] + (["nested_absmax", "nested_quant_map"] if nested else [])
        for key in required:
            if key not in entries:
                raise QuantStateError(f"missing checkpoint entry '{key}'")
        _check_table(entries["quant_map"], qt, "quant_map")
        if nested:
            _check_table(entries["nested_quant_map"], "dynamic", "nested_quant_map")
        state = cls(
            quant_type=qt,
            blocksize=meta["blocksize"],
            shape=tuple(shape),
            dtype=meta["dtype"],
            absmax=np.asarray(entries["absmax"]).reshape(-1),
            nested_absmax=np.asarray(entries["nested_absmax"]).reshape(-1) if nested else None,
            nested_offset=float(meta["nested_offset"]) if nested else None,
            nested_blocksize=meta.get("nested_blocksize", 256),
        )
        try:
            return state.validate()
        except QuantStateError:
            raise
        except (ValueError, TypeError) as e:
            raise QuantStateError(f"{jkey}: {e}") from e


def _check_table(arr, which: str, key: str) -> None:
    table = formats.code_table(which)
    arr = np.asarray(arr)
    if arr.dtype != np.float32 or arr.size != table.size or not np.array_equal(arr.reshape(-1), table):
        raise QuantStateError(
            f"'{key}' is not q4's {which} code book ({arr.dtype}[{arr.size}]); custom code books are not supported"
        )


def pack_json(d: dict) -> np.ndarray:
    """JSON -> uint8 array, byte-identical to the bitsandbytes packing (json.dumps defaults)."""
    return np.frombuffer(json.dumps(d).encode("utf-8"), np.uint8).copy()


def unpack_json(arr, key: str = "quant_state") -> dict:
    """The JSON object held by a uint8 tensor (see strict_json_loads); raises QuantStateError naming ``key``."""
    arr = np.asarray(arr)
    if arr.dtype != np.uint8:
        raise QuantStateError(f"{key} must be a uint8 tensor of UTF-8 JSON, got {arr.dtype}")
    if arr.size > _JSON_STATE_LIMIT:
        raise QuantStateError(f"{key} holds {arr.size} bytes; a quant_state JSON is at most {_JSON_STATE_LIMIT}")
    try:
        d = strict_json_loads(arr.tobytes())
    except ValueError as e:
        raise QuantStateError(f"{key} is not valid UTF-8 JSON (corrupted or truncated?): {e}") from e
    if not isinstance(d, dict):
        raise QuantStateError(f"{key} must hold a JSON object, got {type(d).__name__}")
    return d


# ------------------------------------------------------------ strict JSON

_JSON_DEPTH = 32  # checkpoint JSON nests 3 levels deep (header -> tensor -> shape)
_JSON_STATE_LIMIT = 1 << 20  # bitsandbytes' quant_state JSON is a few hundred bytes
_INT64_MAX = (1 << 63) - 1


def _finite(x: int | float) -> bool:
    try:
        return math.isfinite(x)
    except OverflowError:  # an int beyond float range
        return False


def is_json_int(value) -> bool:
    """True for a JSON integer as json.loads returns it (an int, not a bool)."""
    return type(value) is int


def _unique_keys(pairs: list) -> dict:
    out = {}
    for key, value in pairs:
        if key in out:
            raise ValueError(f"duplicate key {short_repr(key)}")
        out[key] = value
    return out


def strict_json_loads(data: bytes | str, max_depth: int = _JSON_DEPTH):
    """json.loads for untrusted checkpoint JSON. Raises ValueError (never
    another type) on invalid UTF-8 or JSON, an integer too long to convert, a
    duplicate object key, or nesting deeper than ``max_depth``. (NaN and
    Infinity parse as floats, as json.loads does, so that the typed checks
    after it reject them naming the field: no field of the format takes them.)"""
    try:
        text = data.decode("utf-8") if isinstance(data, bytes) else data
        obj = json.loads(text, object_pairs_hook=_unique_keys)
    except RecursionError:
        raise ValueError(f"nested more than {max_depth} levels deep") from None
    stack = [(obj, 1)]
    while stack:
        value, depth = stack.pop()
        items = value.values() if isinstance(value, dict) else value if isinstance(value, list) else None
        if items is None:
            continue
        if depth > max_depth:
            raise ValueError(f"nested more than {max_depth} levels deep")
        stack.extend((v, depth + 1) for v in items if isinstance(v, (dict, list)))
    return obj
