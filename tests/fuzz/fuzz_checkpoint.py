"""Fuzz target: the checkpoint loader and `q4 inspect`, on mutated checkpoints.

The property, check(data): whatever the bytes, q4.checkpoint.load_file,
load_metadata, inspect_file and the function behind `q4 inspect`
(q4.cli.cmd_inspect, in process) each either succeed or raise CheckpointError
/ QuantStateError (q4's ValueError subclasses for a malformed checkpoint,
with a non-empty message) -- never another exception type, never a crash or
a hang. An input is one file: if its first byte is '{', a sharded
checkpoint's index, put beside the two shards of the seed corpus
(make_corpus.shard_files); otherwise a safetensors file.

The mutator knows the layout, so mutants get past the length prefix: it
edits the header as JSON (a random value replaced by a hostile one: NaN,
Infinity, 2**64, bools, nested lists, wrong types -- also inside the
``q4.layers`` metadata string) or as bytes, rewrites one tensor's bytes (the
quant_state JSON, a code book, weight_format) keeping the header in step, or
mutates the raw file; the length prefix is recomputed.

    scripts/fuzz.sh                                     # the bounded, seeded campaign
    PYTHONPATH=. python tests/fuzz/fuzz_checkpoint.py CORPUS_DIR -runs=1000  # by hand (libFuzzer flags)

tests/fuzz/test_fuzz_regressions.py replays the corpus and every saved crash
input through check() without atheris.
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import io
import json
import os
import random
import shutil
import struct
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
_DIRS: dict[str, Path] = {}


def _dirs() -> dict[str, Path]:
    """A scratch directory for safetensors inputs and one holding the seed shards for index inputs."""
    if not _DIRS:
        sys.path.insert(0, str(HERE))
        import make_corpus

        # scripts/fuzz.sh names a directory it removes afterwards (libFuzzer ends the
        # process without running atexit); otherwise a fresh one removed at exit
        shm = Path("/dev/shm")
        base = os.environ.get("Q4_FUZZ_SCRATCH") or (shm if shm.is_dir() else None)
        root = Path(tempfile.mkdtemp(prefix="q4-fuzz-", dir=base))
        atexit.register(shutil.rmtree, root, True)
        for name in ("file", "index"):
            (root / name).mkdir()
        make_corpus.shard_files(root / "index")
        _DIRS.update(file=root / "file", index=root / "index")
    return _DIRS


def check(data: bytes) -> None:
    """Raise AssertionError (or whatever escaped) unless every entry point answers
    ``data`` with success or CheckpointError / QuantStateError."""
    from q4 import cli
    from q4._src.checkpoint import CheckpointError, inspect_file, load_file, load_metadata
    from q4._src.quant_state import QuantStateError

    dirs = _dirs()
    if data[:1] == b"{":
        path = dirs["index"] / "model.safetensors.index.json"
        calls = [lambda: cli.cmd_inspect(argparse.Namespace(file=str(path)))]
    else:
        path = dirs["file"] / "model.safetensors"
        calls = [
            lambda: load_file(path),
            lambda: load_metadata(path),
            lambda: inspect_file(path),
            lambda: cli.cmd_inspect(argparse.Namespace(file=str(path))),
        ]
    path.write_bytes(data)
    for call in calls:
        try:
            with contextlib.redirect_stdout(io.StringIO()):
                call()
        except (CheckpointError, QuantStateError) as e:
            assert str(e).strip(), f"{type(e).__name__} without a message"


# ----------------------------------------------------------------- mutator

_HOSTILE = [
    float("inf"),
    float("-inf"),
    float("nan"),
    1e308,
    -1,
    0,
    1,
    7,
    255,
    2**31,
    2**32 + 1,
    2**62,
    2**63 - 1,
    2**63,
    2**64,
    10**30,
    True,
    False,
    None,
    "",
    "12",
    "F32",
    "U8",
    "I8",
    "BF16",
    "nf4",
    "fp4",
    "float32",
    "row",
    [],
    {},
    [0],
    [[0, 1]],
    [2**62, 2**62],
    [0, 64],
    [1] * 40,
    1.5,
    -0.0,
    0.5,
]


def _deep(rnd: random.Random):
    v = 0
    for _ in range(rnd.choice([31, 33, 40, 900])):
        v = [v] if rnd.random() < 0.7 else {"a": v}
    return v


def _slots(obj, out: list, depth: int = 0) -> list:
    """(container, key) of every value in a JSON tree."""
    items = obj.items() if isinstance(obj, dict) else enumerate(obj) if isinstance(obj, list) else ()
    for k, v in items:
        out.append((obj, k))
        if depth < 6:
            _slots(v, out, depth + 1)
    return out


def _poke(obj, rnd: random.Random):
    """Replace, drop, or duplicate one value somewhere in a JSON tree (in place); returns the tree."""
    slots = _slots(obj, [])
    if not slots:
        return rnd.choice(_HOSTILE)
    container, key = rnd.choice(slots)
    value = container[key]
    r = rnd.random()
    if isinstance(value, str) and value[:1] in "{[" and r < 0.5:  # JSON inside a string (q4.layers)
        try:
            container[key] = json.dumps(_poke(json.loads(value), rnd))
            return obj
        except ValueError:
            pass
    if r < 0.08 and isinstance(container, dict):
        del container[key]
    elif r < 0.12 and isinstance(container, dict):
        container[key + rnd.choice(["", ".", "..SCB", ".weight", ".SCB", ".weight_format"])] = value
    elif r < 0.2:
        container[key] = _deep(rnd)
    elif r < 0.3 and isinstance(value, int) and not isinstance(value, bool):
        container[key] = value + rnd.choice([-1, 1, -value, value, 2**63])
    else:
        container[key] = rnd.choice(_HOSTILE)
    return obj


def _split(data: bytes):
    if len(data) < 8:
        return None
    (n,) = struct.unpack("<Q", data[:8])
    if n > len(data) - 8:
        return None
    return data[8 : 8 + n], data[8 + n :]


_ITEMSIZE = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1}


def _rewrite_tensor(header_bytes: bytes, body: bytes, rnd: random.Random, mutate) -> tuple[bytes, bytes]:
    """Change one tensor (keeping the header in step with the bytes): its
    embedded JSON poked, its bytes mutated (a 1-D or scalar uint8 tensor may
    change length), replaced by a few odd values, or a new consistent shape
    (first dimension 0, 1, n +- 1, 2n: e.g. an empty int8 layer)."""
    header = json.loads(header_bytes)
    entries = sorted(
        (k for k, v in header.items() if k != "__metadata__" and isinstance(v, dict)),
        key=lambda k: header[k]["data_offsets"][0],
    )
    if not entries:
        raise ValueError("no tensors")
    small = [k for k in entries if header[k]["data_offsets"][1] - header[k]["data_offsets"][0] <= 1024]
    key = rnd.choice(small if small and rnd.random() < 0.7 else entries)
    info = header[key]
    begin, end = info["data_offsets"]
    old, shape, itemsize = body[begin:end], list(info["shape"]), _ITEMSIZE[info["dtype"]]
    resizable = info["dtype"] == "U8" and len(shape) <= 1
    r = rnd.random()
    if resizable and old[:1] == b"{" and r < 0.5:
        new = json.dumps(_poke(json.loads(old), rnd)).encode()
        shape = [len(new)]
    elif r < 0.65 and shape:
        rows = shape[0]
        shape[0] = rnd.choice([0, 1, max(rows - 1, 0), rows + 1, 2 * rows])
        n = itemsize
        for d in shape:
            n *= d if isinstance(d, int) else 1
        if not 0 <= n <= 1 << 16:
            raise ValueError("too large to rewrite")
        new = (old * (n // max(len(old), 1) + 1))[:n] if old else bytes(n)
    elif r < 0.75:
        new = rnd.choice([b"", b"\x00", b"\x01", b"\xff", b"\x00\x01", old + old, old[: len(old) // 2]])
        if resizable:
            shape = [len(new)]
        else:
            new = (new + old)[: len(old)]
    else:
        new = mutate(old, len(old) + 64 if resizable else max(len(old), 1))
        if resizable:
            shape = [len(new)]
        else:
            new = (new + old)[: len(old)]
    delta = len(new) - len(old)
    body = body[:begin] + new + body[end:]
    for k in entries:
        b, e = header[k]["data_offsets"]
        if k == key:
            header[k]["data_offsets"] = [b, e + delta]
            header[k]["shape"] = shape
        elif b >= end:
            header[k]["data_offsets"] = [b + delta, e + delta]
    return json.dumps(header).encode(), body


def mutate(data: bytes, max_size: int, seed: int) -> bytes:
    """atheris custom mutator (see the module docstring)."""
    import atheris

    rnd = random.Random(seed)
    parts = _split(data) if data[:1] != b"{" else None
    r = rnd.random()
    if data[:1] == b"{" and r < 0.5:
        try:
            return json.dumps(_poke(json.loads(data), rnd)).encode()[:max_size]
        except (ValueError, RecursionError):
            pass
    if parts is None or r < 0.2:
        return atheris.Mutate(data, max_size)
    header_bytes, body = parts
    try:
        if r < 0.55:
            header_bytes = json.dumps(_poke(json.loads(header_bytes), rnd)).encode()
        elif r < 0.7:
            header_bytes = atheris.Mutate(header_bytes, len(header_bytes) + 128)
        elif r < 0.9:
            header_bytes, body = _rewrite_tensor(header_bytes, body, rnd, atheris.Mutate)
        else:
            body = atheris.Mutate(body, len(body) + 64)
    except (ValueError, KeyError, TypeError, IndexError, AttributeError, RecursionError, OverflowError):
        header_bytes = atheris.Mutate(header_bytes, len(header_bytes) + 128)
    return (struct.pack("<Q", len(header_bytes)) + header_bytes + body)[:max_size]


def main() -> None:
    import atheris

    with atheris.instrument_imports(include=["q4"]):
        import q4.cli  # noqa: F401
        from q4._src import checkpoint, convert, formats, quant_state  # noqa: F401
    _dirs()
    argv = list(sys.argv)
    if not any(a.startswith("-max_len=") for a in argv):
        argv.append(f"-max_len={1 << 16}")
    atheris.Setup(argv, check, custom_mutator=mutate)
    atheris.Fuzz()


if __name__ == "__main__":
    main()
