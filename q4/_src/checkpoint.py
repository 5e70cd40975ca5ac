"""Quantized checkpoints as safetensors files, framework-neutral (numpy).

The file is plain safetensors (8-byte little-endian header length, a JSON
header, the raw tensor bytes), so safetensors, transformers-style loaders and
bitsandbytes read the tensors; the keys are the bitsandbytes ones
(``<layer>.weight``, ``<layer>.weight.absmax``, ...,
``<layer>.weight.quant_state.bitsandbytes__nf4``; 8-bit: ``<layer>.weight``,
``<layer>.SCB``, ``<layer>.weight_format``). The header's ``__metadata__``
also holds ``q4.layers``: per quantized layer its kind, quant type, block
size, nesting and compute dtype, derived from the tensors at save time.

Loading checks the container (sizes, offsets, dtypes, overlaps) and then
every quantized layer (quant_state JSON against the packed bytes, absmax
length against the block count, SCB against the int8 rows) and raises
CheckpointError naming the first bad tensor. Saving writes a temporary file
in the destination directory and renames it over the target, so an
interrupted save never replaces a good checkpoint with a partial one.
"""

from __future__ import annotations

import json
import math
import os
import struct
import tempfile
from pathlib import Path

import numpy as np

from q4._src.quant_state import QuantState, QuantStateError

_JSON_KEY = ".weight.quant_state.bitsandbytes__"
_HEADER_LIMIT = 100 << 20  # a header larger than 100 MiB is not a checkpoint

# safetensors dtype name <-> numpy dtype name
_DTYPES = {
    "F64": "float64",
    "F32": "float32",
    "F16": "float16",
    "BF16": "bfloat16",
    "I64": "int64",
    "I32": "int32",
    "I16": "int16",
    "I8": "int8",
    "U8": "uint8",
    "BOOL": "bool",
}
_NAMES = {v: k for k, v in _DTYPES.items()}


class CheckpointError(ValueError):
    """A checkpoint file is truncated, corrupted or inconsistent (the message names the tensor)."""


def _np_dtype(name: str):
    if name == "bfloat16":
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(name)


def _dtype_name(arr: np.ndarray, key: str) -> str:
    name = arr.dtype.name
    if name not in _NAMES:
        raise CheckpointError(f"tensor '{key}' has dtype {name}, which safetensors cannot store")
    return _NAMES[name]


# ------------------------------------------------------------------ layers


def _layer_prefixes(tensors: dict[str, np.ndarray]) -> dict[str, str]:
    """Quantized layer prefix -> kind ('Linear4bit' or 'Linear8bitLt')."""
    layers = {}
    for key in tensors:
        if _JSON_KEY in key:
            layers[key.split(_JSON_KEY)[0]] = "Linear4bit"
        elif key.endswith(".SCB") or key == "SCB":
            layers[key[: -len("SCB")].rstrip(".")] = "Linear8bitLt"
    return layers


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def _check_4bit(tensors: dict[str, np.ndarray], prefix: str) -> dict:
    weight_key = _join(prefix, "weight")
    entries = {k[len(weight_key) + 1 :]: v for k, v in tensors.items() if k.startswith(weight_key + ".")}
    try:
        state = QuantState.from_dict(entries)
    except QuantStateError as e:
        raise CheckpointError(f"layer '{prefix}': {e}") from e
    if weight_key not in tensors:
        raise CheckpointError(f"layer '{prefix}': missing tensor '{weight_key}'")
    weight = tensors[weight_key]
    want = (math.prod(state.shape) + 1) // 2
    if weight.nbytes != want:
        raise CheckpointError(
            f"tensor '{weight_key}' holds {weight.nbytes} bytes; its quant_state shape {state.shape} needs {want}"
        )
    return {
        "kind": "Linear4bit",
        "quant_type": state.quant_type,
        "blocksize": state.blocksize,
        "nested": state.nested,
        "compute_dtype": state.dtype,
        "shape": list(state.shape),
    }


def _check_8bit(tensors: dict[str, np.ndarray], prefix: str) -> dict:
    weight_key, scb_key = _join(prefix, "weight"), _join(prefix, "SCB")
    if weight_key not in tensors:
        raise CheckpointError(f"layer '{prefix}': missing tensor '{weight_key}'")
    weight, scb = tensors[weight_key], tensors[scb_key]
    if weight.dtype != np.int8 or weight.ndim != 2:
        raise CheckpointError(f"tensor '{weight_key}' must be a 2-D int8 matrix, got {weight.dtype} {weight.shape}")
    if scb.dtype != np.float32 or scb.shape != (weight.shape[0],):
        raise CheckpointError(
            f"tensor '{scb_key}' must be float32[{weight.shape[0]}], got {scb.dtype}{list(scb.shape)}"
        )
    fmt_key = _join(prefix, "weight_format")
    if fmt_key in tensors and int(np.asarray(tensors[fmt_key]).reshape(-1)[0]) != 0:
        raise CheckpointError(f"tensor '{fmt_key}' must be 0 (row-major int8), got {tensors[fmt_key]}")
    return {"kind": "Linear8bitLt", "shape": list(weight.shape)}


