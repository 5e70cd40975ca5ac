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

import errno
import fcntl
import json
import math
import os
import re
import secrets
import stat
import struct
from pathlib import Path
from typing import Any

import numpy as np

from q4._src import formats
from q4._src.formats import short_repr
from q4._src.quant_state import JSON_KEY_PREFIX, QuantState, QuantStateError, is_json_int, strict_json_loads

_JSON_KEY = ".weight." + JSON_KEY_PREFIX
_HEADER_LIMIT = 100 << 20  # a header larger than 100 MiB is not a checkpoint
_INT64_MAX = (1 << 63) - 1
_MAX_RANK = 32  # numpy 1.x's limit (2.x: 64); no checkpoint tensor comes near it
_ALIGN = 64  # the data section starts at a multiple of this (and so every tensor at one of its element size)
_WIDE = (8, 4, 2)  # element sizes laid out first, widest first (safetensors' own order)
# bitsandbytes' LINEAR_8BIT_WEIGHTS_FORMAT_MAPPING (only "row" is supported)
WEIGHT_FORMATS = {0: "row", 1: "col32", 2: "col_turing", 3: "col_ampere"}

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
        elif key.startswith(_JSON_KEY[1:]):  # a bare layer's state dict
            layers[""] = "Linear4bit"
        elif key.endswith(".SCB") or key == "SCB":
            layers[key[: -len(".SCB")] if key != "SCB" else ""] = "Linear8bitLt"
    return layers


def layer_keys(keys, layer: str) -> list[str]:
    """The keys of one quantized layer's stored weight (``weight``, ``weight.*``,
    ``SCB``, ``weight_format``; not its bias) among ``keys`` (layer '' is a bare
    layer's state dict)."""
    out = []
    for key in keys:
        if layer and not key.startswith(layer + "."):
            continue
        rest = key[len(layer) + 1 :] if layer else key
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
    if np.asarray(weight).dtype.kind not in "uif" and np.asarray(weight).dtype.name != "bfloat16":
        # (a bool view: any copy turns every non-zero byte into 1, so other codes)
        raise CheckpointError(
            f"tensor '{weight_key}' is {np.asarray(weight).dtype}; packed 4-bit bytes are stored as an integer or "
            "float dtype (uint8 by default)"
        )
    formats.check_packed_size(
        weight.nbytes,
        math.prod(state.shape),
        f"tensor '{weight_key}'",
        f"its quant_state shape {state.shape}",
        CheckpointError,
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
    if 0 in weight.shape:
        raise CheckpointError(
            f"tensor '{weight_key}' has shape {weight.shape}; a quantized layer needs at least one row and one column"
        )
    if scb.dtype != np.float32 or scb.shape != (weight.shape[0],):
        raise CheckpointError(
            f"tensor '{scb_key}' must be float32[{weight.shape[0]}], got {scb.dtype}{list(scb.shape)}"
        )
    fmt_key = _join(prefix, "weight_format")
    if fmt_key in tensors and (fmt := parse_weight_format(tensors[fmt_key], fmt_key)) != "row":
        raise CheckpointError(f"tensor '{fmt_key}' must be 0 (row-major int8), got {fmt!r}")
    return {"kind": "Linear8bitLt", "shape": list(weight.shape)}


def parse_weight_format(value, key: str) -> str:
    """The bitsandbytes int8 weight format named by a ``weight_format`` entry:
    'row', 'col32', 'col_turing' or 'col_ampere' (q4 loads only 'row').

    The one parser of this entry, for the checkpoint validator and both front
    ends. ``value`` is a single integer code (a numpy array or anything
    np.asarray takes, e.g. a CPU torch tensor or a Python int: integer dtype,
    not bool, exactly one element, 0-3) or a format name as a string.
    Anything else raises CheckpointError naming ``key``."""
    if isinstance(value, str):
        if value not in WEIGHT_FORMATS.values():
            raise CheckpointError(f"'{key}' names no int8 weight format: {short_repr(value)}")
        return value
    try:
        arr = np.asarray(value)
    except (TypeError, ValueError, RuntimeError) as e:
        raise CheckpointError(f"'{key}' must be one integer format code, got {type(value).__name__}: {e}") from e
    if arr.dtype.kind not in "iu" or arr.size != 1 or arr.ndim > 1:
        raise CheckpointError(
            f"'{key}' must be one integer format code (0 = row-major), got {arr.dtype}{list(arr.shape)}"
        )
    code = int(arr.reshape(-1)[0])
    if code not in WEIGHT_FORMATS:
        raise CheckpointError(f"'{key}' holds the unknown int8 weight format code {code}")
    return WEIGHT_FORMATS[code]


def layers_metadata(metadata: dict[str, str], where="checkpoint") -> dict[str, dict] | None:
    """The header's ``q4.layers`` entry parsed (layer name -> its description,
    see validate), or None when absent; malformed JSON raises CheckpointError."""
    text = metadata.get("q4.layers")
    if text is None:
        return None
    try:
        layers = strict_json_loads(text)
    except ValueError as e:
        raise CheckpointError(f"{where}: metadata 'q4.layers' is not valid JSON: {e}") from e
    if not isinstance(layers, dict) or not all(isinstance(v, dict) for v in layers.values()):
        raise CheckpointError(
            f"{where}: metadata 'q4.layers' must be a JSON object of layer descriptions, got {short_repr(layers)}"
        )
    return layers


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
            name = _quote(key)
            if not isinstance(info, dict):
                raise CheckpointError(f"{path}: tensor {name} has a malformed header entry {short_repr(info)}")
            dtype_name, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
            if not isinstance(dtype_name, str) or dtype_name not in _DTYPES:
                raise CheckpointError(f"{path}: tensor {name} has unsupported dtype {short_repr(dtype_name)}")
            if not isinstance(shape, list) or not all(is_json_int(s) and 0 <= s <= _INT64_MAX for s in shape):
                raise CheckpointError(
                    f"{path}: tensor {name}: shape must be a list of non-negative JSON integers, got {short_repr(shape)}"
                )
            dtype = _np_dtype(_DTYPES[dtype_name])
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
                raise CheckpointError(f"{path}: tensors {_quote(k0)} and {_quote(k1)} overlap (corrupted header)")
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
                raise CheckpointError(f"{self.path}: tensor {_quote(key)} ends early (the file shrank while reading)")
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
                raise CheckpointError(f"{self.path}: tensor {_quote(key)} ends early (the file shrank while reading)")
            pos += len(data)
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


def _quote(key: str) -> str:
    """A tensor name for a message: 'name', or its cut repr when long or unprintable."""
    return f"'{key}'" if len(key) <= 200 and key.isprintable() else short_repr(key)


# ------------------------------------------------------ publishing files
#
# Temporary files are named ".<target name>.q4tmp-<pid>-<8 hex digits>" in
# the target's directory, created with mode 0o666 (so the umask applies, as
# for any new file, and the published file keeps that mode) and held under an
# exclusive flock until published or removed. A process killed with SIGKILL
# leaves its temporary behind; the next write to the same target removes
# every such file whose pid is not alive and whose lock is free.

_TMP_TAG = ".q4tmp-"
_TMP_RE = re.compile(r"\.(?P<name>.+)\.q4tmp-(?P<pid>[0-9]+)-[0-9a-f]{8}")


def _pid_alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError):
        return True  # someone else's process (or not a pid): leave its file alone
    return True


