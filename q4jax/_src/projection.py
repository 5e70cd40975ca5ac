"""Quantized nnx.Einsum and nnx.LinearGeneral: any projection whose weight axes split
into contracted and kept axes, over one 2-D quantized layer.

A kernel with axes K (its einsum letters) is stored as the 2-D matrix
W [out, in] = kernel transposed to (kept..., contracted...) and reshaped, the
kept and contracted axes each in the kernel's own order: the bytes q4torch and
bitsandbytes store for that matrix. Axes that appear in the input, the kernel
and the output (nnx.LinearGeneral's ``batch_axis``) are "shared": one matrix per
index, held stacked. The call transposes and reshapes x to rows [M, in], runs
the fused kernel of the 2-D layer (``base``: a Linear4bit or Linear8bit, or an
nnx.LoRA over one), and reshapes / transposes the rows [M, out] back; the
dequantized W is never formed. The float layer's bias (its own shape) is added
afterwards, broadcast as the float layer broadcasts it.

Every attribute model code reads from the float layer keeps its value
(``einsum_str``, ``kernel_shape``, ``bias_shape``, ``in_features``,
``out_features``, ``axis``, ``batch_axis``, ``use_bias``, ``dtype``), and the call
takes the float layer's arguments (``out_sharding``; nnx.Einsum's call-time
``einsum_str``, when it splits the kernel the same way).
"""

from __future__ import annotations

import math
import string
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from q4jax._src.layers import Linear4bit, Linear8bit, WeightShape, out_sharded, plan_bias


class Unsupported(ValueError):
    """A projection q4jax cannot quantize, with the reason (quantize_model reports it)."""


@dataclass(frozen=True)
class KernelSplit:
    """How a kernel's axes split: letters of the shared, kept (out) and contracted (in)
    axes, each in kernel order, and the kernel permutation to (shared, kept, contracted)."""

    kernel: str
    shared: str
    kept: str
    contracted: str

    @property
    def perm(self) -> tuple[int, ...]:
        return tuple(self.kernel.index(c) for c in self.shared + self.kept + self.contracted)


def parse_einsum(einsum_str: str) -> tuple[str, str, str]:
    """(x, kernel, y) subscripts of an explicit two-operand einsum, spaces removed."""
    s = einsum_str.replace(" ", "")
    if s.count("->") != 1 or s.count(",") != 1:
        raise Unsupported(f"einsum_str {einsum_str!r} must be explicit ('->') with exactly two operands")
    lhs, y = s.split("->")
    x, k = lhs.split(",")
    return x, k, y


def split_kernel(x: str, k: str, y: str) -> KernelSplit:
    """The split of kernel subscripts k for x,k->y (x and y may hold '...', the kernel
    not); Unsupported when an axis is summed outside the product or repeated."""
    if "..." in k:
        raise Unsupported(f"the kernel subscripts {k!r} hold '...'")
    xs, ys = x.replace("...", ""), y.replace("...", "")
    for what, sub in (("input", xs), ("kernel", k), ("output", ys)):
        if len(set(sub)) != len(sub) or not sub.isalpha() and sub:
            raise Unsupported(f"the {what} subscripts {sub!r} repeat a letter or hold a non-letter")
    if ("..." in x) != ("..." in y):
        raise Unsupported(f"'...' must appear in both the input and the output ({x},{k}->{y})")
    for c in k:
        if c not in xs and c not in ys:
            raise Unsupported(f"kernel axis {c!r} is summed over on its own ({x},{k}->{y})")
    for c in xs:
        if c not in k and c not in ys:
            raise Unsupported(f"input axis {c!r} is summed over without the kernel ({x},{k}->{y})")
    for c in ys:
        if c not in xs and c not in k:
            raise Unsupported(f"output axis {c!r} comes from neither operand ({x},{k}->{y})")
    shared = "".join(c for c in k if c in xs and c in ys)
    kept = "".join(c for c in k if c in ys and c not in xs)
    contracted = "".join(c for c in k if c in xs and c not in ys)
    if not contracted:
        raise Unsupported(f"no axis is contracted ({x},{k}->{y}): not a projection")
    return KernelSplit(k, shared, kept, contracted)


def matrix_of(kernel: np.ndarray, split: KernelSplit, lead: int = 0) -> np.ndarray:
    """W [*lead, S, out, in] of a kernel [*lead, *kernel axes] (S = the product of the
    shared axes, 1 when there are none)."""
    shape = kernel.shape[lead:]
    size = dict(zip(split.kernel, shape, strict=True))
    s, n, kk = (math.prod(size[c] for c in part) for part in (split.shared, split.kept, split.contracted))
    perm = tuple(range(lead)) + tuple(lead + p for p in split.perm)
    return np.transpose(kernel, perm).reshape(*kernel.shape[:lead], s, n, kk)


def _expand_ellipsis(x: str, y: str, ndim: int, used: str) -> tuple[str, str]:
    if "..." not in x:
        return x, y
    n = ndim - len(x.replace("...", ""))
    if n < 0:
        raise ValueError(f"the input has {ndim} axes, its subscripts {x!r} name more")
    free = [c for c in string.ascii_letters if c not in used][:n]
    e = "".join(free)
    return x.replace("...", e), y.replace("...", e)


