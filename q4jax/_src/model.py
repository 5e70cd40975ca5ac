"""Whole-model rewriting for flax.nnx: walking a module graph and replacing
nnx.Linear layers by Linear4bit / Linear8bit (quantize_model)."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

import numpy as np
from flax import nnx
from flax.nnx import graphlib

from q4._src import formats, quantizers
from q4._src.weights import quantize_weight_4bit
from q4jax._src.embedding import Embedding4bit, Embedding8bit
from q4jax._src.layers import Linear4bit, Linear8bit

logger = logging.getLogger("q4jax")

# ------------------------------------------------------------------ graph walking


def graph_children(node) -> Iterator[tuple[Any, Any]]:
    impl = graphlib.get_node_impl(node)
    if impl is None:
        return
    for key, child in impl.node_dict(node).items():
        if isinstance(key, str) and key.startswith("_"):
            continue  # nnx internals (_pytree__state, _length, ...)
        yield key, child


def graph_edges(root) -> Iterator[tuple[tuple, Any, Any, Any]]:
    """(path, parent, key, child) for every edge to a Module below root, in
    attribute order; a module reachable by several paths is yielded once per
    path (as torch's state_dict does), but its subtree is walked once per path
    only while no cycle is formed."""

    def walk(node, path, on_stack):
        for key, child in graph_children(node):
            if isinstance(child, nnx.Variable) or not graphlib.is_node(child):
                continue
            if id(child) in on_stack:
                continue
            p = (*path, key)
            if isinstance(child, nnx.Module):
                yield p, node, key, child
            yield from walk(child, p, on_stack | {id(child)})

    yield from walk(root, (), frozenset({id(root)}))


def path_name(path: tuple) -> str:
    return ".".join(str(k) for k in path)


def set_child(parent, key, value) -> None:
    if isinstance(parent, (nnx.List, nnx.Dict, list, dict)):
        parent[key] = value
    else:
        setattr(parent, key, value)


def check_graph_root(module, what: str) -> None:
    if not isinstance(module, nnx.Module):
        raise TypeError(f"{what} expects an nnx.Module, got {type(module).__name__}")


def quantize_model(
    module: nnx.Module,
    quant_type: str = "nf4",
    *,
    blocksize: int = 64,
    compress_statistics: bool = True,
    compute_dtype=None,
    threshold: float = 0.0,
    skip: tuple[str, ...] = ("lm_head",),
    activation_quant: str | None = None,
    embeddings: bool = False,
    method: str = "absmax",
    calibration=None,
    gptq_damp: float = 0.01,
) -> nnx.Module:
    """Replace every nnx.Linear below ``module`` in place with a Linear4bit
    (quant_type "nf4" / "fp4") or a Linear8bit ("int8"), and return ``module``.
    An nnx.LoRALinear becomes an ``nnx.LoRA`` whose base is the quantized
    layer and whose adapters are the LoRALinear's own (the same Variables).

    A Linear whose dotted path (torch-style, e.g. ``layers.0.attn.q``) equals an
    entry of ``skip`` or has it as one of its components is left dense. A Linear
    reachable by several paths is replaced by one shared quantized layer. Each
    replacement is logged on the "q4jax" logger (INFO). ``activation_quant='int8'``
    makes the 4-bit layers W4A8 (README "W4A8"; every replaced layer's
    in_features must be a multiple of its block).

    ``embeddings=True`` also replaces every nnx.Embed (same skip rules) by an
    Embedding4bit with the same quant_type, blocksize and compress_statistics,
    or an Embedding8bit for "int8" (q4jax/_src/embedding.py).

    ``method`` chooses the 4-bit scales and codes, as q4torch.replace_linear's
    (the same numpy quantizers, so identical weights and Hessians give
    identical bytes): 'absmax' (bitsandbytes'), 'mse', or 'gptq' with
    ``calibration``, an iterable of model inputs (an array, a tuple of
    positional arguments, or a dict of keyword arguments whose
    'attention_mask', if any, leaves padding tokens out), run eagerly once
    through the float model; ``gptq_damp`` as there.
    """
    check_graph_root(module, "quantize_model")
    formats.check_layer_options(quant_type, blocksize, activation_quant)
    quantizers.check_method_options(method, quant_type, calibration, gptq_damp)
    if isinstance(module, nnx.Linear):
        raise TypeError("quantize_model replaces Linear layers inside a model; use Linear4bit.from_linear on a Linear")
    if isinstance(skip, str):
        skip = (skip,)
    kinds = (nnx.Linear, nnx.LoRALinear, nnx.Embed) if embeddings else (nnx.Linear, nnx.LoRALinear)
    targets = [(p, parent, key, child) for p, parent, key, child in graph_edges(module) if type(child) in kinds]

    def skipped(path) -> bool:
        return path_name(path) in skip or any(str(k) in skip for k in path)

    linears = [e for e in targets if type(e[3]) is not nnx.Embed and not skipped(e[0])]
    hessians = _calibrate(module, linears, calibration, blocksize) if method == "gptq" else {}
    replaced: dict[int, nnx.Module] = {}
    for path, parent, key, child in targets:
        name = path_name(path)
        if skipped(path):
            logger.info("q4jax.quantize_model: kept %s dense (skip list)", name)
            continue
        if type(child) is nnx.Embed:
            _replace_embed(replaced, parent, key, child, name, quant_type, blocksize, compress_statistics)
            continue
        new = replaced.get(id(child))
        if new is None:
            if quant_type == "int8":
                new = Linear8bit.from_linear(child, threshold=threshold)
            else:
                if activation_quant is not None:
                    try:
                        formats.check_w4a8_features(child.in_features, blocksize)
                    except ValueError as e:
                        raise ValueError(f"{name}: {e}; skip it (skip=...) or leave activation_quant unset") from None
                new = Linear4bit.from_linear(
                    child,
                    quant_type=quant_type,
                    blocksize=blocksize,
                    compress_statistics=compress_statistics,
                    compute_dtype=compute_dtype,
                    activation_quant=activation_quant,
                )
                if method != "absmax":
                    new.set_quantized(*_error_minimised(child, method, hessians.get(id(child)), new, gptq_damp))
                    logger.info("q4jax.quantize_model(method=%r): %s", method, name)
            if type(child) is nnx.LoRALinear:  # quantize the base, keep the adapters
                from q4jax._src.lora import lora_from_lora_linear

                new = lora_from_lora_linear(child, new)
            replaced[id(child)] = new
        set_child(parent, key, new)
        logger.info(
            "q4jax.quantize_model: %s nnx.%s(%d, %d) -> %s (%s)",
            name,
            type(child).__name__,
            child.in_features,
            child.out_features,
            type(new).__name__,
            quant_type,
        )
    return module


def _error_minimised(linear, method: str, hessian, layer: Linear4bit, damp: float = 0.01):
    """(packed, state) of a Linear's W = kernel.T by the 'mse' or 'gptq'
    quantizer with ``layer``'s settings."""
    kernel = linear.kernel.get_value()
    return quantize_weight_4bit(
        np.asarray(kernel, np.float32).T, layer.blocksize, layer.quant_type, layer.compress_statistics, method,
        hessian=hessian, damp=damp, dtype=np.dtype(kernel.dtype).name,
    )  # fmt: skip


class _Recorder(nnx.Module):
    """Stands in for a Linear during calibration: adds each input to its
    Hessian accumulator (host numpy), then calls the Linear."""

    def __init__(self, inner, acc, mask):
        self.inner = inner
        self._acc = acc
        self._mask = mask

    def __call__(self, x, *args, **kwargs):
        self._acc.add(np.asarray(x, np.float32), self._mask[0])
        return self.inner(x, *args, **kwargs)


def _calibrate(module, linears, calibration, blocksize: int) -> dict[int, np.ndarray]:
    """GPTQ's Hessians (sum of x x^T, fp64) of each Linear's inputs over the
    calibration batches, from one eager pass of the float model."""
    quantizers.check_gptq_layers([(path_name(p), c.in_features) for p, _, _, c in linears], blocksize)
    accs: dict[int, quantizers.HessianAccumulator] = {}
    names: dict[int, str] = {}
    mask: list = [None]
    swapped = []
    for path, parent, key, child in linears:
        acc = accs.setdefault(id(child), quantizers.HessianAccumulator(child.in_features))
        names.setdefault(id(child), path_name(path))
        set_child(parent, key, _Recorder(child, acc, mask))
        swapped.append((parent, key, child))
    try:
        quantizers.run_calibration(
            module, calibration, mask, np.asarray, lambda msg, *a: logger.info("q4jax.quantize_model: " + msg, *a)
        )
    finally:
        for parent, key, child in swapped:
            set_child(parent, key, child)
    return quantizers.hessians(accs, names)


def _replace_embed(replaced, parent, key, child, name, quant_type, blocksize, compress_statistics) -> None:
    new = replaced.get(id(child))
    if new is None:
        if quant_type == "int8":
            new = Embedding8bit.from_embed(child)
        else:
            new = Embedding4bit.from_embed(
                child, quant_type=quant_type, blocksize=blocksize, compress_statistics=compress_statistics
            )
        replaced[id(child)] = new
    set_child(parent, key, new)
    logger.info(
        "q4jax.quantize_model: %s nnx.Embed(%d, %d) -> %s (%s)",
        name,
        child.num_embeddings,
        child.features,
        type(new).__name__,
        quant_type,
    )
