"""Whole-model rewriting for flax.nnx: replacing a module graph's projections
(nnx.Linear, nnx.LinearGeneral, nnx.Einsum, nnx.Embed) by quantized layers,
with a report of what was left float (quantize_model); the graph walking is
graph.py's."""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from q4._src import formats, quantizers
from q4._src.report import EMBEDDINGS_OFF, SKIP_RULE, QuantizeReport, ReportRow
from q4._src.weights import quantize_weight_4bit
from q4jax._src.embedding import Embedding4bit, Embedding8bit
from q4jax._src.graph import check_graph_root, graph_edges, path_name, set_child
from q4jax._src.layers import Linear4bit, Linear8bit, concrete
from q4jax._src.lora import lora_from_lora_linear
from q4jax._src.projection import (
    KernelSplit,
    QuantizedEinsum,
    QuantizedLinearGeneral,
    _Projection,
    einsum_subscripts,
    linear_general_split,
    linear_general_subscripts,
    matrix_of,
    parse_einsum,
    split_kernel,
    stack_layers,
    to_rows,
)

logger = logging.getLogger("q4jax")

_ADVICE = "q4jax quantizes nnx.Linear, nnx.LinearGeneral, nnx.Einsum (and nnx.Embed with embeddings=True)"


def _overrides(child, base: type, *names: str) -> list[str]:
    """The methods among ``names`` that type(child) defines differently from ``base``."""
    return [name for name in names if getattr(type(child), name) is not getattr(base, name)]


def _names_read(fn) -> set[str]:
    """Attribute and global names a function's code (nested code included) reads."""
    code = getattr(fn, "__code__", None)
    todo, names = [code] if code is not None else [], set()
    while todo:
        c = todo.pop()
        names.update(c.co_names)
        todo.extend(k for k in c.co_consts if hasattr(k, "co_names"))
    return names


def _override_reason(child, base: type, weight: str, *methods: str) -> str | None:
    """None when every method of ``methods`` that the subclass overrides reaches the
    weight only through super() (never reads ``self.<weight>``), so the quantized layer
    can stand under it; otherwise why the layer stays float."""
    for name in _overrides(child, base, *methods):
        if weight in _names_read(getattr(type(child), name)):
            return f"{type(child).__name__}.{name} reads self.{weight} itself: its behaviour would be lost"
    return None


_WEIGHT = {"linear": "kernel", "general": "kernel", "einsum": "kernel", "embed": "embedding"}


def classify(child, embeddings: bool) -> tuple[str | None, str | None]:
    """(kind, None) for a layer quantize_model replaces -- kind 'linear', 'lora',
    'general', 'einsum' or 'embed' -- or (None, reason) for one it leaves float
    (reason None: not a weight-bearing layer, or one already quantized). A subclass
    that overrides the call is replaced when its override reaches the weight through
    super() only (keep_subclass puts the quantized call under it)."""
    if isinstance(child, (Linear4bit, Linear8bit, Embedding4bit, Embedding8bit, _Projection)):
        return None, None
    if isinstance(child, nnx.LoRALinear):
        over = _overrides(child, nnx.LoRALinear, "__call__")
        return ("lora", None) if not over else (None, f"{type(child).__name__} overrides {over[0]}")
    for base, kind in ((nnx.Linear, "linear"), (nnx.LinearGeneral, "general"), (nnx.Einsum, "einsum")):
        if isinstance(child, base):
            reason = _override_reason(child, base, "kernel", "__call__")
            return (kind, None) if reason is None else (None, reason)
    if isinstance(child, nnx.Embed):
        if not embeddings:
            return None, EMBEDDINGS_OFF
        reason = _override_reason(child, nnx.Embed, "embedding", "__call__", "attend")
        return ("embed", None) if reason is None else (None, reason)
    return None, None


def _stack_dims(child, kind: str) -> int:
    """How many leading axes of the kernel are a layer stack (nnx.vmap)."""
    if kind == "embed":
        return child.embedding.get_value().ndim - 2
    ndim = child.kernel.get_value().ndim
    if kind in ("linear", "lora"):
        return ndim - 2
    if kind == "einsum":
        return ndim - len(child.kernel_shape)
    return ndim - len(child.batch_axis) - len(child.in_features) - len(child.out_features)