def to_rows(x, xs: str, split: KernelSplit):
    """x (subscripts xs, no '...') as rows: transposed to (shared..., batch..., contracted...)
    with the contracted axes merged into one: [*shared, *batch, in]. Returns (rows, the
    batch letters, letter -> size)."""
    if x.ndim != len(xs):
        raise ValueError(f"the input has {x.ndim} axes, the subscripts {xs!r} name {len(xs)}")
    batch = "".join(c for c in xs if c not in split.kernel)
    order = split.shared + batch + split.contracted
    size = dict(zip(xs, x.shape, strict=True))
    xt = jnp.transpose(x, tuple(xs.index(c) for c in order))
    k = math.prod(size[c] for c in split.contracted)
    return xt.reshape(*(size[c] for c in split.shared + batch), k), batch, size


def einsum_subscripts(einsum_str: str, ndim: int, want: KernelSplit | None = None) -> tuple[str, str, KernelSplit]:
    """(x, y subscripts with '...' expanded for an ndim-axis input, the kernel split) of an
    nnx.Einsum call; ``want``: the split the kernel was stored with (a call-time
    einsum_str must split it the same way)."""
    x, k, y = parse_einsum(einsum_str)
    split = split_kernel(x, k, y)
    if want is not None and (split.shared, split.kept, split.contracted) != (want.shared, want.kept, want.contracted):
        raise ValueError(
            f"einsum_str {einsum_str!r} splits the kernel differently from the quantized one "
            f"(kept {want.kept!r}, contracted {want.contracted!r})"
        )
    xs, ys = _expand_ellipsis(x, y, ndim, x + k + y)
    return xs, ys, split


def linear_general_subscripts(axis, batch_axis, split: KernelSplit, ndim: int) -> tuple[str, str]:
    """(x, y subscripts) of an nnx.LinearGeneral call on an ndim-axis input: the
    contracted axes ``axis`` and the shared ``batch_axis`` take the kernel's (upper-case)
    letters; y is x without the contracted axes, then the kept ones."""
    axis = tuple(a % ndim for a in axis)
    letters = list(string.ascii_lowercase[:ndim])
    for ax, c in zip(axis, split.contracted, strict=True):
        letters[ax] = c
    for ax, c in zip((a % ndim for a in batch_axis), split.shared, strict=True):
        letters[ax] = c
    xs = "".join(letters)
    return xs, "".join(c for i, c in enumerate(xs) if i not in axis) + split.kept


class _Projection(nnx.Module):
    """The shared call: x -> rows [M, in] -> base -> rows [M, out] -> y, plus the bias."""

    base: Any  # Linear4bit / Linear8bit, or an nnx.LoRA over one
    split: KernelSplit
    kernel_shape: tuple[int, ...]
    param_dtype: Any
    bias: Any  # nnx.Param of the float layer's bias shape, or None

    def _project(self, x, xs: str, ys: str):
        """y for subscripts xs (no '...'), self.split.kernel -> ys."""
        sp = self.split
        rows, batch, size = to_rows(x, xs, sp)
        k = rows.shape[-1]
        if sp.shared:
            y2 = self._shared_matmul(rows.reshape(self.n_shared, -1, k))
        else:
            y2 = self.base(rows.reshape(-1, k))
        y = y2.reshape(*(size[c] for c in sp.shared), *(size[c] for c in batch), *self._kept_sizes)
        cur = sp.shared + batch + sp.kept
        return jnp.transpose(y, tuple(cur.index(c) for c in ys))

    @property
    def n_shared(self) -> int:
        """How many matrices the shared axes hold (1 without shared axes)."""
        size = dict(zip(self.split.kernel, self.kernel_shape, strict=True))
        return math.prod(size[c] for c in self.split.shared)

    @property
    def _kept_sizes(self) -> tuple[int, ...]:
        size = dict(zip(self.split.kernel, self.kernel_shape, strict=True))
        return tuple(size[c] for c in self.split.kept)

    def _shared_matmul(self, x3):
        """[S, M, in] -> [S, M, out]: the S stacked matrices, one per shared index."""
        base = self.base
        if not isinstance(base, (Linear4bit, Linear8bit)) or base.sharding is not None:
            raise ValueError(
                f"{type(self).__name__} with shared (batch) axes runs on an unsharded Linear4bit / Linear8bit "
                f"base, got {type(base).__name__}"
            )
        if isinstance(base, Linear4bit):
            return jax.vmap(base._matmul)(x3, base.weight.get_value(), base.quant_state.get_value())
        return jax.vmap(base._matmul)(x3, base.weight.get_value(), base.SCB.get_value())

    def _add_bias(self, y, bias_shape):
        if self.bias is None:
            return y
        return y + jnp.reshape(self.bias.get_value(), bias_shape).astype(y.dtype)

    @property
    def kernel(self) -> WeightShape:
        """The float layer's kernel as a shape and dtype (no float value):
        ``layer.kernel.shape`` answers as it did."""
        return WeightShape(self.kernel_shape, self.param_dtype, type(self).__name__, "kernel")

    @property
    def stack_shape(self) -> tuple[int, ...]:
        """The leading axes of a stacked layer (nnx.vmap / nnx.scan); () for one layer."""
        s = self.quantized.stack_shape
        return s[:-1] if self.split.shared else s

    @property
    def quantized(self) -> Linear4bit | Linear8bit:
        """The 2-D quantized layer (under an nnx.LoRA when add_lora wrapped it)."""
        base = self.base
        return base.base_module if isinstance(base, nnx.LoRA) else base  # type: ignore[return-value]

    # -- checkpoint entries: the 2-D layer's, under this layer's own prefix, and the bias

    def _state_entries(self) -> dict[str, np.ndarray]:
        if self.split.shared:
            raise ValueError(
                f"{type(self).__name__} with shared axes {self.split.shared!r} holds one matrix per index, "
                "which no single-matrix checkpoint entry stores; save nnx.state(model) instead"
            )
        out = self.quantized._state_entries()
        if self.bias is not None:
            out["bias"] = np.array(self.bias.get_value(), copy=True)
        return out

    def _plan_load(self, d: dict, prefix: str, errs: list[str], used: set[str]):
        if self.split.shared:
            errs.append(f"'{prefix}': {type(self).__name__} with shared axes has no single-matrix entries")
            return None
        plan = self.quantized._plan_load(d, prefix, errs, used)
        bias_apply = plan_bias(self, d, prefix, errs, used)
        if plan is None:
            return None

        def apply() -> None:
            plan()
            if bias_apply is not None:
                bias_apply()

        return apply


