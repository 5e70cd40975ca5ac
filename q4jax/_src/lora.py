"""LoRA adapters over q4jax's quantized layers (flax.nnx).

flax.nnx's own ``nnx.LoRA(base_module=...)`` does the work: y = base(x) + x A B
with A [in, rank], B [rank, out] as ``nnx.LoRAParam``. The quantized layers
hold their bytes in ``QuantStateVar`` (not an ``nnx.Param``), so the filter
``nnx.LoRAParam`` selects exactly the adapters for ``nnx.grad``
(``argnums=nnx.DiffState(0, nnx.LoRAParam)``) and for
``nnx.Optimizer(model, tx, wrt=nnx.LoRAParam)``; the base layers' biases are
``nnx.Param`` and stay frozen under that filter.

The same function as peft's LoRA with ``lora_alpha == r`` (scaling 1):
A = lora_A.weight.T, B = lora_B.weight.T.
"""

from __future__ import annotations

import fnmatch
import logging
import math

import jax
import jax.numpy as jnp
from flax import nnx

from q4jax._src.graph import check_graph_root, graph_edges, path_name, set_child
from q4jax._src.layers import Linear4bit, Linear8bit
from q4jax._src.projection import _Projection

logger = logging.getLogger("q4jax")


def _matches(name: str, targets) -> bool:
    last = name.rsplit(".", 1)[-1]
    return any(fnmatch.fnmatchcase(name, t) or fnmatch.fnmatchcase(last, t) for t in targets)


def add_lora(
    model: nnx.Module,
    rank: int,
    *,
    targets: tuple[str, ...] | None = None,
    rngs: nnx.Rngs | None = None,
    param_dtype=jnp.float32,
    dtype=None,
    a_initializer=None,
    b_initializer=nnx.initializers.zeros,
) -> nnx.Module:
    """Wrap, in place, every q4jax ``Linear4bit`` / ``Linear8bit`` below
    ``model`` (those whose dotted path or last name matches a glob of
    ``targets``; all when None) in ``nnx.LoRA(in, rank, out,
    base_module=layer)``; returns ``model``. B starts at zero, so the model's
    function is unchanged until it trains. A layer reachable by several paths
    gets one shared adapter. ``a_initializer`` defaults to nnx.LoRA's
    (He uniform), ``b_initializer`` to zeros. The quantized layer is not copied: the wrapper
    holds it. Refuses a model with no such layer, a rank < 1, and targets
    that match none of its quantized layers."""
    check_graph_root(model, "add_lora")
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise ValueError(f"rank must be a positive int, got {rank!r}")
    if isinstance(targets, str):
        targets = (targets,)
    rngs = nnx.Rngs(0) if rngs is None else rngs
    if not isinstance(rngs, nnx.Rngs):
        raise TypeError(f"rngs must be an nnx.Rngs, got {type(rngs).__name__}")
    edges = [e for e in graph_edges(model) if isinstance(e[3], (Linear4bit, Linear8bit))]
    if not edges:
        raise ValueError("add_lora found no q4jax Linear4bit / Linear8bit in the model: quantize it first")
    # a quantized Einsum / LinearGeneral holds its 2-D layer as `base`: the adapter goes on
    # those rows (the same function as a LoRA on the flattened projection), named by the projection
    edges = [
        (path[:-1] if isinstance(parent, _Projection) else path, parent, key, child)
        for path, parent, key, child in edges
    ]
    wrapped: dict[int, nnx.LoRA] = {}
    for path, parent, key, child in edges:
        name = path_name(path)
        if isinstance(parent, nnx.LoRA):
            continue  # already adapted
        if targets is not None and not _matches(name, targets):
            continue
        if isinstance(parent, _Projection) and parent.split.shared:
            logger.warning("q4jax.add_lora: %s has shared (batch) axes, one matrix per index: not adapted", name)
            continue
        new = wrapped.get(id(child))
        if new is None:
            a_init = nnx.initializers.he_uniform() if a_initializer is None else a_initializer
            new = nnx.LoRA(
                child.in_features,
                rank,
                child.out_features,
                base_module=child,
                dtype=dtype,
                param_dtype=param_dtype,
                a_initializer=a_init,
                b_initializer=b_initializer,
                rngs=rngs,
            )
            stack = child.stack_shape
            if stack:  # a stacked layer (nnx.vmap / nnx.scan): one adapter per slice, stacked alike
                n = math.prod(stack)
                keys = jax.random.split(rngs.params(), 2 * n)
                a = [a_init(keys[i], (child.in_features, rank), param_dtype) for i in range(n)]
                b = [b_initializer(keys[n + i], (rank, child.out_features), param_dtype) for i in range(n)]
                new.lora_a.set_value(jnp.stack(a).reshape(*stack, child.in_features, rank))
                new.lora_b.set_value(jnp.stack(b).reshape(*stack, rank, child.out_features))
            wrapped[id(child)] = new
        set_child(parent, key, new)
        logger.info("q4jax.add_lora: %s (%s) rank %d", name, type(child).__name__, rank)
    if not wrapped:
        raise ValueError(
            f"targets {list(targets or ())} match none of the quantized layers {[path_name(e[0]) for e in edges]}"
        )
    return model


def lora_from_lora_linear(child: nnx.LoRALinear, base: nnx.Module) -> nnx.LoRA:
    """An nnx.LoRA over ``base`` holding ``child``'s own adapter Variables (the
    same objects: quantizing the base keeps the adapters as they are)."""
    lora = child.lora
    a = lora.lora_a
    new = nnx.LoRA(
        child.in_features,
        int(a.shape[1]),
        child.out_features,
        base_module=base,
        dtype=lora.dtype,
        param_dtype=lora.param_dtype,
        lora_param_type=lora.lora_param_type,
        rngs=nnx.Rngs(0),
    )
    new.lora_a = lora.lora_a
    new.lora_b = lora.lora_b
    return new
