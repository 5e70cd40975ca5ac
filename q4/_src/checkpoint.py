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


def layer_keys(keys, layer: str) -> list[str]:
    """The keys of one quantized layer's stored weight (``weight``, ``weight.*``,
    ``SCB``, ``weight_format``; not its bias) among ``keys``."""
    out = []
    for key in keys:
        if key.startswith(layer + "."):
            rest = key[len(layer) + 1 :]
            if rest in ("weight", "SCB", "weight_format") or rest.startswith("weight."):
                out.append(key)
    return out


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


def quantized_groups(tensors) -> dict[tuple, list[str]]:
    """The quantized layers of a state dict grouped by how a front end must
    build them: (quant_type, blocksize, nested) for 4-bit layers, ("int8",
    None, None) for 8-bit ones -> sorted layer names. Only the layers' own
    entries are read (any array type np.asarray accepts) and validated."""
    groups: dict[tuple, list[str]] = {}
    for prefix in sorted(_layer_prefixes(tensors)):
        entries = {k: np.asarray(tensors[k]) for k in layer_keys(tensors, prefix)}
        meta = validate(entries)[prefix]
        key = (
            ("int8", None, None)
            if meta["kind"] == "Linear8bitLt"
            else (meta["quant_type"], meta["blocksize"], meta["nested"])
        )
        groups.setdefault(key, []).append(prefix)
    return groups


def validate(tensors: dict[str, np.ndarray]) -> dict[str, dict]:
    """Check every quantized layer of a state dict; returns its q4.layers metadata."""
    layers = {}
    for prefix, kind in sorted(_layer_prefixes(tensors).items()):
        layers[prefix] = (_check_4bit if kind == "Linear4bit" else _check_8bit)(tensors, prefix)
    return layers


# ------------------------------------------------------------------- files


