"""Checkpoints of flax.nnx models in the q4torch / bitsandbytes format:
state_dict, load_state_dict (validates everything before changing anything)
and load_quantized."""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np
from flax import nnx

from q4 import checkpoint as q4_checkpoint
from q4jax._src.embedding import EMBEDDING_TYPES, Embedding4bit, Embedding8bit, StableEmbedding
from q4jax._src.graph import check_graph_root, graph_edges, path_name, set_child
from q4jax._src.layers import Linear4bit, Linear8bit, dense_entries, plan_dense_load
from q4jax._src.model import LayerSettings, classify, quantized_layer
from q4jax._src.projection import _Projection
from q4jax._src.quant import QuantState

logger = logging.getLogger("q4jax")

# ------------------------------------------------------------------ checkpoints


_LINEAR_TYPES = (Linear4bit, Linear8bit, nnx.Linear)
# every layer with checkpoint entries (the embeddings' are those of q4torch's layers; a
# quantized Einsum / LinearGeneral's are its 2-D matrix's, under its own path)
_LAYER_TYPES = (*_LINEAR_TYPES, *EMBEDDING_TYPES, _Projection)


def _is_dense(layer) -> bool:
    """A float nnx.Linear (a quantized subclass of one is a q4jax layer: keep_subclass)."""
    return isinstance(layer, nnx.Linear) and not isinstance(layer, (Linear4bit, Linear8bit))


def _layers(module) -> list[tuple[str, Any]]:
    """(prefix, layer) of every layer with entries; never a layer inside another's
    (a projection's 2-D base), and a stacked layer is an error naming it."""
    out: list[tuple[str, Any]] = []
    owners: list[tuple] = []
    for p, _, _, child in graph_edges(module):
        if not isinstance(child, _LAYER_TYPES) or any(p[: len(o)] == o for o in owners):
            continue
        if isinstance(child, _Projection):
            owners.append(p)
        stack = getattr(child, "stack_shape", ())
        if stack:
            raise ValueError(
                f"{path_name(p)}: a stacked layer ({list(stack)}, nnx.vmap) has no per-layer checkpoint entries; "
                "save nnx.state(model) (e.g. with orbax) instead"
            )
        out.append((path_name(p) + ".", child))
    return out


def state_dict(module: nnx.Module) -> dict[str, np.ndarray]:
    """Checkpoint entries of every Linear4bit, Linear8bit, nnx.Linear and q4jax
    embedding layer (Embedding4bit, Embedding8bit, StableEmbedding) below
    ``module`` (itself included), in q4torch's / bitsandbytes' key format: keys
    ``<path>.<entry>`` with torch-style dotted paths; an nnx.Linear saves
    ``weight`` = kernel.T. Every array is a fresh numpy copy."""
    check_graph_root(module, "state_dict")
    layers = _layers(module)
    if isinstance(module, _LAYER_TYPES):
        layers.insert(0, ("", module))
    out: dict[str, np.ndarray] = {}
    for prefix, layer in layers:
        entries = dense_entries(layer) if _is_dense(layer) else layer._state_entries()
        for key, value in entries.items():
            out[prefix + key] = value
    return out


def load_state_dict(module: nnx.Module, d: dict[str, Any], *, strict: bool = True) -> nnx.Module:
    """Load a q4torch / bitsandbytes checkpoint (numpy arrays, or anything
    np.asarray accepts) into ``module`` in place.

    Every entry is validated (through the q4.QuantState schema for 4-bit
    layers) before anything changes; on error a ValueError names each bad key
    and the module is untouched. Arrays are copied (the caller's dict is never
    aliased or mutated). A 4-bit layer takes the checkpoint's quant_type,
    blocksize and nesting; a float weight is quantized with the layer's
    settings. With ``strict``, keys no layer consumes are an error.
    """
    check_graph_root(module, "load_state_dict")
    if not isinstance(d, dict):
        raise TypeError(f"load_state_dict expects a dict of arrays, got {type(d).__name__}")
    layers = _layers(module)
    if isinstance(module, _LAYER_TYPES):
        layers.insert(0, ("", module))
    errs: list[str] = []
    used: set[str] = set()
    plans = []
    for prefix, layer in layers:
        if _is_dense(layer):
            plan = plan_dense_load(layer, d, prefix, errs, used)
        else:
            plan = layer._plan_load(d, prefix, errs, used)
        plans.append(plan)
    if strict:
        unexpected = sorted(k for k in d if k not in used)
        if unexpected:
            errs.append(f"unexpected keys {unexpected}")
    if errs:
        raise ValueError("load_state_dict: " + "; ".join(errs))
    # each plan dropped once it ran: the arrays it holds (and the layer's old ones) go as
    # the layer takes its new ones
    for i, plan in enumerate(plans):
        plans[i] = None
        if plan is not None:
            plan()
    return module


