"""Quantize a float safetensors checkpoint into the shared format, streaming.

Every 2-D floating-point ``*.weight`` whose layer name matches no skip pattern
becomes a bitsandbytes-format quantized layer (4-bit: ``weight`` packed bytes,
``weight.absmax`` ..., ``weight.quant_state.bitsandbytes__<type>``; 8-bit:
``weight`` int8, ``SCB``, ``weight_format``); every other tensor is copied
unchanged. Inputs are a ``.safetensors`` file, a sharded checkpoint's
``*.index.json``, or a directory holding either.

The work is planned before anything is written: every input header is parsed
and checked, every quantized tensor's dtype is checked, so a bad input fails
before any output exists. Tensors are then read (pread), quantized and
written one at a time, so memory holds about one tensor: a checkpoint larger
than memory works. Outputs are written to temporary files
(``.<name>.q4tmp-<pid>-<random>`` beside each output) and renamed into place
only when all of them are complete; an error, an interrupt (SIGINT, or
SIGTERM / SIGHUP under the ``q4`` command) leaves no partial output behind,
and temporaries left by a killed run (SIGKILL, a crash) are removed by the
next run that writes the same output. Published files get the mode a new file
gets (0o666 & ~umask).

What a reader sees while a sharded output is published: the old index (if
any) is removed first, then a model folder's rewritten config.json (its
``quantization_config`` describes the new shards) is renamed into place, then
each shard (each shard file is always either the complete old one or the
complete new one), then the model's other files, and the new index is written
last, atomically. So an index is never present beside a partial or mixed set
of shards: a reader that goes through the index (transformers, ``q4``) sees
either no checkpoint or the complete new one; and quantized shards are never
beside a config that lacks their ``quantization_config`` (transformers would
read int8 codes as float weights). SIGINT, SIGTERM and SIGHUP arriving during
publication are held until it ends (then delivered: the command exits with
their status, the output complete); only a run killed outright (SIGKILL, a
power loss) during publication leaves shards without an index, which ``q4``
refuses as an incomplete checkpoint; rerun it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fnmatch
import json
import math
import os
import signal
import stat
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

import numpy as np

from q4._src import formats
from q4._src.atomic import CheckpointError, copy_atomic, write_atomic
from q4._src.container import (
    DTYPE_NAMES,
    DTYPES,
    INDEX_SUFFIX,
    Reader,
    Writer,
    header_bound,
    input_files,
    np_dtype,
    wide_bytes,
)
from q4._src.quant_state import JSON_KEY_PREFIX, QuantState
from q4._src.schema import bitsandbytes_quantization_config, int8_entries, quant4_entries, validate
from q4._src.weights import dequantize_weight_4bit, dequantize_weight_int8, quantize_weight_4bit, quantize_weight_int8

TYPES = formats.LAYER_TYPES
# Layers that are 2-D ``.weight`` tensors but not linear layers (embeddings), or
# that are conventionally kept in full precision (the output head).
EMBEDDING_PATTERNS = ("*embed*", "*wte", "*wpe")
DEFAULT_SKIP = (*EMBEDDING_PATTERNS, "lm_head", "*.lm_head")
_FLOATS = ("float32", "float16", "bfloat16")
# float weights in other formats are not copied next to the quantized ones
_WEIGHT_SUFFIXES = {".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack", ".gguf", ".onnx", ".npz"}


@dataclasses.dataclass(frozen=True)
class Options:
    quant_type: str = "nf4"  # 'nf4' | 'fp4' | 'int8'
    blocksize: int = 64  # 4-bit only
    nested: bool = True  # 4-bit only: quantize the absmax too (bitsandbytes' compress_statistics)
    skip: tuple[str, ...] = ()  # fnmatch patterns on layer names (the key without '.weight')
    default_skip: bool = True  # also skip DEFAULT_SKIP
    embeddings: bool = False  # quantize the embeddings too (drop EMBEDDING_PATTERNS from the default skips)
    method: str = "absmax"  # 4-bit: 'absmax' (bitsandbytes'), 'mse' or 'gptq' (q4/_src/quantizers.py)
    # gptq: each layer's Hessian by name (the key without '.weight'); layers without one use 'mse'
    hessians: dict[str, Any] | None = dataclasses.field(default=None, compare=False, repr=False)
    gptq_damp: float = 0.01  # gptq: damping, a fraction of each Hessian's mean diagonal
    # a model folder's links out of it / special files: left out with a warning (default: refused)
    skip_unsafe_files: bool = False

    def check(self) -> Options:
        formats.check_layer_type(self.quant_type, "--type")
        if self.quant_type != "int8":
            formats.check_blocksize(self.blocksize)
        if self.method not in ("absmax", "mse", "gptq"):
            raise ValueError(f"--method must be absmax, mse or gptq, got {self.method!r}")
        if not self.gptq_damp > 0:
            raise ValueError(f"--damp must be > 0, got {self.gptq_damp}")
        if not math.isfinite(self.gptq_damp):
            raise ValueError(f"--damp must be finite, got {self.gptq_damp}")
        if (self.method == "gptq") != (self.hessians is not None):
            raise ValueError(
                "--method gptq needs --calibration FILE (one text per line) and a model folder that transformers "
                "can load (or, in Python: q4torch.replace_linear / q4jax.quantize_model(method='gptq', calibration=...))"
            )
        if self.method != "absmax" and self.quant_type == "int8":
            raise ValueError(f"--method {self.method} applies to the 4-bit types (nf4, fp4), not to int8")
        return self

    def skipped(self, layer: str) -> str | None:
        """The pattern that excludes this layer, or None."""
        defaults: tuple[str, ...] = DEFAULT_SKIP if self.default_skip else ()
        if self.embeddings:
            defaults = tuple(p for p in defaults if p not in EMBEDDING_PATTERNS)
        for pattern in (*self.skip, *defaults):
            if fnmatch.fnmatchcase(layer, pattern):
                return pattern
        return None


@dataclasses.dataclass
class LayerResult:
    name: str
    shape: tuple[int, ...]
    dtype: str
    bytes_before: int
    bytes_after: int
    rel_error: float  # ||W - dequantize(quantize(W))||_F / ||W||_F, in float64


@dataclasses.dataclass
class Result:
    layers: list[LayerResult]
    kept: list[str]  # tensors copied unchanged
    skipped: dict[str, str]  # layer -> the skip pattern that kept it
    bytes_in: int
    bytes_out: int
    outputs: list[Path]
    copied: list[Path] = dataclasses.field(default_factory=list)  # other files of a model directory
    warnings: list[str] = dataclasses.field(default_factory=list)  # files of the model directory left out


# -------------------------------------------------------------------- plan


@dataclasses.dataclass
class _Shard:
    reader: Reader
    out: Path
    quantize: list[str]  # weight keys to quantize
    bound: int = 0
    wide: dict[int, int] = dataclasses.field(default_factory=dict)  # Writer's wide_bytes (exact)


def _plan_entries(reader: Reader, key: str, opts: Options) -> dict[str, tuple[str, tuple[int, ...], int]]:
    """Upper bounds on the output tensors one quantized weight produces."""
    shape = reader.shape(key)
    prefix = key[: -len("weight")]
    n = int(np.prod(shape))
    if opts.quant_type == "int8":
        return {
            prefix + "weight": ("I8", shape, n),
            prefix + "SCB": ("F32", (shape[0],), 4 * shape[0]),
            prefix + "weight_format": ("U8", (), 1),
        }
    nb = formats.num_blocks(n, opts.blocksize)
    # the quant_state JSON at its longest (the nested offset's repr is at most 24 characters)
    state = QuantState(opts.quant_type, opts.blocksize, shape, "bfloat16", np.zeros(nb, np.float32))
    if opts.nested:
        state.nested_absmax, state.nested_offset = np.zeros(1, np.float32), -2.2250738585072014e-308
    entries: dict[str, tuple[str, tuple[int, ...], int]] = {
        f"{prefix}weight": ("U8", (formats.packed_bytes(n), 1), formats.packed_bytes(n))
    }
    n2 = formats.num_blocks(nb, formats.nested_blocksize())
    for name, arr in state.to_dict().items():
        size = {"absmax": nb * (1 if opts.nested else 4), "nested_absmax": 4 * n2}.get(name, arr.nbytes)
        shape_ = {"absmax": (nb,), "nested_absmax": (n2,)}.get(name, arr.shape)
        dtype = "U8" if arr.dtype == np.uint8 or (name == "absmax" and opts.nested) else "F32"
        entries[f"{prefix}weight.{name}"] = (dtype, shape_, size)
    return entries


def _plan(files: list[Path], outs: list[Path], opts: Options) -> tuple[list[_Shard], dict[str, str]]:
    shards: list[_Shard] = []
    skipped: dict[str, str] = {}
    seen: dict[str, Path] = {}
    try:
        for path, out in zip(files, outs, strict=True):
            shard = _Shard(Reader(path), out, [])
            shards.append(shard)
            r = shard.reader
            entries: dict[str, tuple[str, tuple[int, ...], int]] = {}
            layer_meta: dict[str, dict[str, Any]] = {}
            for key in r.keys():
                if "." + JSON_KEY_PREFIX in key or key.endswith("SCB"):
                    raise CheckpointError(f"{path}: tensor '{key}' shows the checkpoint is already quantized")
            for key in r.keys():
                if key in seen:
                    raise CheckpointError(f"tensor '{key}' appears in both {seen[key]} and {path}")
                seen[key] = path
                layer = key[: -len(".weight")]
                if not key.endswith(".weight") or len(r.shape(key)) != 2:
                    entries[key] = (DTYPE_NAMES[r.dtype(key).name], r.shape(key), r.nbytes(key))
                    continue
                pattern = opts.skipped(layer)
                if pattern is not None:
                    skipped[layer] = pattern
                    entries[key] = (DTYPE_NAMES[r.dtype(key).name], r.shape(key), r.nbytes(key))
                    continue
                if r.dtype(key).name not in _FLOATS or 0 in r.shape(key):
                    raise CheckpointError(
                        f"{path}: tensor '{key}' is {r.dtype(key).name}{list(r.shape(key))}; q4 quantizes non-empty "
                        f"float32, float16 or bfloat16 weights (keep it as is with --skip '{layer}')"
                    )
                shard.quantize.append(key)
                entries.update(_plan_entries(r, key, opts))
                # the layer's q4.layers entry as validate() will describe it (the
                # header is sized with it; the written one comes from validate())
                if opts.quant_type == "int8":
                    layer_meta[layer] = {"kind": "Linear8bitLt", "shape": list(r.shape(key))}
                else:
                    layer_meta[layer] = {
                        "blocksize": opts.blocksize,
                        "compute_dtype": r.dtype(key).name,
                        "kind": "Linear4bit",
                        "nested": opts.nested,
                        "quant_type": opts.quant_type,
                        "shape": list(r.shape(key)),
                    }
            meta_bound = {
                "format": "pt",
                "q4.layers": json.dumps(layer_meta, sort_keys=True) + " " * 256,
            }
            shard.bound = header_bound(entries, meta_bound) + 2
            # (the bytes of every tensor wider than a byte are exact in the plan; only uint8 ones are bounds)
            shard.wide = wide_bytes((np_dtype(DTYPES[d]).itemsize, n) for d, _, n in entries.values())
    except BaseException:
        for shard in shards:
            shard.reader.close()
        raise
    return shards, skipped


def _outputs(files: list[Path], index: Path | None, dst: Path) -> tuple[list[Path], Path | None]:
    if dst.name.endswith(".safetensors"):
        if len(files) > 1:
            raise CheckpointError(
                f"{dst}: the input has {len(files)} shards; write them to a directory (or an *.index.json path)"
            )
        return [dst], None
    out_dir = dst.parent if dst.name.endswith(INDEX_SUFFIX) else dst
    outs = [out_dir / f.name for f in files]
    if index is None:
        return outs, None
    return outs, dst if dst.name.endswith(INDEX_SUFFIX) else out_dir / index.name


# --------------------------------------------------------------------- run


def _quantize_one(r: Reader, key: str, opts: Options) -> tuple[dict[str, np.ndarray], LayerResult]:
    try:
        return _quantize_tensor(r, key, opts)
    except ValueError as e:  # (a NaN / Inf with nested statistics, a row past float16, GPTQ's Hessian ...)
        if isinstance(e, CheckpointError) and key in str(e):
            raise
        raise CheckpointError(f"{r.path}: tensor '{key}': {e}") from None


def _quantize_tensor(r: Reader, key: str, opts: Options) -> tuple[dict[str, np.ndarray], LayerResult]:
    w = r.read(key)
    prefix = key[: -len("weight")]  # "<layer>."
    if opts.quant_type == "int8":
        cb, scb = quantize_weight_int8(w)
        out = int8_entries(cb, scb, prefix=prefix)
        approx = dequantize_weight_int8(cb, scb)
    else:
        hessian = None if opts.hessians is None else opts.hessians.get(prefix[:-1])
        # gptq: a layer the calibration did not reach (or off the block) gets the mse scales
        method = "gptq" if hessian is not None else "mse" if opts.method == "gptq" else opts.method
        packed, state = quantize_weight_4bit(
            w, opts.blocksize, opts.quant_type, opts.nested, method, hessian=hessian, damp=opts.gptq_damp
        )
        out = quant4_entries(packed, state.to_dict(), prefix=prefix)
        approx = dequantize_weight_4bit(packed, state)
    err = _rel_error(w, approx)
    res = LayerResult(prefix[:-1], w.shape, w.dtype.name, w.nbytes, sum(a.nbytes for a in out.values()), err)
    return out, res


def _rel_error(w: np.ndarray, approx: np.ndarray, rows: int = 1 << 16) -> float:
    """||w - approx||_F / ||w||_F in float64, a few rows at a time (bounded memory)."""
    w2, a2 = w.reshape(w.shape[0], -1), approx.reshape(w.shape[0], -1)
    step = max(1, rows // max(1, w2.shape[1]))
    num = den = 0.0
    for i in range(0, w2.shape[0], step):
        ref = w2[i : i + step].astype(np.float64)
        num += float(np.sum((ref - a2[i : i + step]) ** 2))
        den += float(np.sum(ref**2))
    return math.sqrt(num / den) if den > 0 else 0.0


_DEFERRED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


@contextlib.contextmanager
def deferred_signals():
    """SIGINT, SIGTERM and SIGHUP held while the block runs, then delivered
    (each once, in arrival order) to the handlers that were there before: a
    publication, once begun, is finished. Only in the main thread (the only
    one that runs Python signal handlers); an ignored signal stays ignored."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    pending: list[int] = []

    def hold(signum, frame):
        if signum not in pending:
            pending.append(signum)

    previous = {}
    try:
        for sig in _DEFERRED:
            handler = signal.getsignal(sig)
            if handler is not signal.SIG_IGN and handler is not None:
                previous[sig] = signal.signal(sig, hold)
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        for sig in pending:
            signal.raise_signal(sig)