class Reader:
    """A safetensors file opened for reading one tensor at a time.

    The header is parsed and every entry checked (dtype, shape, offsets inside
    the file, no overlaps) when the file is opened; tensor data is memory-mapped
    and only read when asked for, so files larger than memory can be walked.
    """

    def __init__(self, path):
        self.path = Path(path)
        try:
            self._file = open(self.path, "rb")  # noqa: SIM115 (closed by close())
        except OSError as e:
            raise CheckpointError(f"cannot read checkpoint {self.path}: {e.strerror or e}") from e
        try:
            self._parse()
        except BaseException:
            self._file.close()
            raise

    def _parse(self) -> None:
        path, f = self.path, self._file
        size = os.fstat(f.fileno()).st_size
        head = f.read(8)
        if len(head) < 8:
            raise CheckpointError(f"{path}: {size} bytes is too short for a safetensors file (truncated?)")
        (n,) = struct.unpack("<Q", head)
        if n > _HEADER_LIMIT or 8 + n > size:
            raise CheckpointError(f"{path}: header of {n} bytes does not fit in the {size}-byte file (truncated?)")
        try:
            header = json.loads(f.read(n).decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise CheckpointError(f"{path}: the header is not valid JSON (corrupted?): {e}") from e
        if not isinstance(header, dict):
            raise CheckpointError(f"{path}: the header must be a JSON object")
        meta = header.pop("__metadata__", {}) or {}
        if not isinstance(meta, dict):
            raise CheckpointError(f"{path}: __metadata__ must be a JSON object")
        self.metadata = {str(k): str(v) for k, v in meta.items()}
        self._start, body = 8 + n, size - 8 - n
        self._entries: dict[str, tuple[np.dtype, tuple[int, ...], int, int]] = {}
        spans = []
        for key, info in header.items():
            try:
                dtype_name = _DTYPES[info["dtype"]]
                shape = tuple(int(s) for s in info["shape"])
                begin, end = (int(o) for o in info["data_offsets"])
            except (KeyError, TypeError, ValueError) as e:
                bad = info.get("dtype") if isinstance(info, dict) and info.get("dtype") not in _DTYPES else None
                what = f"unsupported dtype {bad!r}" if bad else f"a malformed header entry {info!r}"
                raise CheckpointError(f"{path}: tensor '{key}' has {what}") from e
            dtype = _np_dtype(dtype_name)
            if any(s < 0 for s in shape) or not 0 <= begin <= end <= body:
                raise CheckpointError(
                    f"{path}: tensor '{key}' spans bytes [{begin}, {end}) outside the {body}-byte data section "
                    "(truncated?)"
                )
            if end - begin != math.prod(shape) * dtype.itemsize:
                raise CheckpointError(
                    f"{path}: tensor '{key}' has {end - begin} bytes, shape {list(shape)} of {dtype_name} needs "
                    f"{math.prod(shape) * dtype.itemsize}"
                )
            spans.append((begin, end, key))
            self._entries[key] = (dtype, shape, begin, end)
        spans.sort()
        for (_, e0, k0), (b1, _, k1) in zip(spans, spans[1:], strict=False):
            if b1 < e0:
                raise CheckpointError(f"{path}: tensors '{k0}' and '{k1}' overlap (corrupted header)")
        self._map = None

    def keys(self) -> list[str]:
        """Tensor names in file order (by data offset)."""
        return sorted(self._entries, key=lambda k: self._entries[k][2])

    def __contains__(self, key: str) -> bool:
        return key in self._entries

    def dtype(self, key: str) -> np.dtype:
        return self._entries[key][0]

    def shape(self, key: str) -> tuple[int, ...]:
        return self._entries[key][1]

    def nbytes(self, key: str) -> int:
        _, _, begin, end = self._entries[key]
        return end - begin

    def view(self, key: str) -> np.ndarray:
        """A read-only, memory-mapped view (no data is read until used)."""
        dtype, shape, begin, end = self._entries[key]
        if end == begin:
            return np.zeros(shape, dtype)
        if self._map is None:
            self._map = np.memmap(self._file, np.uint8, mode="r")
        return self._map[self._start + begin : self._start + end].view(dtype).reshape(shape)

    def read(self, key: str) -> np.ndarray:
        """The tensor as a fresh, aligned, writable array (read with pread: the
        file's pages are not kept mapped)."""
        dtype, shape, begin, end = self._entries[key]
        out = np.empty(shape, dtype)
        buf = memoryview(out.reshape(-1).view(np.uint8)) if out.size else memoryview(b"")
        pos, fd = 0, self._file.fileno()
        while pos < end - begin:
            n = os.preadv(fd, [buf[pos:]], self._start + begin + pos)
            if n <= 0:
                raise CheckpointError(f"{self.path}: tensor '{key}' ends early (the file shrank while reading)")
            pos += n
        return out

    def chunks(self, key: str, size: int = 16 << 20):
        """The tensor's raw bytes in pieces of at most ``size`` bytes."""
        _, _, begin, end = self._entries[key]
        fd = self._file.fileno()
        for pos in range(begin, end, size):
            data = os.pread(fd, min(size, end - pos), self._start + pos)
            if not data:
                raise CheckpointError(f"{self.path}: tensor '{key}' ends early (the file shrank while reading)")
            yield data

    def copy_to(self, writer: Writer, key: str) -> None:
        """Append this tensor to ``writer`` unchanged, a piece at a time."""
        dtype, shape, _, _ = self._entries[key]
        writer.add_raw(key, _NAMES[dtype.name], shape, self.chunks(key))

    def close(self) -> None:
        self._map = None
        self._file.close()

    def __enter__(self) -> Reader:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class Writer:
    """Writes a safetensors file tensor by tensor, atomically.

    ``header_bytes`` reserves room for the header before the data (an upper
    bound: see header_bound); tensors are appended as they come, the header is
    written last, padded with spaces, and the temporary file replaces ``path``
    on commit(). Leaving the ``with`` block by an exception (or calling
    abort()) removes the temporary file, so no partial output is ever left.
    """

    def __init__(self, path, header_bytes: int):
        self.path = Path(path)
        self._reserved = 8 + header_bytes + (-header_bytes % 8)
        directory = self.path.parent if str(self.path.parent) else Path(".")
        try:
            fd, self._tmp = tempfile.mkstemp(prefix=f".{self.path.name}.", suffix=".tmp", dir=directory)
        except OSError as e:
            raise CheckpointError(f"cannot write {self.path}: {e.strerror or e}") from e
        self._file = os.fdopen(fd, "wb")
        self._file.seek(self._reserved)
        self._header: dict = {}
        self._offset = 0

    def add(self, key: str, value) -> None:
        arr = np.asarray(value)  # (np.ascontiguousarray would turn a 0-d array into 1-d)
        if not arr.flags.c_contiguous:
            arr = arr.copy(order="C")
        self.add_raw(key, _dtype_name(arr, key), arr.shape, [arr.reshape(-1).view(np.uint8)] if arr.size else [])

    def add_raw(self, key: str, dtype: str, shape, pieces) -> None:
        """Append a tensor given as its safetensors dtype, shape and byte pieces."""
        if not isinstance(key, str) or not key:
            raise CheckpointError(f"tensor names must be non-empty strings, got {key!r}")
        if key in self._header:
            raise CheckpointError(f"tensor '{key}' written twice")
        begin = self._offset
        for piece in pieces:
            self._file.write(piece)
            self._offset += memoryview(piece).nbytes
        want = math.prod(shape) * _np_dtype(_DTYPES[dtype]).itemsize
        if self._offset - begin != want:
            raise CheckpointError(
                f"tensor '{key}': {self._offset - begin} bytes written, {dtype}{list(shape)} needs {want}"
            )
        self._header[key] = {"dtype": dtype, "shape": [int(s) for s in shape], "data_offsets": [begin, self._offset]}

    def finish(self, metadata: dict[str, str] | None = None) -> None:
        """Write the header and flush; the file stays temporary until publish()."""
        header = {"__metadata__": {str(k): str(v) for k, v in (metadata or {}).items()}, **self._header}
        blob = json.dumps(header, separators=(",", ":")).encode("utf-8")
        if len(blob) > self._reserved - 8:
            raise CheckpointError(f"header of {len(blob)} bytes exceeds the {self._reserved - 8} bytes reserved")
        blob += b" " * (self._reserved - 8 - len(blob))
        f = self._file
        f.seek(0)
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        f.flush()
        os.fsync(f.fileno())
        f.close()

    @property
    def size(self) -> int:
        """Bytes in the file (header + data)."""
        return self._reserved + self._offset

    def publish(self) -> None:
        """Move the finished file to its destination."""
        os.replace(self._tmp, self.path)
        self._tmp = None

    def commit(self, metadata: dict[str, str] | None = None) -> None:
        self.finish(metadata)
        self.publish()

    def abort(self) -> None:
        """Drop the temporary file (no-op once published)."""
        self._file.close()
        if self._tmp is not None:
            try:
                os.unlink(self._tmp)
            except FileNotFoundError:
                pass
            self._tmp = None

    def __enter__(self) -> Writer:
        return self

    def __exit__(self, *exc) -> None:
        self.abort()


def header_bound(entries: dict[str, tuple[str, tuple[int, ...], int]], metadata: dict[str, str]) -> int:
    """An upper bound on the header size of a file holding ``entries``
    (name -> (safetensors dtype, shape, upper bound on bytes))."""
    total = sum(n for _, _, n in entries.values())
    header = {"__metadata__": metadata}
    for key, (dtype, shape, _) in entries.items():
        header[key] = {"dtype": dtype, "shape": list(shape), "data_offsets": [total, total]}
    return len(json.dumps(header, separators=(",", ":")).encode("utf-8")) + 8


def save_file(tensors: dict[str, np.ndarray], path, metadata: dict[str, str] | None = None) -> None:
    """Write numpy arrays as a safetensors file, atomically (temp file + rename).

    Quantized layers are validated first and described in the header's
    ``q4.layers`` metadata; ``metadata`` adds string entries of your own.
    """
    arrays = {}
    for key, value in tensors.items():
        if not isinstance(key, str) or not key:
            raise CheckpointError(f"tensor names must be non-empty strings, got {key!r}")
        arrays[key] = np.asarray(value)
        _dtype_name(arrays[key], key)
    meta = {str(k): str(v) for k, v in (metadata or {}).items()}
    meta["q4.layers"] = json.dumps(validate(arrays), sort_keys=True)
    bound = header_bound({k: (_dtype_name(a, k), a.shape, a.nbytes) for k, a in arrays.items()}, meta)
    with Writer(path, bound) as w:
        for key in sorted(arrays):
            w.add(key, arrays[key])
        w.commit(meta)


def load_file(path, *, check_layers: bool = True) -> dict[str, np.ndarray]:
    """Read a safetensors file into numpy arrays (copies), validating the
    container and, with check_layers, every quantized layer."""
    with Reader(path) as r:
        tensors = {key: r.read(key) for key in r.keys()}
    if check_layers:
        validate(tensors)
    return tensors


def load_metadata(path) -> dict[str, str]:
    """The header's ``__metadata__`` (``q4.layers`` is JSON describing the quantized layers)."""
    with Reader(path) as r:
        return r.metadata