def validate(tensors: dict[str, np.ndarray]) -> dict[str, dict]:
    """Check every quantized layer of a state dict; returns its q4.layers metadata."""
    layers = {}
    for prefix, kind in sorted(_layer_prefixes(tensors).items()):
        layers[prefix] = (_check_4bit if kind == "Linear4bit" else _check_8bit)(tensors, prefix)
    return layers


# ------------------------------------------------------------------- files


def save_file(tensors: dict[str, np.ndarray], path, metadata: dict[str, str] | None = None) -> None:
    """Write numpy arrays as a safetensors file, atomically (temp file + rename).

    Quantized layers are validated first and described in the header's
    ``q4.layers`` metadata; ``metadata`` adds string entries of your own.
    """
    path = Path(path)
    arrays = {}
    for key, value in tensors.items():
        if not isinstance(key, str) or not key:
            raise CheckpointError(f"tensor names must be non-empty strings, got {key!r}")
        arr = np.asarray(value)  # (np.ascontiguousarray would turn a 0-d array into 1-d)
        if not arr.flags.c_contiguous:
            arr = arr.copy(order="C")
        _dtype_name(arr, key)
        arrays[key] = arr
    meta = {str(k): str(v) for k, v in (metadata or {}).items()}
    meta["q4.layers"] = json.dumps(validate(arrays), sort_keys=True)
    header: dict = {"__metadata__": meta}
    offset = 0
    for key in sorted(arrays):
        arr = arrays[key]
        header[key] = {
            "dtype": _dtype_name(arr, key),
            "shape": list(arr.shape),
            "data_offsets": [offset, offset + arr.nbytes],
        }
        offset += arr.nbytes
    blob = json.dumps(header, separators=(",", ":")).encode("utf-8")
    blob += b" " * (-len(blob) % 8)
    directory = path.parent if str(path.parent) else Path(".")
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=directory)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(struct.pack("<Q", len(blob)))
            f.write(blob)
            for key in sorted(arrays):
                f.write(arrays[key].tobytes())
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise


def _read_header(data: bytes, path) -> tuple[dict, int]:
    if len(data) < 8:
        raise CheckpointError(f"{path}: {len(data)} bytes is too short for a safetensors file (truncated?)")
    (n,) = struct.unpack("<Q", data[:8])
    if n > _HEADER_LIMIT or 8 + n > len(data):
        raise CheckpointError(f"{path}: header of {n} bytes does not fit in the {len(data)}-byte file (truncated?)")
    try:
        header = json.loads(data[8 : 8 + n].decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path}: the header is not valid JSON (corrupted?): {e}") from e
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: the header must be a JSON object")
    return header, 8 + n


def load_file(path, *, check_layers: bool = True) -> dict[str, np.ndarray]:
    """Read a safetensors file into numpy arrays (copies), validating the
    container and, with check_layers, every quantized layer."""
    tensors, _ = _load(path)
    if check_layers:
        validate(tensors)
    return tensors


def load_metadata(path) -> dict[str, str]:
    """The header's ``__metadata__`` (``q4.layers`` is JSON describing the quantized layers)."""
    return _load(path)[1]


def _load(path) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    path = Path(path)
    try:
        data = path.read_bytes()
    except OSError as e:
        raise CheckpointError(f"cannot read checkpoint {path}: {e.strerror or e}") from e
    header, start = _read_header(data, path)
    meta = header.pop("__metadata__", {}) or {}
    body = len(data) - start
    tensors, spans = {}, []
    for key, info in header.items():
        try:
            dtype_name = _DTYPES[info["dtype"]]
            shape = tuple(int(s) for s in info["shape"])
            begin, end = (int(o) for o in info["data_offsets"])
        except (KeyError, TypeError, ValueError) as e:
            raise CheckpointError(f"{path}: tensor '{key}' has a malformed header entry {info!r}") from e
        dtype = _np_dtype(dtype_name)
        if any(s < 0 for s in shape) or not 0 <= begin <= end <= body:
            raise CheckpointError(
                f"{path}: tensor '{key}' spans bytes [{begin}, {end}) outside the {body}-byte data section (truncated?)"
            )
        if end - begin != math.prod(shape) * dtype.itemsize:
            raise CheckpointError(
                f"{path}: tensor '{key}' has {end - begin} bytes, shape {list(shape)} of {dtype_name} needs "
                f"{math.prod(shape) * dtype.itemsize}"
            )
        spans.append((begin, end, key))
        tensors[key] = np.frombuffer(data, dtype, count=math.prod(shape), offset=start + begin).reshape(shape).copy()
    spans.sort()
    for (_, e0, k0), (b1, _, k1) in zip(spans, spans[1:], strict=False):
        if b1 < e0:
            raise CheckpointError(f"{path}: tensors '{k0}' and '{k1}' overlap (corrupted header)")
    return tensors, {str(k): str(v) for k, v in meta.items()}
