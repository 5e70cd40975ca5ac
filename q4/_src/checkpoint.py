"""Quantized checkpoints as safetensors files, framework-neutral (numpy): the
file functions of q4.checkpoint, the container (container.py, published
through atomic.py) checked against the schema (schema.py).

The keys are the bitsandbytes ones (``<layer>.weight``,
``<layer>.weight.absmax``, ..., ``<layer>.weight.quant_state.bitsandbytes__nf4``;
8-bit: ``<layer>.weight``, ``<layer>.SCB``, ``<layer>.weight_format``). The
header's ``__metadata__`` also holds ``q4.layers``: per quantized layer its
kind, quant type, block size, nesting and compute dtype, derived from the
tensors at save time.

Loading checks the container (sizes, offsets, dtypes, overlaps) and then
every quantized layer and raises CheckpointError naming the first bad tensor.
Saving writes a temporary file in the destination directory and renames it
over the target, so an interrupted save never replaces a good checkpoint with
a partial one.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

# (the `x as x` names: re-exported for q4.checkpoint and the front ends)
from q4._src.atomic import CheckpointError
from q4._src.atomic import remove_stale_temporaries as remove_stale_temporaries
from q4._src.container import Reader, dtype_name, header_bound, input_files, quote, wide_bytes
from q4._src.container import Writer as Writer
from q4._src.formats import short_repr
from q4._src.schema import bitsandbytes_quantization_config as bitsandbytes_quantization_config
from q4._src.schema import layer_keys, layers_metadata, validate
from q4._src.schema import parse_weight_format as parse_weight_format
from q4._src.schema import quantized_groups as quantized_groups


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
        dtype_name(arrays[key], key)
    meta = {str(k): str(v) for k, v in (metadata or {}).items()}
    meta["q4.layers"] = json.dumps(validate(arrays), sort_keys=True)
    bound = header_bound({k: (dtype_name(a, k), a.shape, a.nbytes) for k, a in arrays.items()}, meta)
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
                        f"{r.path}: layer {quote(name)}: metadata says {short_repr(stored.get(name))}, "
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