def _split_of(child, kind: str) -> KernelSplit:
    if kind == "einsum":
        return split_kernel(*parse_einsum(child.einsum_str))
    return linear_general_split(child)


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
    strict: bool = False,
    return_report: bool = False,
):
    """Quantize, in place, every weight-bearing projection below ``module`` and return
    ``module`` (``(module, QuantizeReport)`` with ``return_report=True``):

    - ``nnx.Linear`` and its subclasses -> Linear4bit (quant_type "nf4" / "fp4") or
      Linear8bit ("int8"); an ``nnx.LoRALinear`` -> an ``nnx.LoRA`` over the quantized
      layer holding the LoRALinear's own adapters (the same Variables);
    - ``nnx.LinearGeneral`` (any axis, batch_axis, feature shapes; so every projection
      of ``nnx.MultiHeadAttention``) -> QuantizedLinearGeneral, ``nnx.Einsum`` (one
      input, one kernel whose axes are contracted or kept) -> QuantizedEinsum: the
      kernel stored as the 2-D [kept, contracted] matrix (q4jax/_src/projection.py),
      the call computing the same einsum on the fused kernels;
    - with ``embeddings=True``, ``nnx.Embed`` and its subclasses (``attend`` included)
      -> Embedding4bit / Embedding8bit.

    A subclass that overrides ``__call__`` (or an Embed's ``attend``) is left float and
    reported, never replaced with a behaviour it did not have. A layer stack created
    under ``nnx.vmap`` (kernels [L, ...]) becomes a stacked quantized layer, each slice
    quantized alone (its bytes are those of the layer by itself), that runs under
    ``nnx.scan`` / ``nnx.remat``. Every layer's call takes the float layer's keywords
    (``out_sharding``).

    Nothing is left float in silence: the report lists each layer quantized and each
    weight-bearing layer or float parameter of two or more axes left float, with the
    reason (skip rule, embeddings=False, unsupported type, overridden call, W4A8 block
    condition); quantized layers are logged on the "q4jax" logger at INFO, unsupported
    leftovers at WARNING. ``strict=True`` raises a ValueError listing the leftovers
    that no option (skip, embeddings=False) asked for.

    A layer whose dotted path (torch-style, e.g. ``layers.0.attn.q``) equals an entry of
    ``skip`` or has it as one of its components is left float. A layer reachable by
    several paths is replaced by one shared quantized layer. ``activation_quant='int8'``
    makes the 4-bit layers W4A8 (README "W4A8"; a layer whose in_features is not a
    multiple of its block is left float and reported).

    ``method`` chooses the 4-bit scales and codes, as q4torch.replace_linear's (the
    same numpy quantizers, so identical weights and Hessians give identical bytes):
    'absmax' (bitsandbytes'), 'mse', or 'gptq' with ``calibration``, an iterable of
    model inputs (an array, a tuple of positional arguments, or a dict of keyword
    arguments whose 'attention_mask', if any, leaves padding tokens out), run eagerly
    once through the float model (not through stacked layers or shared axes);
    ``gptq_damp`` as there.
    """
    check_graph_root(module, "quantize_model")
    formats.check_layer_options(quant_type, blocksize, activation_quant)
    quantizers.check_method_options(method, quant_type, calibration, gptq_damp)
    if isinstance(module, (nnx.Linear, nnx.LinearGeneral, nnx.Einsum)):
        raise TypeError(
            "quantize_model replaces layers inside a model; use Linear4bit.from_linear on a Linear "
            f"(got a {type(module).__name__})"
        )
    if isinstance(skip, str):
        skip = (skip,)
    report = QuantizeReport()
    settings = LayerSettings(quant_type, blocksize, compress_statistics, compute_dtype, activation_quant, threshold)

    def skipped(path) -> bool:
        return path_name(path) in skip or any(str(k) in skip for k in path)

    targets, seen = [], set()
    for path, parent, key, child in graph_edges(module):
        kind, reason = classify(child, embeddings)
        name = path_name(path)
        if kind is None and reason is None:
            continue
        if kind is None or skipped(path):
            if id(child) not in seen:
                report.left_float.append(ReportRow(name, _cls(child), SKIP_RULE if skipped(path) else str(reason)))
            seen.add(id(child))
            continue
        if activation_quant is not None and kind != "embed":
            try:
                formats.check_w4a8_features(_in_features(child, kind), blocksize)
            except ValueError as e:
                report.left_float.append(ReportRow(name, _cls(child), f"activation_quant='int8': {e}"))
                seen.add(id(child))
                continue
        targets.append((path, parent, key, child, kind))
    linears = [t for t in targets if t[4] != "embed"]
    hessians = _calibrate(module, linears, calibration, blocksize) if method == "gptq" else {}
    replaced: dict[int, nnx.Module] = {}
    for path, parent, key, child, kind in targets:
        name = path_name(path)
        new = replaced.get(id(child))
        if new is None:
            new = quantized_layer(child, kind, settings, name, method, hessians.get(id(child)), gptq_damp)
            replaced[id(child)] = new
            report.quantized.append(ReportRow(name, _cls(child), _describe(new, quant_type)))
            logger.info("q4jax.quantize_model: %s %s -> %s", name, _cls(child), report.quantized[-1].detail)
        set_child(parent, key, new)
    _report_float_params(module, report, skipped)
    report.log_left_float(logger, "q4jax.quantize_model")
    if strict:
        report.check_strict("quantize_model", _ADVICE)
    return (module, report) if return_report else module