def quantize_checkpoint(src, dst, opts: Options, progress: Callable[[int, int, str], None] | None = None) -> Result:
    """Quantize the checkpoint at ``src`` into ``dst`` (a ``.safetensors`` file,
    or a directory / ``*.index.json`` path for sharded output, one output shard
    per input shard). ``progress(done_bytes, total_bytes, tensor)`` is called
    as the work advances."""
    opts = opts.check()
    dst = Path(dst)
    files, index = input_files(src)
    outs, out_index = _outputs(files, index, dst)
    for f in files:
        if not f.exists():
            raise CheckpointError(f"{f}: no such file (listed in {index})")
        if any(f.resolve() == o.resolve() for o in outs):
            raise CheckpointError(f"{f}: the output would overwrite the input")
    to_dir = not dst.name.endswith(".safetensors")
    if not to_dir and not outs[0].parent.is_dir():
        raise CheckpointError(f"{outs[0].parent}: no such directory")
    # with a directory in and a directory out, the model's other files come along
    src_dir = Path(src) if Path(src).is_dir() else index.parent if index is not None else None
    extras, warnings = (
        _extra_files(src_dir, files, index, opts.skip_unsafe_files) if to_dir and src_dir is not None else ([], [])
    )
    shards, skipped = _plan(files, outs, opts)
    # a transformers config.json is rewritten (checked here, before any output)
    try:
        planned_kept = [k for sh in shards for k in sh.reader.keys() if k not in set(sh.quantize)]
        configs = {
            rel: config
            for rel in extras
            if rel == "config.json"
            and (config := model_config(Path(cast(Path, src_dir), rel), opts, planned_kept)) is not None
        }
    except BaseException:
        for shard in shards:
            shard.reader.close()
        raise
    outs[0].parent.mkdir(parents=True, exist_ok=True)
    writers: list[Writer] = []
    layers, kept = [], []
    weight_map: dict[str, str] = {}
    total = sum(s.reader.nbytes(k) for s in shards for k in s.reader.keys())
    done = 0
    try:
        for shard in shards:
            r = shard.reader
            w = Writer(shard.out, shard.bound, shard.wide)
            writers.append(w)
            quantize, layer_meta = set(shard.quantize), {}
            for key in r.keys():
                if progress:
                    progress(done, total, key)
                if key in quantize:
                    tensors, res = _quantize_one(r, key, opts)
                    layers.append(res)
                    layer_meta.update(validate(tensors))
                    for name, arr in tensors.items():
                        w.add(name, arr)
                        weight_map[name] = shard.out.name
                    del tensors
                else:
                    r.copy_to(w, key)
                    kept.append(key)
                    weight_map[key] = shard.out.name
                done += r.nbytes(key)
            w.finish({"format": "pt", "q4.layers": json.dumps(layer_meta, sort_keys=True)})
        if progress:
            progress(total, total, "")
        # Publication order (see the module docstring): old index out, the
        # rewritten config.json in, shards and the model's other files in, the
        # new index last; SIGINT / SIGTERM / SIGHUP wait until it is done.
        with deferred_signals():
            if out_index is not None:
                out_index.unlink(missing_ok=True)
            for rel, blob in configs.items():
                write_atomic(outs[0].parent / rel, blob)
            for w in writers:
                w.publish()
            for rel in extras:  # (only with a source directory)
                src_file = Path(cast(Path, src_dir), rel)
                if rel not in configs and (outs[0].parent / rel).resolve() != src_file.resolve():
                    (outs[0].parent / rel).parent.mkdir(parents=True, exist_ok=True)
                    copy_atomic(src_file, outs[0].parent / rel)
            if out_index is not None:
                _write_index(out_index, weight_map, sum(w.size for w in writers))
    finally:
        for w in writers:
            w.abort()
        for shard in shards:
            shard.reader.close()
    return Result(
        layers,
        kept,
        skipped,
        total,
        sum(o.stat().st_size for o in outs),
        outs + ([out_index] if out_index else []),
        [Path(e) for e in extras],
        warnings,
    )