def stack_layers(layers: list, lead: tuple[int, ...]):
    """One layer whose Variables hold the given layers' values stacked along leading
    axes ``lead`` (as nnx.vmap creates them: the stack nnx.scan slices); the layers have
    one structure and one setting."""
    graphdef, *_ = nnx.split(layers[0])
    states = [nnx.split(layer)[1] for layer in layers]
    stacked = jax.tree.map(lambda *a: jnp.stack(a).reshape(*lead, *a[0].shape), *states)
    return nnx.merge(graphdef, stacked)


class QuantizedEinsum(_Projection):
    """nnx.Einsum with its kernel quantized (module docstring: the stored matrix)."""

    def __init__(self, einsum: nnx.Einsum, base, split: KernelSplit, bias):
        self.einsum_str = einsum.einsum_str
        self.kernel_shape = tuple(einsum.kernel_shape)
        self.bias_shape = einsum.bias_shape
        self.use_bias = einsum.bias is not None
        self.dtype = einsum.dtype
        self.param_dtype = einsum.param_dtype
        self.split = split
        self.base = base
        self.bias = nnx.Param(bias) if bias is not None else nnx.data(None)

    def __call__(self, inputs, einsum_str: str | None = None, out_sharding=None):
        eq = einsum_str if einsum_str is not None else self.einsum_str
        xs, ys, split = einsum_subscripts(eq, inputs.ndim, self.split)
        out = self._project(inputs, xs, ys)
        size = dict(zip(split.kernel, self.kernel_shape, strict=True))
        out = self._add_bias(out, [size.get(c, 1) for c in ys])
        return out_sharded(out, out_sharding)


class QuantizedLinearGeneral(_Projection):
    """nnx.LinearGeneral with its kernel quantized (module docstring: the stored matrix)."""

    def __init__(self, lg: nnx.LinearGeneral, base, split: KernelSplit, bias):
        self.in_features = lg.in_features
        self.out_features = lg.out_features
        self.axis = lg.axis
        self.batch_axis = lg.batch_axis
        self.use_bias = lg.use_bias
        self.dtype = lg.dtype
        self.param_dtype = lg.param_dtype
        self.kernel_shape = (*lg.batch_axis.values(), *lg.in_features, *lg.out_features)
        self.split = split
        self.base = base
        self.bias = nnx.Param(bias) if bias is not None else nnx.data(None)

    def __call__(self, inputs, out_sharding=None):
        ndim = inputs.ndim
        xs, ys = linear_general_subscripts(self.axis, self.batch_axis, self.split, ndim)
        out = self._project(inputs, xs, ys)
        axis = {a % ndim for a in self.axis}
        batch_axis = {a % ndim for a in self.batch_axis}
        expanded = tuple(inputs.shape[a] if a in batch_axis else 1 for a in range(ndim) if a not in axis)
        out = self._add_bias(out, (*expanded, *self.out_features))
        return out_sharded(out, out_sharding)


def linear_general_split(lg: nnx.LinearGeneral) -> KernelSplit:
    """The kernel letters of a LinearGeneral: (batch..., in..., out...) -> shared, contracted, kept.
    Letters are upper case, so they never clash with the call's lower-case input axes."""
    nb, ni, no = len(lg.batch_axis), len(lg.in_features), len(lg.out_features)
    letters = string.ascii_uppercase[: nb + ni + no]
    if nb + ni + no > 26:
        raise Unsupported(f"{nb + ni + no} kernel axes")
    return KernelSplit(letters, letters[:nb], letters[nb + ni :], letters[nb : nb + ni])
