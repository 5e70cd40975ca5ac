"""The checkpoint schema: what a quantized layer stores under which key, and
what those entries must hold -- framework-free (numpy arrays, plain dicts and
callables), the one definition for the ``q4`` command and both front ends.

Keys are bitsandbytes' (4-bit: ``<layer>.weight`` packed bytes,
``<layer>.weight.absmax``, ..., ``<layer>.weight.quant_state.bitsandbytes__nf4``;
8-bit: ``<layer>.weight`` int8, ``<layer>.SCB``, ``<layer>.weight_format``).
validate() checks every quantized layer of a state dict (quant_state JSON
against the packed bytes, absmax length against the block count, SCB against
the int8 rows) and describes it for the header's ``q4.layers`` metadata;
plan_4bit_load / plan_int8_load check one layer's entries for a layer of a
given shape, and int8_entries / quant4_entries write them.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from q4._src import formats
from q4._src.atomic import CheckpointError
from q4._src.container import quote
from q4._src.formats import short_repr
from q4._src.quant_state import JSON_KEY_PREFIX, QuantState, QuantStateError, strict_json_loads

_JSON_KEY = ".weight." + JSON_KEY_PREFIX
# bitsandbytes' LINEAR_8BIT_WEIGHTS_FORMAT_MAPPING (only "row" is supported)
WEIGHT_FORMATS = {0: "row", 1: "col32", 2: "col_turing", 3: "col_ampere"}
FORMAT_ROW = 0  # the code of "row", the one int8 layout q4 writes and loads
FLOAT_DTYPES = ("float32", "float16", "bfloat16")  # what a float weight may be stored as


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
            f"{quote(name)}, {meta['kind']}): transformers would load them as float weights; restore the config "
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
                f"{where}: quantization_config {short_repr(qc)} does not describe layer {quote(name)} "
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


# ------------------------------------------------------------- one layer's entries


def int8_entries(weight, scb, *, prefix: str = "", as_tensor: Callable[[np.ndarray], Any] | None = None) -> dict:
    """An LLM.int8 weight's checkpoint entries, in bitsandbytes' order:
    ``{prefix}weight`` (int8 [out, in]) and ``{prefix}SCB`` (fp32 [out]) as
    given, and ``{prefix}weight_format``: FORMAT_ROW as a 0-d uint8 numpy array,
    or what ``as_tensor`` makes of that array (a front end's tensor type, e.g.
    ``torch.from_numpy``). The one writer of these entries."""
    code = np.array(FORMAT_ROW, np.uint8)
    return {
        prefix + "weight": weight,
        prefix + "SCB": scb,
        prefix + "weight_format": code if as_tensor is None else as_tensor(code),
    }


def quant4_entries(packed, state_entries: Mapping[str, Any], *, prefix: str = "") -> dict:
    """A 4-bit weight's checkpoint entries: ``{prefix}weight`` (the packed
    bytes, as given) and ``{prefix}weight.<name>`` for each of its QuantState's
    entries (``state_entries``: QuantState.to_dict(), or a front end's
    ``as_dict(packed=True)``; values as given)."""
    return {prefix + "weight": packed, **{f"{prefix}weight.{k}": v for k, v in state_entries.items()}}


def plan_4bit_load(
    d: Mapping[str, Any],
    prefix: str,
    shape: tuple[int, int],
    errs: list[str],
    used: set[str],
    *,
    what: str = "layer",
    check_state: Callable[[QuantState], None] | None = None,
) -> tuple[np.ndarray, QuantState | None] | None:
    """A 4-bit weight's checkpoint entries (``{prefix}weight`` and
    ``{prefix}weight.*`` of ``d``) checked for a layer whose weight is ``shape``
    ([out, in]; ``what``: 'layer' or 'table', an embedding's, for the messages):

    - packed entries: (the packed bytes as uint8 [n, 1], their QuantState),
      after checking the quant_state against ``shape``, ``check_state(state)``
      (a front end's own condition: a ValueError it raises is reported after
      the key), the packed dtype (any integer or float storage) and size;
    - a float weight of ``shape`` (no quantization entries): (it, None), to be
      quantized with the layer's own settings;
    - otherwise None, after appending the problem (with its key) to ``errs``.

    Every key read is added to ``used``. Values are anything np.asarray takes
    (numpy, ml_dtypes, jax arrays, CPU torch tensors of a numpy dtype); the
    returned arrays may alias them (copy before keeping)."""
    k_w = prefix + "weight"
    noun = "weight" if what == "layer" else what
    quant_keys = [k for k in d if k.startswith(k_w + ".")]
    used.update(quant_keys)
    if k_w not in d:
        errs.append(f"missing key '{k_w}'" + (" (its quantization entries are present)" if quant_keys else ""))
        return None
    used.add(k_w)
    data = np.asarray(d[k_w])
    if not any(k.startswith(k_w + "." + JSON_KEY_PREFIX) for k in quant_keys):
        if quant_keys:
            errs.append(
                f"'{k_w}' has quantization entries {sorted(quant_keys)} but no '{k_w}.{JSON_KEY_PREFIX}<nf4|fp4>'"
            )
            return None
        if data.dtype.name not in FLOAT_DTYPES or data.shape != shape:
            errs.append(
                f"'{k_w}' must be packed 4-bit entries or a float {noun} of shape {shape}, got {data.dtype} {data.shape}"
            )
            return None
        return data, None
    try:
        st = QuantState.from_dict({k[len(k_w) + 1 :]: d[k] for k in quant_keys})
    except (QuantStateError, ValueError, TypeError) as e:
        errs.append(f"'{k_w}': {e}")
        return None
    if tuple(st.shape) != shape:
        errs.append(f"'{k_w}' quant_state shape {tuple(st.shape)} does not match this {what}'s {shape}")
        return None
    if check_state is not None:
        try:
            check_state(st)
        except ValueError as e:
            errs.append(f"'{k_w}' {e}")
            return None
    if data.dtype.kind not in "uif" and data.dtype.name != "bfloat16":
        errs.append(f"'{k_w}' must hold the packed bytes (uint8), got {data.dtype}")
        return None
    packed = np.ascontiguousarray(data).view(np.uint8).reshape(-1, 1)
    want = formats.packed_bytes(st.numel)
    if packed.shape[0] != want:
        errs.append(f"'{k_w}' holds {packed.shape[0]} bytes, its quant_state shape {tuple(st.shape)} needs {want}")
        return None
    return packed, st


def plan_int8_load(
    d: Mapping[str, Any], prefix: str, shape: tuple[int, int], what: str, errs: list[str], used: set[str]
) -> tuple[np.ndarray, np.ndarray | None] | None:
    """An LLM.int8 weight's checkpoint entries (``{prefix}weight``, ``SCB``,
    ``weight_format`` of ``d``) checked against its ``shape`` ([out, in];
    ``what`` names the owner in messages, e.g. 'the layer'): (int8 CB, its SCB)
    or (a float weight to quantize, None); None after appending to ``errs``
    every problem, with its key. Keys read are added to ``used``; values as
    for plan_4bit_load."""
    k_w, k_scb, k_fmt = prefix + "weight", prefix + "SCB", prefix + "weight_format"
    used.update(k for k in (k_w, k_scb, k_fmt) if k in d)
    n = len(errs)
    if k_fmt in d:
        try:
            fmt = parse_weight_format(d[k_fmt], k_fmt)
        except CheckpointError as e:
            errs.append(str(e))
        else:
            if fmt != "row":
                errs.append(f"'{k_fmt}': only the row-major format (0) is supported, got {fmt!r}")
    if k_w not in d:
        errs.append(f"missing key '{k_w}'")
        return None
    w = np.asarray(d[k_w])
    if w.shape != shape:
        errs.append(f"size mismatch for '{k_w}': checkpoint has {w.shape}, {what} is {shape}")
        return None
    if w.dtype == np.int8:
        if k_scb not in d:
            errs.append(f"missing key '{k_scb}': an int8 '{k_w}' needs its row scales")
            return None
        scb = np.asarray(d[k_scb])
        if scb.dtype.name not in FLOAT_DTYPES or scb.shape != (shape[0],):
            errs.append(f"'{k_scb}' must be a float array of shape ({shape[0]},), got {scb.dtype} {scb.shape}")
            return None
        return None if len(errs) > n else (w, scb)
    if w.dtype.name in FLOAT_DTYPES:
        if k_scb in d:
            errs.append(f"'{k_scb}' given with a float (unquantized) '{k_w}' ({w.dtype})")
            return None
        return None if len(errs) > n else (w, None)
    errs.append(f"'{k_w}' must be int8 (quantized) or float, got {w.dtype}")
    return None