# model_type of a folder whose embeddings are quantized (see model_config)
Q4_MODEL_TYPE = "q4_quantized_embeddings"


def model_config(path: Path, opts: Options, kept: list[str]) -> bytes | None:
    """A model folder's config.json (a transformers config: a JSON object with
    "model_type") rewritten for the quantized weights, or None for any other
    file. Its `quantization_config` describes them in bitsandbytes' terms (the
    bytes are bitsandbytes' format): transformers with bitsandbytes loads the
    folder as quantized layers, and without it refuses to load it, instead of
    re-initialising every quantized weight at random as it would with the
    original config. Every module kept in full precision is listed in
    `llm_int8_skip_modules` (transformers matches those names as substrings)."""
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return None
    if not isinstance(config, dict) or "model_type" not in config:
        return None
    if "quantization_config" in config or config.get("model_type") == Q4_MODEL_TYPE:
        raise CheckpointError(f"{path}: the model is already quantized (quantization_config in its config.json)")
    skip = sorted({k.rsplit(".", 1)[0] for k in kept if k.endswith(".weight")})
    if opts.embeddings:
        # bitsandbytes has no quantized embeddings: with a bitsandbytes config
        # transformers would load the packed embedding bytes into a float table
        # (it only warns about the size mismatch), and it ignores an unknown
        # quant_method. A model type of q4's own makes it (and
        # sentence-transformers) refuse the folder; q4torch / q4jax
        # load_quantized read the weights.
        config["q4"] = {
            "model_type": config["model_type"],
            "quant_type": opts.quant_type,
            "embeddings": True,
            "load_with": "q4torch.load_quantized / q4jax.load_quantized (no bitsandbytes loader for quantized embeddings)",
        }
        config["model_type"] = Q4_MODEL_TYPE
        return (json.dumps(config, indent=2, sort_keys=True) + "\n").encode()
    qc = bitsandbytes_quantization_config(opts.quant_type, nested=bool(opts.nested), skip_modules=skip)
    config["quantization_config"] = qc
    return (json.dumps(config, indent=2, sort_keys=True) + "\n").encode()


