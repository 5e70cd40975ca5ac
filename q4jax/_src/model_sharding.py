"""shard_model: placing a whole flax.nnx model's quantized and dense linear
layers on a device mesh by name rules (the array-level layouts are in
sharding.py)."""

from __future__ import annotations

import fnmatch
import logging
from collections.abc import Mapping
from typing import Any

import jax
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from q4jax._src.graph import check_graph_root, graph_edges, path_name
from q4jax._src.layers import Linear4bit, Linear8bit
from q4jax._src.sharding import (
    LinearSharding,
    check_4bit,
    check_8bit,
    check_features,
)

logger = logging.getLogger("q4jax")

# ------------------------------------------------------------------ sharding

_RULE_MODES = ("column", "row")


def _rule_matches(pattern: str, name: str, path: tuple) -> bool:
    return fnmatch.fnmatchcase(name, pattern) or any(str(k) == pattern for k in path)


def _check_layer(layer, spec: LinearSharding) -> None:
    if isinstance(layer, Linear4bit):
        _, state = layer._canonical()
        check_4bit(spec, state.shape, state.blocksize, state.nested)
    elif isinstance(layer, Linear8bit):
        check_8bit(spec, (layer.out_features, layer.in_features))
    else:
        check_features(spec, layer.out_features, layer.in_features)


def _shard_dense(layer: nnx.Linear, spec: LinearSharding) -> None:
    """A dense nnx.Linear (kernel [in, out]) split like a quantized one; XLA
    partitions the dot itself."""
    kernel = P(None, spec.axis) if spec.mode == "column" else P(spec.axis, None)
    layer.kernel.set_value(jax.device_put(layer.kernel.get_value(), spec.named(kernel)))
    if layer.bias is not None:
        layer.bias.set_value(jax.device_put(layer.bias.get_value(), spec.named(spec.bias_spec())))


def shard_model(
    module: nnx.Module,
    mesh: Mesh,
    rules: Mapping[str, str] | None = None,
    *,
    model_axis: str | None = "model",
    data_axis: str | tuple[str, ...] | None = None,
    unnest: bool = False,
) -> nnx.State:
    """Shard ``module``'s state over ``mesh`` for data and tensor parallelism,
    in place, and return the shardings of ``nnx.state(module)``.

    ``rules`` maps a layer pattern to "column" or "row": a Linear4bit,
    Linear8bit or nnx.Linear whose dotted path matches it (fnmatch on the whole
    path, e.g. ``layers.*.mlp.up``, or equal to one of its components, e.g.
    ``up``) is split over ``model_axis`` (Megatron: "column" for the first
    linear of a block, "row" for the one after it). Every other quantized
    layer is replicated. All quantized layers split their input batch over
    ``data_axis`` (None: no data parallelism), see ``q4jax.LinearSharding``.
    Every other array (dense kernels, adapters, norms, RNG state) is
    replicated on the mesh. ``unnest`` lets nested 4-bit statistics that a
    shard boundary would split be decoded to fp32 (exact) instead of raising.

    Every layer is validated before anything changes: a ValueError lists each
    layer that cannot be split (with the offending value), each rule that
    matches no layer, and layers matched by both modes. The returned State of
    NamedSharding fits ``jax.jit``'s in/out_shardings and optimizer states; put
    the batch on ``NamedSharding(mesh, P(data_axis))``. Run the model under
    ``jax.jit`` / ``nnx.jit``.
    """
    check_graph_root(module, "shard_model")
    if not isinstance(mesh, Mesh):
        raise TypeError(f"mesh must be a jax.sharding.Mesh, got {type(mesh).__name__}")
    rules = dict(rules or {})
    for pattern, mode in rules.items():
        if mode not in _RULE_MODES:
            raise ValueError(f"rule {pattern!r}: mode must be one of {_RULE_MODES}, got {mode!r}")
    specs = {"replicated": LinearSharding(mesh, "replicated", None, data_axis, unnest)}
    for mode in sorted(set(rules.values())):
        specs[mode] = LinearSharding(mesh, mode, model_axis, data_axis, unnest)
    targets = [
        (p, child) for p, _, _, child in graph_edges(module) if isinstance(child, (Linear4bit, Linear8bit, nnx.Linear))
    ]
    if isinstance(module, (Linear4bit, Linear8bit, nnx.Linear)):
        targets.insert(0, ((), module))
    errs: list[str] = []
    used: set[str] = set()
    chosen: dict[int, tuple[str, str, Any]] = {}
    for path, layer in targets:
        name = path_name(path) or "<root>"
        hits = [p for p in rules if _rule_matches(p, name, path)]
        used.update(hits)
        modes = sorted({rules[p] for p in hits})
        if len(modes) > 1:
            errs.append(f"{name}: rules {hits} ask for both column and row")
            continue
        mode = modes[0] if modes else "replicated"
        if id(layer) in chosen:
            first, first_mode, _ = chosen[id(layer)]
            if first_mode != mode:
                errs.append(f"{name}: the same layer as {first}, which is {first_mode}, but this path is {mode}")
            continue
        chosen[id(layer)] = (name, mode, layer)
        if mode == "replicated" and type(layer) is nnx.Linear:
            continue
        try:
            _check_layer(layer, specs[mode])
        except ValueError as e:
            errs.append(f"{name}: {e}")
    unused = [p for p in rules if p not in used]
    if unused:
        errs.append(f"rules {unused} match no Linear4bit, Linear8bit or nnx.Linear")
    if errs:
        raise ValueError("shard_model: " + "; ".join(errs))
    placed: set[int] = set()
    for name, mode, layer in chosen.values():
        if type(layer) is nnx.Linear:
            if mode == "replicated":
                continue
            _shard_dense(layer, specs[mode])
        else:
            layer.shard(specs[mode])
        placed.update(id(a) for a in jax.tree.leaves(nnx.state(layer)))
        logger.info("q4jax.shard_model: %s %s", name, mode)
    state = nnx.state(module)
    replicated = NamedSharding(mesh, P())
    shardings = jax.tree.map(lambda a: a.sharding if id(a) in placed else replicated, state)
    nnx.update(module, jax.device_put(state, shardings))
    return shardings
