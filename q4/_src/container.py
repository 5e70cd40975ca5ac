"""The safetensors container, numpy in and out: a strict Reader (one tensor at
a time, pread or memory-mapped), a streaming Writer published atomically
(atomic.py), and the shard files of a checkpoint (input_files).

The file is plain safetensors (8-byte little-endian header length, a JSON
header, the raw tensor bytes), so safetensors, transformers-style loaders and
bitsandbytes read the tensors. Nothing here knows what a quantized layer is:
the keys and what they must hold are schema.py's.
"""

from __future__ import annotations

import json
import math
import os
import stat
import struct
from pathlib import Path
from typing import Any

import numpy as np

from q4._src import atomic
from q4._src.atomic import CheckpointError
from q4._src.formats import short_repr
from q4._src.quant_state import is_json_int, strict_json_loads

_HEADER_LIMIT = 100 << 20  # a header larger than 100 MiB is not a checkpoint
_INT64_MAX = (1 << 63) - 1
_MAX_RANK = 32  # numpy 1.x's limit (2.x: 64); no checkpoint tensor comes near it
_ALIGN = 64  # the data section starts at a multiple of this (and so every tensor at one of its element size)
_WIDE = (8, 4, 2)  # element sizes laid out first, widest first (safetensors' own order)
# safetensors dtype name <-> numpy dtype name
DTYPES = {
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
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}
INDEX_SUFFIX = ".index.json"  # a sharded checkpoint's index: {"weight_map": {tensor: shard file name}}


def np_dtype(name: str):
    """The numpy dtype of a numpy dtype name (bfloat16: ml_dtypes')."""
    if name == "bfloat16":
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(name)


def dtype_name(arr: np.ndarray, key: str) -> str:
    """The safetensors dtype name of ``arr`` (CheckpointError naming ``key`` if it has none)."""
    name = arr.dtype.name
    if name not in DTYPE_NAMES:
        raise CheckpointError(f"tensor '{key}' has dtype {name}, which safetensors cannot store")
    return DTYPE_NAMES[name]