def _cls(layer) -> str:
    t = type(layer)
    return f"nnx.{t.__name__}" if t.__module__.startswith("flax.") else t.__name__


def _in_features(child, kind: str) -> int:
    if kind in ("linear", "lora"):
        return child.in_features
    split = _split_of(child, kind)
    shape = tuple(child.kernel.get_value().shape[_stack_dims(child, kind) :])
    size = dict(zip(split.kernel, shape, strict=True))
    return math.prod(size[c] for c in split.contracted)


def _describe(layer, quant_type: str) -> str:
    stack = getattr(getattr(layer, "base_module", layer), "stack_shape", ())
    where = f", stacked {list(stack)}" if stack else ""
    return f"{type(layer).__name__} ({quant_type}{where})"


def _report_float_params(module, report: QuantizeReport, skipped) -> None:
    """Float parameters of two or more axes outside every q4jax layer and outside the
    layers already reported: a raw nnx.Param used as a matmul weight, a conv kernel
    (a skip rule over its path makes it deliberate)."""
    q4_paths = {path for path, _, _, child in graph_edges(module) if _is_q4(child)}
    reported = {r.path for r in report.left_float}
    owners = {path: child for path, _, _, child in graph_edges(module)}
    done: set[int] = set()
    for path, node in nnx.iter_graph(module):
        if not isinstance(node, nnx.Param) or isinstance(node, nnx.LoRAParam) or id(node) in done:
            continue
        value = node.get_value()
        if getattr(value, "ndim", 0) < 2 or not jnp.issubdtype(value.dtype, jnp.floating):
            continue
        done.add(id(node))
        owner_path = tuple(path[:-1])
        if any(owner_path[:i] in q4_paths for i in range(len(owner_path) + 1)):
            continue
        if any(path_name(owner_path[:i]) in reported for i in range(1, len(owner_path) + 1)):
            continue
        owner = owners.get(owner_path, module)
        why = f"a float parameter {tuple(value.shape)} of {_cls(owner)}, not a layer type q4jax quantizes"
        report.left_float.append(ReportRow(path_name(path), _cls(owner), SKIP_RULE if skipped(path) else why))


def _is_q4(layer) -> bool:
    return isinstance(layer, (Linear4bit, Linear8bit, Embedding4bit, Embedding8bit, _Projection))


@dataclass(frozen=True)
class LayerSettings:
    """What a replacement layer is built with: quantize_model's arguments, or (load_quantized)
    the checkpoint's format, which the loaded entries then fill."""

    quant_type: str
    blocksize: int = 64
    compress_statistics: bool = True
    compute_dtype: Any = None
    activation_quant: str | None = None
    threshold: float = 0.0