def remove_stale_temporaries(path) -> list[Path]:
    """Remove the temporaries left beside ``path`` by q4 processes that died
    before publishing it (see above); returns what was removed."""
    path = Path(path)
    directory = path.parent if str(path.parent) else Path(".")
    prefix = f".{path.name}{_TMP_TAG}"
    removed: list[Path] = []
    try:
        names = [n for n in os.listdir(directory) if n.startswith(prefix)]
    except OSError:
        return removed
    for name in names:
        m = _TMP_RE.fullmatch(name)
        if m is None or m["name"] != path.name or _pid_alive(int(m["pid"])):
            continue
        tmp = directory / name
        try:
            fd = os.open(tmp, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
        except OSError:
            continue
        try:
            if not os.path.isfile(tmp) or not _try_lock(fd):
                continue
            os.unlink(tmp)
            removed.append(tmp)
        except OSError:
            pass
        finally:
            os.close(fd)
    return removed


def _try_lock(fd: int) -> bool:
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            return False
        raise
    return True


def _create_temporary(path: Path) -> tuple[int, Path]:
    """A new locked temporary file beside ``path`` (after removing stale ones)."""
    directory = path.parent if str(path.parent) else Path(".")
    remove_stale_temporaries(path)
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC
    for _ in range(100):
        tmp = directory / f".{path.name}{_TMP_TAG}{os.getpid()}-{secrets.token_hex(4)}"
        try:
            fd = os.open(tmp, flags, 0o666)
        except FileExistsError:
            continue
        except OSError as e:
            raise CheckpointError(f"cannot write {path}: {e.strerror or e}") from e
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            pass  # a file system without locks: the pid in the name still protects it on this host
        return fd, tmp
    raise CheckpointError(f"cannot write {path}: no free temporary name")


def _publish(tmp: Path, path: Path) -> None:
    """Rename ``tmp`` over ``path`` and make the rename durable."""
    os.replace(tmp, path)
    try:
        dfd = os.open(path.parent if str(path.parent) else ".", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:
        return
    try:
        os.fsync(dfd)
    except OSError:
        pass
    finally:
        os.close(dfd)


def _through_temporary(path, fill, copy_stat_from=None) -> None:
    """Publish ``path`` from a temporary file that ``fill(f)`` writes (the same
    naming, mode and clean-up as Writer); with ``copy_stat_from``, its mode
    bits and times are copied first."""
    path = Path(path)
    fd, created = _create_temporary(path)
    tmp: Path | None = created
    try:
        with os.fdopen(fd, "wb", closefd=False) as f:
            fill(f)
            f.flush()
            os.fsync(f.fileno())
        if copy_stat_from is not None:
            import shutil

            shutil.copystat(copy_stat_from, created)
        _publish(created, path)
        tmp = None
    finally:
        os.close(fd)
        if tmp is not None:
            _unlink(tmp)


def write_atomic(path, data: bytes) -> None:
    """Write ``data`` to ``path`` through a temporary file and a rename."""
    _through_temporary(path, lambda f: f.write(data))


def copy_atomic(src, path) -> None:
    """Copy the regular file ``src`` to ``path`` (contents, mode bits and
    times) through a temporary file. ``src`` is opened without following a
    link in its last component and without blocking; anything but a regular
    file (a FIFO, a device, a link swapped in meanwhile) raises CheckpointError
    before a byte is read."""
    import shutil

    real = os.path.realpath(src)
    try:
        fd = os.open(real, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as e:
        raise CheckpointError(f"cannot copy {src}: {e.strerror or e}") from e
    with os.fdopen(fd, "rb") as s:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise CheckpointError(f"cannot copy {src}: not a regular file")
        _through_temporary(path, lambda f: shutil.copyfileobj(s, f, 1 << 20), copy_stat_from=real)


def _unlink(tmp) -> None:
    try:
        os.unlink(tmp)
    except FileNotFoundError:
        pass


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
    killed outright leaves it, and the next Writer (or write_atomic) for the
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
        fd, self._tmp = _create_temporary(self.path)
        self._file = os.fdopen(fd, "wb")
        self._header: dict = {}

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
        itemsize = _np_dtype(_DTYPES[dtype]).itemsize
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
        _publish(self._tmp, self.path)
        self._tmp = None
        self._file.close()

    def commit(self, metadata: dict[str, str] | None = None) -> None:
        self.finish(metadata)
        self.publish()

    def abort(self) -> None:
        """Drop the temporary file (no-op once published)."""
        self._file.close()
        if self._tmp is not None:
            _unlink(self._tmp)
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
    with Writer(path, bound, wide_bytes((a.dtype.itemsize, a.nbytes) for a in arrays.values())) as w:
        for key in sorted(arrays):
            w.add(key, arrays[key])
        w.commit(meta)


def load_file(path, *, check_layers: bool = True, mapped: bool = False) -> dict[str, np.ndarray]:
    """Read a safetensors file into numpy arrays (copies), validating the
    container and, with check_layers, every quantized layer. ``mapped=True`` returns
    read-only memory-mapped views instead (Reader.view: nothing is read until used, and
    a loader that copies each tensor once holds no second copy of the file; the file
    must not be truncated while the views are in use)."""
    with Reader(path) as r:
        tensors = {key: (r.view(key) if mapped else r.read(key)) for key in r.keys()}
    if check_layers:
        validate(tensors)
    return tensors


def load_checkpoint(path, *, check_layers: bool = True, mapped: bool = False) -> dict[str, np.ndarray]:
    """A checkpoint as numpy arrays, from a .safetensors file, a sharded
    checkpoint's ``*.index.json``, or a directory holding either (what ``q4
    quantize`` writes): every shard read, a name in two shards refused. ``mapped``
    as for load_file."""
    from q4._src.convert import input_files  # (convert imports this module)

    files, _ = input_files(Path(path))
    tensors: dict[str, np.ndarray] = {}
    for f in files:
        for key, value in load_file(f, check_layers=False, mapped=mapped).items():
            if key in tensors:
                raise CheckpointError(f"{f}: tensor {short_repr(key)} is also in another shard")
            tensors[key] = value
    if check_layers:
        validate(tensors)
    return tensors


def load_metadata(path) -> dict[str, str]:
    """The header's ``__metadata__`` (``q4.layers`` is JSON describing the
    quantized layers: checked to parse as an object of objects)."""
    with Reader(path) as r:
        layers_metadata(r.metadata, r.path)
        return r.metadata


_SMALL_TENSOR = 1 << 20  # inspect reads tensors up to this size; validate() needs no larger one's data


def inspect_file(path) -> dict:
    """What ``q4 inspect`` reports about one safetensors file.

    Validates every quantized layer and checks the ``q4.layers`` metadata
    against the tensors (the same layers, described the same way). The file
    is never memory-mapped: tensors of at most 1 MiB (quant_state JSON, code
    books, weight_format) are read with pread; larger ones are checked by
    dtype and shape alone (Reader.placeholder), and the file's size is checked
    again at the end, so a file truncated while it is open raises
    CheckpointError. Returns ``{"layers": {name: {**description, "bytes":
    stored bytes}}, "other_bytes": bytes of the other tensors, "file_bytes":
    the file's size}``.
    """
    with Reader(path) as r:
        entries = {k: r.read(k) if r.nbytes(k) <= _SMALL_TENSOR else r.placeholder(k) for k in r.keys()}
        layers = validate(entries)
        stored = layers_metadata(r.metadata, r.path)
        if stored is not None:
            for name in sorted(set(stored) | set(layers)):
                # compared as JSON text, so that 64.0 or 1 does not pass for 64 or true
                if json.dumps(stored.get(name), sort_keys=True) != json.dumps(layers.get(name), sort_keys=True):
                    raise CheckpointError(
                        f"{r.path}: layer {_quote(name)}: metadata says {short_repr(stored.get(name))}, "
                        f"the tensors say {layers.get(name)}"
                    )
        owned: set[str] = set()
        out = {}
        for name, meta in layers.items():
            keys = layer_keys(entries, name)
            owned.update(keys)
            out[name] = {**meta, "bytes": sum(r.nbytes(k) for k in keys)}
        other = sum(r.nbytes(k) for k in entries if k not in owned)
        r.check_size()
        return {"layers": out, "other_bytes": other, "file_bytes": r.size}


def check_model_config(config, layers: dict[str, dict], where) -> None:
    """Check a model folder's config.json (parsed) against the quantized
    layers its checkpoint holds (``layers``: name -> description, as
    validate() returns): a transformers config must carry a bitsandbytes
    ``quantization_config`` that describes them (8-bit, or 4-bit of the same
    quant type and nesting), or q4's own model type for quantized embeddings.
    A config without one would have transformers load the int8 codes as float
    weights. Raises CheckpointError naming the config and a layer."""
    if not isinstance(config, dict) or "model_type" not in config or not layers:
        return  # not a transformers config, or nothing quantized to describe
    if config.get("model_type") == "q4_quantized_embeddings":
        return  # q4's own folders (quantized embeddings): transformers refuses them by model type
    name, meta = next(iter(sorted(layers.items())))
    qc = config.get("quantization_config")
    if not isinstance(qc, dict):
        raise CheckpointError(
            f"{where}: no quantization_config, but the checkpoint holds {len(layers)} quantized layers (e.g. "
            f"{_quote(name)}, {meta['kind']}): transformers would load them as float weights; restore the config "
            "that q4 quantize wrote (or quantize the float model again)"
        )
    for name, meta in sorted(layers.items()):
        if meta["kind"] == "Linear8bitLt":
            ok, want = qc.get("load_in_8bit") is True, "load_in_8bit: true"
        else:
            nested = qc.get("bnb_4bit_use_double_quant") is True
            ok = (
                qc.get("load_in_4bit") is True
                and qc.get("bnb_4bit_quant_type") == meta["quant_type"]
                and nested == meta["nested"]
            )
            want = (
                f"load_in_4bit: true, bnb_4bit_quant_type: {meta['quant_type']!r}, "
                f"bnb_4bit_use_double_quant: {str(meta['nested']).lower()}"
            )
        if not ok:
            raise CheckpointError(
                f"{where}: quantization_config {short_repr(qc)} does not describe layer {_quote(name)} "
                f"({meta['kind']}): it needs {want}"
            )


def bitsandbytes_quantization_config(
    quant_type: str, *, nested: bool = True, skip_modules: list[str] | None = None, threshold: float = 6.0
) -> dict:
    """The transformers ``quantization_config`` (config.json form, a
    bitsandbytes config) that describes layers quantized in q4's format, which
    is bitsandbytes': 'nf4' / 'fp4' (nested absmax or not) or 'int8'
    (LLM.int8, outlier ``threshold``). ``skip_modules``: the modules kept in
    full precision (None: transformers' default, the output head)."""
    formats.check_layer_type(quant_type)
    if quant_type == "int8":
        qc: dict = {
            "quant_method": "bitsandbytes",
            "load_in_8bit": True,
            "load_in_4bit": False,
            "llm_int8_threshold": float(threshold),
            "llm_int8_has_fp16_weight": False,
        }
    else:
        qc = {
            "quant_method": "bitsandbytes",
            "load_in_4bit": True,
            "load_in_8bit": False,
            "bnb_4bit_quant_type": quant_type,
            "bnb_4bit_use_double_quant": bool(nested),
            "bnb_4bit_compute_dtype": "float32",
            "bnb_4bit_quant_storage": "uint8",
        }
    qc["llm_int8_skip_modules"] = skip_modules
    return qc