def _extra_files(
    src_dir: Path, files: list[Path], index: Path | None, skip_unsafe: bool
) -> tuple[list[str], list[str]]:
    """The model directory's other files (config, tokenizer, ...) as relative
    paths, and the warnings about files left out.

    Only regular files are copied: a symbolic link whose target lies inside
    the directory is copied as its target's contents; a link that leads out of
    it (a file, or ``/proc/self/environ`` holding the environment's tokens,
    would land in a folder the user may publish) or anything that is not a
    regular file (a FIFO, a device, a socket: never opened) is refused with
    CheckpointError, or with ``skip_unsafe`` left out with a warning."""
    root = Path(os.path.realpath(src_dir))
    skip = {f.resolve() for f in files} | ({index.resolve()} if index is not None else set())
    out: list[str] = []
    warnings: list[str] = []

    def unsafe(rel: str, why: str) -> None:
        if not skip_unsafe:
            raise CheckpointError(
                f"{src_dir}: '{rel}' {why}; q4 copies only the model folder's regular files (pass "
                "--skip-unsafe-files to leave such files out, or replace a link by a copy of its target)"
            )
        warnings.append(f"left out '{rel}': it {why}")

    for dirpath, dirnames, filenames in os.walk(src_dir, followlinks=False):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
        here = Path(dirpath)
        # (os.walk lists a link to a directory among dirnames and does not enter it)
        names = sorted(n for n in filenames if not n.startswith(".")) + [d for d in dirnames if (here / d).is_symlink()]
        for name in names:
            path = here / name
            rel = str(path.relative_to(src_dir))
            if path.suffix in _WEIGHT_SUFFIXES or path.resolve() in skip:
                continue
            st = os.lstat(path)
            if stat.S_ISLNK(st.st_mode):
                target = Path(os.path.realpath(path))
                if target != root and root not in target.parents:
                    unsafe(rel, f"is a symbolic link to {target}, outside the model folder")
                    continue
                try:
                    st = os.stat(target)
                except OSError as e:
                    unsafe(rel, f"is a symbolic link to {target}, which cannot be read ({e.strerror})")
                    continue
                if stat.S_ISDIR(st.st_mode):
                    continue  # a link to a folder inside: its files are copied where they are
            if not stat.S_ISREG(st.st_mode):
                unsafe(rel, f"is not a regular file ({_file_type(st.st_mode)})")
                continue
            out.append(rel)
    return sorted(out), warnings


def _file_type(mode: int) -> str:
    for test, name in ((stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"), (stat.S_ISDIR, "a directory")):  # fmt: skip
        if test(mode):
            return name
    return f"mode {mode:o}"


def _write_index(path: Path, weight_map: dict[str, str], total_size: int) -> None:
    blob = json.dumps({"metadata": {"total_size": total_size}, "weight_map": weight_map}, indent=2) + "\n"
    write_atomic(path, blob.encode("utf-8"))