def quantized_layer(
    child, kind: str, settings: LayerSettings, name: str, method: str = "absmax", hessian=None, damp=0.01
):
    """The quantized replacement of a float layer classified as ``kind`` (classify):
    each stacked slice (nnx.vmap) and each shared index quantized on its own."""
    quant_type = settings.quant_type
    lead = _stack_dims(child, kind)
    if kind == "embed":
        table = child.embedding.get_value()
        if lead:
            raise ValueError(f"{name}: a stacked ({list(table.shape[:lead])}) embedding is not supported")
        if quant_type == "int8":
            return keep_subclass(child, Embedding8bit.from_embed(child), nnx.Embed)
        new = Embedding4bit.from_embed(
            child,
            quant_type=quant_type,
            blocksize=settings.blocksize,
            compress_statistics=settings.compress_statistics,
        )
        return keep_subclass(child, new, nnx.Embed)
    if method == "gptq" and lead:
        raise ValueError(
            f"{name}: method='gptq' needs an eager calibration pass, which a stacked (nnx.vmap) layer has not"
        )
    placeholder = isinstance(child.kernel.get_value(), jax.ShapeDtypeStruct)  # (zeros: nothing to check)
    kernel = np.asarray(concrete(child.kernel.get_value()))
    if kind in ("linear", "lora"):
        w = np.swapaxes(kernel, -1, -2)[..., None, :, :]  # [*lead, 1, out, in]
    else:
        w = matrix_of(kernel, _split_of(child, kind), lead)  # [*lead, S, out, in]
    if not placeholder:
        _check_finite(w, settings, name)
    stack = kernel.shape[:lead]
    bias = None if child.bias is None else concrete(child.bias.get_value())
    flat = w.reshape(-1, *w.shape[-3:])
    with_bias = kind in ("linear", "lora") and bias is not None
    flat_bias = np.asarray(bias).reshape(-1, w.shape[-2]) if with_bias else [None] * len(flat)
    shared = kind in ("einsum", "general") and bool(_split_of(child, kind).shared)
    layers = []
    for i, ws in enumerate(flat):
        per = [_matrix_layer(m, child.dtype, settings, flat_bias[i], method, hessian, damp) for m in ws]
        layers.append(stack_layers(per, (len(per),)) if shared else per[0])
    base = layers[0] if not stack else stack_layers(layers, stack)
    if kind == "lora":
        return lora_from_lora_linear(child, base)
    if kind == "linear":
        return keep_subclass(child, base, nnx.Linear)
    cls = QuantizedEinsum if kind == "einsum" else QuantizedLinearGeneral
    proj = cls(child, base, _split_of(child, kind), None if bias is None else jnp.array(bias, copy=True))
    return keep_subclass(child, proj, nnx.Einsum if kind == "einsum" else nnx.LinearGeneral)


_SUBCLASSES: dict[tuple[type, type], type] = {}


def keep_subclass(child, new, flax_cls: type):
    """``new`` (a q4jax layer replacing ``child``, an instance of a subclass of
    ``flax_cls``) as an instance of the subclass over the quantized layer: its class
    becomes ``Sub<suffix>(Sub, _Quantized)`` where ``_Quantized(type(new), flax_cls)``,
    so the method resolution order is Sub, the quantized layer, then flax_cls: the
    subclass's own methods run, and its ``super().__call__`` / ``super().attend`` reach
    the quantized ones. The float layer's extra attributes (not its weight and bias)
    are copied over, so model code that calls ``layer.encode(...)`` or reads
    ``layer.scale`` keeps working; isinstance(new, type(child)) holds."""
    sub = type(child)
    if sub is flax_cls:
        return new
    key = (sub, type(new))
    cls = _SUBCLASSES.get(key)
    if cls is None:
        quantized = type(new)
        mixin = type(f"_{quantized.__name__}As{flax_cls.__name__}", (quantized, flax_cls), {"__module__": __name__})
        doc = f"{sub.__name__} with its weight quantized ({quantized.__name__}; q4jax.quantize_model)."
        name = f"{sub.__name__}{_SUFFIX.get(quantized.__name__, 'Quantized')}"
        cls = _SUBCLASSES[key] = type(name, (sub, mixin), {"__module__": sub.__module__, "__doc__": doc})
    own = set(vars(new))
    new.__class__ = cls
    for attr, value in vars(child).items():
        # the float weight and bias are what the quantized layer replaced
        if attr.startswith("_") or attr in own or attr in ("kernel", "embedding", "bias"):
            continue
        setattr(new, attr, value)
    return new


_SUFFIX = {"Linear4bit": "4bit", "Linear8bit": "8bit", "Embedding4bit": "4bit", "Embedding8bit": "8bit"}


def _check_finite(w: np.ndarray, settings: LayerSettings, name: str) -> None:
    """Nested statistics of a weight holding NaN or Inf would decode every block of the
    layer to NaN (the on-device quantizer cannot raise on data): refused here, naming the
    layer and the blocks (q4's host quantizers say the same)."""
    if settings.quant_type == "int8" or not settings.compress_statistics:
        return
    if np.isfinite(w).all():  # (in the weight's own dtype: no float32 copy of a large table)
        return
    flat = np.asarray(w, np.float32).reshape(-1)
    bs = settings.blocksize
    absmax = np.abs(np.pad(flat, (0, -flat.size % bs))).reshape(-1, bs).max(axis=1)
    try:
        quantizers.check_nested_absmax(absmax, bs)
    except ValueError as e:
        raise ValueError(f"{name}: {e}") from None