def _abstract(layer) -> bool:
    return any(isinstance(v, jax.ShapeDtypeStruct) for v in jax.tree.leaves(nnx.state(layer)))


def _make_abstract(layer) -> None:
    """Every array of ``layer``'s state replaced by its shape and dtype (as nnx.eval_shape
    builds it)."""
    for _, var in nnx.to_flat_state(nnx.state(layer)):
        value = var.get_value()
        if isinstance(value, jax.Array):
            var.set_value(jax.ShapeDtypeStruct(value.shape, value.dtype, sharding=getattr(value, "sharding", None)))
        elif isinstance(value, QuantState):
            var.set_value(jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), value))


def load_quantized(module: nnx.Module, checkpoint, *, strict: bool = True) -> dict[str, np.ndarray]:
    """Load a quantized checkpoint's linear (and quantized embedding) layers
    into an nnx model, in place.

    ``checkpoint`` is a path (a safetensors file, a sharded checkpoint's
    ``*.index.json``, or a model folder as ``q4 quantize DIR OUT`` writes) or
    a dict of arrays with PyTorch / bitsandbytes keys. Every
    nnx.Linear the checkpoint stores quantized is first replaced by a
    Linear4bit / Linear8bit, and every nnx.Embed it stores quantized
    (``q4 quantize --embeddings``) by an Embedding4bit / Embedding8bit, with
    the file's quant type, block size and nesting; then every such layer of
    the model (dense linears included) is loaded from its entries, all
    validated before anything changes (see load_state_dict). A quantized layer
    the model has as neither is a ValueError naming it. Returns the entries
    no layer used (float embeddings, norms: names a model maps itself); from a path, as
    read-only memory-mapped views of the files.
    """
    check_graph_root(module, "load_quantized")
    if isinstance(checkpoint, (str, os.PathLike)):
        # views of the files: each tensor is copied once, into its jax array
        checkpoint = q4_checkpoint.load_checkpoint(checkpoint, mapped=True)
    if not isinstance(checkpoint, Mapping):
        raise TypeError(f"checkpoint must be a path or a dict of arrays, got {type(checkpoint).__name__}")
    groups = q4_checkpoint.quantized_groups(checkpoint)
    plan = {name: group for group, names in groups.items() for name in names}
    edges = {path_name(path): (parent, key, child) for path, parent, key, child in graph_edges(module)}
    kinds = {n: classify(e[2], embeddings=True) for n, e in edges.items()}
    quantized = (Linear4bit, Linear8bit, Embedding4bit, Embedding8bit, _Projection)
    unknown = sorted(
        f"'{n}' ({'absent' if n not in edges else kinds[n][1] or type(edges[n][2]).__name__})"
        for n in plan
        if n not in edges or kinds[n][0] in (None, "lora") and not isinstance(edges[n][2], quantized)
    )
    if unknown:
        raise ValueError(
            "the checkpoint quantizes layers this model does not have as a linear, LinearGeneral, Einsum or "
            f"embedding layer q4jax can replace: {unknown}"
        )
    replaced: dict[int, nnx.Module] = {}
    for name, (quant_type, blocksize, nested) in plan.items():
        parent, key, child = edges[name]
        kind = kinds[name][0]
        if kind is None:
            continue  # already quantized: load_state_dict takes the checkpoint's format
        if id(child) not in replaced:
            new = quantized_layer(child, kind, LayerSettings(quant_type, blocksize, nested), name)
            if _abstract(child):
                # a model built under nnx.eval_shape: the layer was quantized from zeros, a
                # placeholder the load replaces; held as shapes until then, so a load never
                # holds the placeholders and the checkpoint's bytes at once
                _make_abstract(new)
            replaced[id(child)] = new
        set_child(parent, key, replaced[id(child)])
    mine: set[str] = set()  # each layer's weight entries and bias (a StableEmbedding's norm)
    for prefix, layer in _layers(module):
        mine.update(q4_checkpoint.layer_keys(checkpoint, prefix[:-1]))
        extra = ("norm.weight", "norm.bias") if isinstance(layer, StableEmbedding) else ("bias",)
        mine.update(prefix + k for k in extra if prefix + k in checkpoint)
    # (each entry copied from a mapped file hands its pages back as it is copied: _host_copy)
    load_state_dict(module, {k: checkpoint[k] for k in mine}, strict=strict)
    return {k: v for k, v in checkpoint.items() if k not in mine}