class Reader:
    """A safetensors file opened for reading one tensor at a time.

    The header is parsed strictly and every entry checked when the file is
    opened: dtype a safetensors name, shape a list of non-negative JSON
    integers, data_offsets two JSON integers inside the data section, size
    matching shape and dtype, no overlaps, metadata a JSON object of strings;
    anything else raises CheckpointError naming the tensor. Tensor data is read
    only when asked for (read, chunks: pread, so a file that shrinks raises
    CheckpointError; view: memory-mapped), so files larger than memory can be
    walked.
    """

    def __init__(self, path):
        self.path = Path(path)
        try:
            # (O_NONBLOCK: opening a FIFO must not wait for a writer; it is refused below)
            fd = os.open(self.path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        except (OSError, ValueError) as e:  # ValueError: a NUL byte in the path
            raise CheckpointError(f"cannot read checkpoint {self.path}: {getattr(e, 'strerror', None) or e}") from e
        self._file = os.fdopen(fd, "rb")
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            self._file.close()
            raise CheckpointError(f"cannot read checkpoint {self.path}: not a regular file")
        self._map = None
        try:
            self._parse()
        except BaseException:
            self._file.close()
            raise

    def _parse(self) -> None:
        path, fd = self.path, self._file.fileno()
        size = os.fstat(fd).st_size
        head = os.pread(fd, 8, 0)
        if len(head) < 8:
            raise CheckpointError(f"{path}: {size} bytes is too short for a safetensors file (truncated?)")
        (n,) = struct.unpack("<Q", head)
        if n > _HEADER_LIMIT or 8 + n > size:
            if os.pread(fd, 1, 8) != b"{":  # a safetensors header is a JSON object
                raise CheckpointError(f"{path}: not a safetensors file ({_file_kind(head)})")
            raise CheckpointError(f"{path}: header of {n} bytes does not fit in the {size}-byte file (truncated?)")
        raw = os.pread(fd, n, 8)
        if len(raw) < n:
            raise CheckpointError(f"{path}: the header ends early (the file shrank while reading)")
        try:
            header = strict_json_loads(raw)
        except ValueError as e:
            raise CheckpointError(f"{path}: the header is not valid JSON (corrupted?): {e}") from e
        if not isinstance(header, dict):
            raise CheckpointError(f"{path}: the header must be a JSON object")
        meta = header.pop("__metadata__", None) or {}
        if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
            raise CheckpointError(f"{path}: __metadata__ must be a JSON object of strings, got {short_repr(meta)}")
        self.metadata: dict[str, str] = meta
        self.size = size  # bytes, when opened
        self._start, body = 8 + n, size - 8 - n
        self._entries: dict[str, tuple[np.dtype, tuple[int, ...], int, int]] = {}
        spans = []
        for key, info in header.items():
            name = quote(key)
            if not isinstance(info, dict):
                raise CheckpointError(f"{path}: tensor {name} has a malformed header entry {short_repr(info)}")
            dtype_name, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
            if not isinstance(dtype_name, str) or dtype_name not in DTYPES:
                raise CheckpointError(f"{path}: tensor {name} has unsupported dtype {short_repr(dtype_name)}")
            if not isinstance(shape, list) or not all(is_json_int(s) and 0 <= s <= _INT64_MAX for s in shape):
                raise CheckpointError(
                    f"{path}: tensor {name}: shape must be a list of non-negative JSON integers, got {short_repr(shape)}"
                )
            dtype = np_dtype(DTYPES[dtype_name])
            # (numpy refuses these even when a zero size makes the tensor empty)
            if len(shape) > _MAX_RANK or _nbytes([s for s in shape if s], dtype.itemsize, _INT64_MAX) > _INT64_MAX:
                raise CheckpointError(
                    f"{path}: tensor {name}: shape {short_repr(shape)} of {dtype_name} has more than {_MAX_RANK} "
                    "dimensions or more than 2**63 - 1 bytes (ignoring zero sizes)"
                )
            if not isinstance(offsets, list) or len(offsets) != 2 or not all(is_json_int(o) for o in offsets):
                raise CheckpointError(
                    f"{path}: tensor {name}: data_offsets must be two JSON integers, got {short_repr(offsets)}"
                )
            begin, end = offsets
            if not 0 <= begin <= end <= body:
                raise CheckpointError(
                    f"{path}: tensor {name} spans bytes [{begin}, {end}) outside the {body}-byte data section "
                    "(truncated?)"
                )
            need = _nbytes(shape, dtype.itemsize, body)
            if end - begin != need:
                needs = f"more than {body}" if need > body else need
                raise CheckpointError(
                    f"{path}: tensor {name} has {end - begin} bytes, shape {short_repr(shape)} of {dtype_name} needs "
                    f"{needs}"
                )
            spans.append((begin, end, key))
            self._entries[key] = (dtype, tuple(shape), begin, end)
        spans.sort()
        for (_, e0, k0), (b1, _, k1) in zip(spans, spans[1:], strict=False):
            if b1 < e0:
                raise CheckpointError(f"{path}: tensors {quote(k0)} and {quote(k1)} overlap (corrupted header)")
        self._end = self._start + max((e for _, e, _ in spans), default=0)

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

    def check_size(self) -> None:
        """Raise CheckpointError if the file is now shorter than its header says
        (it was truncated after it was opened)."""
        size = os.fstat(self._file.fileno()).st_size
        if size < self._end:
            raise CheckpointError(
                f"{self.path}: the file shrank to {size} bytes while open; its tensors need {self._end}"
            )

    def view(self, key: str) -> np.ndarray:
        """A read-only, memory-mapped view (no data is read until used).

        The file's size is checked first (CheckpointError if it shrank since it
        was opened), but a mapping cannot protect against a truncation after
        the view is made: touching the lost pages then kills the process with
        SIGBUS. Use read() or chunks() where another process may truncate the
        file; ``q4 inspect`` does."""
        dtype, shape, begin, end = self._entries[key]
        if end == begin:
            return np.zeros(shape, dtype)
        self.check_size()
        if self._map is None:
            self._map = np.memmap(self._file, np.uint8, mode="r")
        return self._map[self._start + begin : self._start + end].view(dtype).reshape(shape)

    def placeholder(self, key: str) -> np.ndarray:
        """An array with the tensor's dtype and shape (so its size and nbytes)
        whose data is not read: every element is zero (a read-only broadcast
        of one value, no memory). For checks that only look at sizes."""
        dtype, shape, _, _ = self._entries[key]
        return np.broadcast_to(np.zeros((), dtype), shape)

    def read(self, key: str) -> np.ndarray:
        """The tensor as a fresh, aligned, writable array (read with pread: the
        file's pages are not kept mapped)."""
        dtype, shape, begin, end = self._entries[key]
        out = np.empty(shape, dtype)
        buf = memoryview(out.reshape(-1).view(np.uint8)) if out.size else memoryview(b"")  # type: ignore[arg-type]
        pos, fd = 0, self._file.fileno()
        while pos < end - begin:
            n = os.preadv(fd, [buf[pos:]], self._start + begin + pos)
            if n <= 0:
                raise CheckpointError(f"{self.path}: tensor {quote(key)} ends early (the file shrank while reading)")
            pos += n
        return out

    def chunks(self, key: str, size: int = 16 << 20):
        """The tensor's raw bytes in pieces of at most ``size`` bytes."""
        _, _, begin, end = self._entries[key]
        fd = self._file.fileno()
        pos = begin
        while pos < end:
            data = os.pread(fd, min(size, end - pos), self._start + pos)
            if not data:
                raise CheckpointError(f"{self.path}: tensor {quote(key)} ends early (the file shrank while reading)")
            pos += len(data)
            yield data

    def copy_to(self, writer: Writer, key: str) -> None:
        """Append this tensor to ``writer`` unchanged, a piece at a time."""
        dtype, shape, _, _ = self._entries[key]
        writer.add_raw(key, DTYPE_NAMES[dtype.name], shape, self.chunks(key))

    def close(self) -> None:
        self._map = None
        self._file.close()

    def __enter__(self) -> Reader:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _nbytes(shape: list[int], itemsize: int, limit: int) -> int:
    """prod(shape) * itemsize, or a number above ``limit`` once the product
    passes it (a header may list a million huge dimensions)."""
    if 0 in shape:
        return 0
    total = itemsize
    for s in shape:
        total *= s
        if total > limit:
            return limit + 1
    return total


def quote(key: str) -> str:
    """A tensor name for a message: 'name', or its cut repr when long or unprintable."""
    return f"'{key}'" if len(key) <= 200 and key.isprintable() else short_repr(key)


def _file_kind(head: bytes) -> str:
    """What the first bytes of a file that is not safetensors look like."""
    if head.startswith(b"PK\x03\x04"):
        return "a zip archive, e.g. a PyTorch .bin/.pt checkpoint from torch.save: convert it to safetensors first"
    if head[:1] == b"\x80" and head[1:2] in (b"\x02", b"\x03", b"\x04", b"\x05"):
        return "a Python pickle: convert it to safetensors first"
    if head.startswith(b"\x89HDF"):
        return "an HDF5 file"
    if all(32 <= c < 127 or c in (9, 10, 13) for c in head):
        return f"it starts with the text {head.decode('ascii')!r}"
    return f"its first bytes are {head.hex(' ')}"


class Writer:
    """Writes a safetensors file tensor by tensor, atomically.

    ``header_bytes`` reserves room for the header before the data (an upper
    bound: see header_bound); ``wide_bytes`` gives, for each element size
    above one byte (8, 4, 2), the total bytes of the tensors of that size that
    will be added (exact). The data section is laid out as safetensors'
    own writer does, widest elements first: every tensor of element size 8,
    then 4, then 2, then the bytes (uint8, int8, bool) in the order they come.
    The data section starts at a multiple of 64 bytes, so every tensor starts
    at a multiple of its element size (a loader that maps the file, as
    transformers does, hands the kernels aligned pointers); tensors are
    written into their region as they come (no second pass), and a wide
    region not filled exactly by finish() is an error. The header is written
    last, padded with spaces, and the temporary file replaces ``path`` on
    commit(). Leaving the ``with`` block by an exception (or calling abort())
    removes the temporary file, so no partial output is ever left; a process
    killed outright leaves it, and the next Writer (or atomic.write_atomic) for the
    same path removes it. The published file gets the mode any new file gets
    (0o666 & ~umask).
    """

    def __init__(self, path, header_bytes: int, wide_bytes: dict[int, int] | None = None):
        self.path = Path(path)
        self._reserved = 8 + header_bytes + (-(8 + header_bytes) % _ALIGN)
        wide = dict(wide_bytes or {})
        if set(wide) - set(_WIDE) or any(not isinstance(v, int) or v < 0 or v % k for k, v in wide.items()):
            raise ValueError(f"wide_bytes must map element sizes {_WIDE} to byte totals they divide, got {wide}")
        # region of each element size: [start, end) in the data section (bytes: from the end of the wide ones)
        self._cursor: dict[int, int] = {}
        self._end: dict[int, int] = {}
        pos = 0
        for k in _WIDE:
            self._cursor[k] = pos
            pos += wide.get(k, 0)
            self._end[k] = pos
        self._cursor[1] = pos
        self._tmp: Path | None = None
        fd, self._tmp = atomic.create_temporary(self.path)
        self._file = os.fdopen(fd, "wb")
        self._header: dict = {}

    def add(self, key: str, value) -> None:
        arr = np.asarray(value)  # (np.ascontiguousarray would turn a 0-d array into 1-d)
        if not arr.flags.c_contiguous:
            arr = arr.copy(order="C")
        self.add_raw(key, dtype_name(arr, key), arr.shape, [arr.reshape(-1).view(np.uint8)] if arr.size else [])

    def add_raw(self, key: str, dtype: str, shape, pieces) -> None:
        """Append a tensor given as its safetensors dtype, shape and byte pieces."""
        if not isinstance(key, str) or not key:
            raise CheckpointError(f"tensor names must be non-empty strings, got {key!r}")
        if key in self._header:
            raise CheckpointError(f"tensor '{key}' written twice")
        itemsize = np_dtype(DTYPES[dtype]).itemsize
        want = math.prod(shape) * itemsize
        begin = self._cursor[itemsize]
        if itemsize > 1 and begin + want > self._end[itemsize]:
            raise CheckpointError(
                f"tensor '{key}' ({dtype}{list(shape)}): its {want} bytes pass the end of the {itemsize}-byte "
                f"elements' region ({self._end[itemsize] - begin} bytes left of those planned in wide_bytes)"
            )
        self._file.seek(self._reserved + begin)
        end = begin
        for piece in pieces:
            self._file.write(piece)
            end += memoryview(piece).nbytes
        if end - begin != want:
            raise CheckpointError(f"tensor '{key}': {end - begin} bytes written, {dtype}{list(shape)} needs {want}")
        self._cursor[itemsize] = end
        self._header[key] = {"dtype": dtype, "shape": [int(s) for s in shape], "data_offsets": [begin, end]}

    def finish(self, metadata: dict[str, str] | None = None) -> None:
        """Write the header and flush; the file stays temporary until publish()."""
        for k in _WIDE:
            if self._cursor[k] != self._end[k]:
                raise CheckpointError(
                    f"{self.path}: {self._end[k] - self._cursor[k]} bytes of {k}-byte tensors were planned "
                    "(wide_bytes) but never written"
                )
        # tensors in data order (safetensors readers want the header's entries to cover the data exactly)
        entries = sorted(self._header.items(), key=lambda kv: kv[1]["data_offsets"][0])
        header = {"__metadata__": {str(k): str(v) for k, v in (metadata or {}).items()}, **dict(entries)}
        blob = json.dumps(header, separators=(",", ":")).encode("utf-8")
        if len(blob) > self._reserved - 8:
            raise CheckpointError(f"header of {len(blob)} bytes exceeds the {self._reserved - 8} bytes reserved")
        blob += b" " * (self._reserved - 8 - len(blob))
        f = self._file
        f.seek(0)
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        f.flush()
        os.fsync(f.fileno())  # the file stays open (and locked) until publish() or abort()

    @property
    def size(self) -> int:
        """Bytes in the file (header + data)."""
        return self._reserved + self._cursor[1]

    def publish(self) -> None:
        """Move the finished file to its destination."""
        if self._tmp is None:
            raise RuntimeError(f"{self.path}: this Writer was already published or aborted")
        atomic.rename_into_place(self._tmp, self.path)
        self._tmp = None
        self._file.close()

    def commit(self, metadata: dict[str, str] | None = None) -> None:
        self.finish(metadata)
        self.publish()

    def abort(self) -> None:
        """Drop the temporary file (no-op once published)."""
        self._file.close()
        if self._tmp is not None:
            atomic.discard(self._tmp)
            self._tmp = None

    def __enter__(self) -> Writer:
        return self

    def __exit__(self, *exc) -> None:
        self.abort()


def wide_bytes(sizes) -> dict[int, int]:
    """Writer's ``wide_bytes`` from (element size, bytes) pairs, one per tensor."""
    out: dict[int, int] = {}
    for itemsize, nbytes in sizes:
        if itemsize > 1:
            out[itemsize] = out.get(itemsize, 0) + nbytes
    return out


def header_bound(entries: dict[str, tuple[str, tuple[int, ...], int]], metadata: dict[str, str]) -> int:
    """An upper bound on the header size of a file holding ``entries``
    (name -> (safetensors dtype, shape, upper bound on bytes))."""
    total = sum(n for _, _, n in entries.values())
    header: dict[str, Any] = {"__metadata__": metadata}
    for key, (dtype, shape, _) in entries.items():
        header[key] = {"dtype": dtype, "shape": list(shape), "data_offsets": [total, total]}
    return len(json.dumps(header, separators=(",", ":")).encode("utf-8")) + 8


# ------------------------------------------------------------ checkpoints


def input_files(src) -> tuple[list[Path], Path | None]:
    """The shard files of a checkpoint and its index file (None if unsharded)."""
    src = Path(src)
    if src.is_dir():
        indexes = sorted(src.glob("*" + INDEX_SUFFIX))
        files = sorted(src.glob("*.safetensors"))
        if len(indexes) == 1:
            src = indexes[0]
        elif len(indexes) > 1:
            raise CheckpointError(f"{src}: several index files ({', '.join(p.name for p in indexes)}); name one")
        elif len(files) == 1:
            return files, None
        else:
            raise CheckpointError(f"{src}: expected one .safetensors file or an index file, found {len(files)} files")
    if not src.exists():
        raise CheckpointError(f"{src}: no such file")
    if not src.name.endswith(INDEX_SUFFIX):
        return [src], None
    try:
        index = strict_json_loads(src.read_bytes())
        if not isinstance(index, dict) or "weight_map" not in index:
            raise ValueError("no 'weight_map' object")
        weight_map = index["weight_map"]
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise ValueError("weight_map must map tensor names to file names")
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{src}: not a safetensors index file ({getattr(e, 'strerror', None) or e})") from e
    shards = []
    for name in weight_map.values():
        if not name or "\x00" in name or Path(name).name != name or name in (".", ".."):
            raise CheckpointError(f"{src}: shard {short_repr(name)} must be a file name in the index's directory")
        path = src.parent / name
        if path not in shards:
            shards.append(path)
    if not shards:
        raise CheckpointError(f"{src}: the index lists no shard files")
    return shards, src