def _matrix_layer(w: np.ndarray, dtype, settings: LayerSettings, bias, method: str, hessian, damp: float):
    """A Linear4bit / Linear8bit holding W [out, in] (and ``bias``, or none)."""
    kernel = jnp.asarray(np.ascontiguousarray(w.T))
    args = dict(
        use_bias=bias is not None,
        dtype=dtype,
        param_dtype=kernel.dtype,
        kernel_init=lambda *_: kernel,
        bias_init=lambda *_: jnp.asarray(bias),
        rngs=nnx.Rngs(0),
    )
    if settings.quant_type == "int8":
        return Linear8bit(w.shape[1], w.shape[0], threshold=settings.threshold, **args)
    layer = Linear4bit(
        w.shape[1],
        w.shape[0],
        quant_type=settings.quant_type,
        blocksize=settings.blocksize,
        compress_statistics=settings.compress_statistics,
        compute_dtype=settings.compute_dtype,
        activation_quant=settings.activation_quant,
        **args,
    )
    if method != "absmax":
        layer.set_quantized(*_error_minimised(w, method, hessian, layer, damp))
    return layer


def _error_minimised(w: np.ndarray, method: str, hessian, layer: Linear4bit, damp: float = 0.01):
    """(packed, state) of W [out, in] by the 'mse' or 'gptq' quantizer with ``layer``'s settings."""
    return quantize_weight_4bit(
        np.asarray(w, np.float32), layer.blocksize, layer.quant_type, layer.compress_statistics, method,
        hessian=hessian, damp=damp, dtype=np.dtype(w.dtype).name,
    )  # fmt: skip


class _Recorder(nnx.Module):
    """Stands in for a layer during calibration: adds each input, as the rows its
    2-D matrix multiplies ([..., in]), to its Hessian accumulator (host numpy), then
    calls the layer."""

    def __init__(self, inner, kind, acc, mask):
        self.inner = inner
        self._kind = kind
        self._acc = acc
        self._mask = mask

    def __call__(self, x, *args, **kwargs):
        self._acc.add(np.asarray(_rows_of(self.inner, self._kind, x, *args, **kwargs), np.float32), self._mask[0])
        return self.inner(x, *args, **kwargs)


def _rows_of(layer, kind: str, x, einsum_str=None, **_):
    """x as the rows [..., in] that the layer's 2-D matrix multiplies."""
    if kind in ("linear", "lora"):
        return x
    if kind == "einsum":
        xs, _ys, split = einsum_subscripts(einsum_str or layer.einsum_str, x.ndim)
    else:
        split = linear_general_split(layer)
        xs, _ys = linear_general_subscripts(layer.axis, layer.batch_axis, split, x.ndim)
    return to_rows(jnp.asarray(x), xs, split)[0]


def _calibrate(module, linears, calibration, blocksize: int) -> dict[int, np.ndarray]:
    """GPTQ's Hessians (sum of x x^T, fp64) of each layer's input rows over the
    calibration batches, from one eager pass of the float model."""
    for path, _, _, child, kind in linears:
        if _stack_dims(child, kind):
            raise ValueError(
                f"{path_name(path)}: method='gptq' needs an eager calibration pass, which a stacked "
                "(nnx.vmap) layer does not get; use method='mse' or 'absmax' for it, or skip it"
            )
        if kind in ("einsum", "general") and _split_of(child, kind).shared:
            raise ValueError(f"{path_name(path)}: method='gptq' on a layer with shared (batch) axes is not supported")
    quantizers.check_gptq_layers([(path_name(p), _in_features(c, k)) for p, _, _, c, k in linears], blocksize)
    accs: dict[int, quantizers.HessianAccumulator] = {}
    names: dict[int, str] = {}
    mask: list = [None]
    swapped = []
    for path, parent, key, child, kind in linears:
        acc = accs.setdefault(id(child), quantizers.HessianAccumulator(_in_features(child, kind)))
        names.setdefault(id(child), path_name(path))
        set_child(parent, key, _Recorder(child, kind, acc, mask))
        swapped.append((parent, key, child))
    try:
        quantizers.run_calibration(
            module, calibration, mask, np.asarray, lambda msg, *a: logger.info("q4jax.quantize_model: " + msg, *a)
        )
    finally:
        for parent, key, child in swapped:
            set_child(parent, key, child)
    return quantizers.hessians(accs, names)
