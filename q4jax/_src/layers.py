"""flax.nnx layers on the shared kernels: Linear4bit and Linear8bit, with their
own checkpoint entries (model-level quantize_model in model.py, shard_model in
model_sharding.py, state_dict / load_state_dict in checkpoint.py).

Layout follows PyTorch / bitsandbytes: the quantized matrix is
W [out_features, in_features] (nnx.Linear's kernel [in, out] transposed), so a
Linear4bit holds the same packed bytes, absmax and nested statistics as
q4torch's Linear4bit for the same weight, and a Linear8bit the same int8 CB /
fp32 SCB as q4torch's Linear8bitLt (weight rounded to fp16 before quantizing,
as bitsandbytes does).

Quantization state lives in QuantStateVar (not nnx.Param): ``nnx.grad`` and
optax see only the trainable parameters (bias, adapters), and
``nnx.split(model, QuantStateVar, ...)`` separates the frozen state.

Copying: every array lives in a Variable, so ``nnx.clone`` / ``copy.deepcopy``
copy it through the graph's memo (shared state stays shared inside the copy and
nothing points back at the original). Reload: ``load_state_dict`` validates
everything before changing anything, copies the caller's arrays, and replaces
each layer's state wholesale; jax arrays are immutable, so no cache can go
stale.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from q4._src import formats, pages
from q4._src.quant_state import QuantState as NpQuantState
from q4._src.schema import FLOAT_DTYPES, int8_entries, plan_4bit_load, plan_int8_load, quant4_entries
from q4jax._src import ffi
from q4jax._src.matmul import matmul_4bit, matmul_8bit
from q4jax._src.quant import QuantState, quantize_4bit, quantize_int8_weight
from q4jax._src.sharding import (
    LinearSharding,
    check_4bit,
    place_bias,
    shard_4bit,
    shard_8bit,
    sharded_matmul_4bit,
    sharded_matmul_8bit,
    unshard_4bit,
    unshard_8bit,
)

logger = logging.getLogger("q4jax")

# nnx.Linear's defaults
_DEFAULT_KERNEL_INIT = nnx.initializers.lecun_normal()
_DEFAULT_BIAS_INIT = nnx.initializers.zeros_init()


class QuantStateVar(nnx.Variable):
    """Frozen quantization state: packed 4-bit bytes, a q4jax.QuantState
    (absmax / nested statistics), int8 CB and fp32 SCB. Not an nnx.Param, so it
    is never differentiated or updated by an optimizer."""


def _float_dtype_name(dtype, what: str) -> str:
    try:
        name = ffi.dtype_name(dtype)
    except (TypeError, ValueError) as e:
        raise TypeError(f"{what} must be float32, float16 or bfloat16, got {dtype}") from e
    return name


def _features(value, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value <= 0:
        raise ValueError(f"{what} must be a positive int, got {value!r}")
    return int(value)


def _host_copy(a, dtype=None) -> np.ndarray:
    """A numpy copy the caller cannot reach (jnp.asarray may alias numpy memory on CPU).
    Where ``a`` is a view of a mapped file (``load_checkpoint(mapped=True)``), its pages
    go back to the system once copied (q4/_src/pages.py), so a load never holds the
    file's pages and the arrays at once."""
    out = np.array(a, dtype=dtype, copy=True)
    if isinstance(a, np.ndarray) and pages.is_mapped(a):
        pages.release_pages(a)
        pages.trim()
    return out


def _device_copy(a, dtype=None) -> jax.Array:
    """A jax array of ``a``'s values that never aliases ``a`` (a fresh host copy, which the
    array may take over)."""
    return jnp.asarray(_host_copy(a, dtype))


def device_4bit(packed: np.ndarray, st: NpQuantState) -> tuple[jax.Array, QuantState]:
    """Device copies of validated packed bytes and their state (the caller's
    arrays are never aliased)."""
    st = NpQuantState(
        st.quant_type,
        st.blocksize,
        st.shape,
        st.dtype,
        _host_copy(st.absmax),
        None if st.nested_absmax is None else _host_copy(st.nested_absmax),
        st.nested_offset,
        st.nested_blocksize,
    )
    return _device_copy(packed), QuantState.from_numpy(st)


def out_sharded(y: jax.Array, out_sharding) -> jax.Array:
    """y laid out as ``out_sharding`` asks (the float layers' call keyword: a
    PartitionSpec or NamedSharding under an explicit-axes mesh); None leaves it."""
    return y if out_sharding is None else jax.sharding.reshard(y, out_sharding)


def concrete(value):
    """A Variable's value; an abstract one (a model built under nnx.eval_shape, to be
    filled from a checkpoint) as zeros of its shape and dtype: a placeholder the load
    replaces, so loading never materialises a randomly initialised float model."""
    return jnp.zeros(value.shape, value.dtype) if isinstance(value, jax.ShapeDtypeStruct) else value


def _from_linear_args(linear: nnx.Linear) -> dict:
    """Constructor arguments that rebuild `linear`'s shape, dtypes, kernel and bias."""
    if not isinstance(linear, nnx.Linear):
        raise TypeError(f"from_linear expects an nnx.Linear, got {type(linear).__name__}")
    kernel = concrete(linear.kernel.get_value())
    bias = None if linear.bias is None else concrete(linear.bias.get_value())
    return dict(
        in_features=linear.in_features,
        out_features=linear.out_features,
        use_bias=bias is not None,
        dtype=linear.dtype,
        param_dtype=kernel.dtype,
        kernel_init=lambda key, shape, dtype: kernel,
        bias_init=lambda key, shape, dtype: bias,
    )


class _QuantLinear(nnx.Module):
    """Shared constructor logic: initialise a float kernel like nnx.Linear."""

    weight: QuantStateVar

    def _init_common(self, in_features, out_features, use_bias, dtype, param_dtype, kernel_init, bias_init, rngs):
        self.in_features = _features(in_features, "in_features")
        self.out_features = _features(out_features, "out_features")
        self.use_bias = bool(use_bias)
        self.dtype = None if dtype is None else jnp.dtype(dtype)
        if self.dtype is not None:
            _float_dtype_name(self.dtype, "dtype")
        _float_dtype_name(param_dtype, "param_dtype")
        if not isinstance(rngs, nnx.Rngs):
            raise TypeError(f"rngs must be an nnx.Rngs, got {type(rngs).__name__}")
        kernel = kernel_init(rngs.params(), (self.in_features, self.out_features), param_dtype)
        if tuple(kernel.shape) != (self.in_features, self.out_features):
            raise ValueError(
                f"kernel_init returned shape {tuple(kernel.shape)}, expected {(self.in_features, self.out_features)}"
            )
        bias = bias_init(rngs.params(), (self.out_features,), param_dtype) if self.use_bias else None
        self.bias = nnx.Param(bias) if bias is not None else nnx.data(None)
        self.sharding: LinearSharding | None = None
        return kernel

    @property
    def stack_shape(self) -> tuple[int, ...]:
        """The leading axes of a stacked layer (nnx.vmap, or quantize_model of such a
        stack: nnx.scan slices them off); () for a single layer."""
        return tuple(self.weight.get_value().shape[:-2])

    @property
    def kernel(self) -> WeightShape:
        """nnx.Linear's kernel [in, out] as a shape and dtype (no float value)."""
        dtype = self.bias.get_value().dtype if self.bias is not None else (self.dtype or jnp.float32)
        return WeightShape((self.in_features, self.out_features), dtype, type(self).__name__, "kernel")

    def _place_bias(self, sharding: LinearSharding | None) -> None:
        """Place the bias for ``sharding`` (None: on one device); a no-op for an
        unsharded layer staying unsharded."""
        if self.bias is not None and (sharding is not None or self.sharding is not None):
            self.bias.set_value(place_bias(self.bias.get_value(), sharding))

    def _check_x(self, x) -> str:
        if not hasattr(x, "dtype") or not hasattr(x, "shape"):
            raise TypeError(f"input must be an array, got {type(x).__name__}")
        name = _float_dtype_name(x.dtype, "input dtype")
        if x.ndim < 1 or x.shape[-1] != self.in_features:
            raise ValueError(
                f"input has {x.shape[-1] if x.ndim else 0} features (shape {tuple(x.shape)}), "
                f"this layer expects in_features={self.in_features}"
            )
        return name


class Linear4bit(_QuantLinear):
    """A linear layer with a 4-bit (NF4 / FP4) weight, y = x . W^T + b.

    W [out_features, in_features] is quantized blockwise (``blocksize``,
    optionally nested absmax with ``compress_statistics``); the packed bytes
    equal q4torch's / bitsandbytes' for the same W. The forward runs the fused
    kernel (``q4jax.matmul_4bit``) in ``compute_dtype`` (default: ``dtype``, else
    the input's dtype) and returns ``dtype`` (default: the input's dtype);
    gradients flow to the input and the bias, never to the quantized weight.

    ``shard(LinearSharding)`` (or ``shard_model``) lays the weight out over a
    device mesh and places it; the forward then runs
    ``q4jax.sharded_matmul_4bit``. ``state_dict`` always saves the canonical
    single-device format.

    ``activation_quant='int8'`` (a runtime setting, not saved in checkpoints)
    opts in to W4A8 (README "W4A8"), bit for bit q4torch's; not with a sharded
    weight.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        use_bias: bool = True,
        dtype=None,
        param_dtype=jnp.float32,
        kernel_init: Callable = _DEFAULT_KERNEL_INIT,
        bias_init: Callable = _DEFAULT_BIAS_INIT,
        quant_type: str = "nf4",
        blocksize: int = 64,
        compress_statistics: bool = True,
        compute_dtype=None,
        activation_quant: str | None = None,
        rngs: nnx.Rngs,
    ):
        formats.check_quant_type(quant_type)
        self.quant_type = quant_type
        self.blocksize = formats.check_blocksize(blocksize)
        self.activation_quant = formats.check_activation_quant(activation_quant)
        if activation_quant is not None:
            formats.check_w4a8_features(in_features, self.blocksize)
        self.compress_statistics = bool(compress_statistics)
        self.compute_dtype = None if compute_dtype is None else jnp.dtype(compute_dtype)
        if self.compute_dtype is not None:
            _float_dtype_name(self.compute_dtype, "compute_dtype")
        kernel = self._init_common(
            in_features, out_features, use_bias, dtype, param_dtype, kernel_init, bias_init, rngs
        )
        self.weight = QuantStateVar(jnp.zeros((0, 1), jnp.uint8))
        self.quant_state = QuantStateVar(None)
        self.set_weight(jnp.asarray(kernel).T)

    def set_weight(self, weight) -> Linear4bit:
        """Quantize a float W [out_features, in_features] with this layer's
        settings and replace the packed bytes and state (in place, wholesale)."""
        weight = jnp.asarray(weight)
        _float_dtype_name(weight.dtype, "weight dtype")
        if tuple(weight.shape) != (self.out_features, self.in_features):
            raise ValueError(
                f"weight must have shape (out_features, in_features) = {(self.out_features, self.in_features)}, "
                f"got {tuple(weight.shape)}"
            )
        packed, state = quantize_4bit(weight, self.blocksize, self.quant_type, self.compress_statistics)
        if self.sharding is not None:
            packed, state = shard_4bit(packed, state, self.sharding)
        self.weight.set_value(packed)
        self.quant_state.set_value(state)
        return self

    def shard(self, sharding: LinearSharding | None) -> Linear4bit:
        """Lay this layer's packed weight, statistics and bias out for
        ``sharding`` and place them on its mesh (None: back to the canonical
        layout on one device). Validates before changing anything (ValueError
        naming the value that cannot be split). A nested state decoded by
        ``unnest`` stays decoded (and is saved so by ``state_dict``)."""
        if sharding is not None and not isinstance(sharding, LinearSharding):
            raise TypeError(f"sharding must be a q4jax.LinearSharding or None, got {type(sharding).__name__}")
        if sharding is not None and getattr(self, "activation_quant", None) is not None:
            raise ValueError(
                "a W4A8 layer (activation_quant='int8') cannot be sharded; set activation_quant=None first"
            )
        packed, state = self._canonical()
        if sharding is not None:
            packed, state = shard_4bit(packed, state, sharding)
        self._place_bias(sharding)
        self.weight.set_value(packed)
        self.quant_state.set_value(state)
        self.sharding = sharding
        return self

    def _canonical(self) -> tuple[jax.Array, QuantState]:
        packed, state = self.weight.get_value(), self.quant_state.get_value()
        return (packed, state) if self.sharding is None else unshard_4bit(packed, state)

    @classmethod
    def from_linear(
        cls,
        linear: nnx.Linear,
        *,
        quant_type: str = "nf4",
        blocksize: int = 64,
        compress_statistics: bool = True,
        compute_dtype=None,
        activation_quant: str | None = None,
    ) -> Linear4bit:
        """Quantize an nnx.Linear (its kernel [in, out] becomes W = kernel.T);
        the bias is copied as a new nnx.Param. The Linear is not modified."""
        return cls(
            **_from_linear_args(linear),
            quant_type=quant_type,
            blocksize=blocksize,
            compress_statistics=compress_statistics,
            compute_dtype=compute_dtype,
            activation_quant=activation_quant,
            rngs=nnx.Rngs(0),
        )

    def __call__(self, x: jax.Array, out_sharding=None) -> jax.Array:
        """x [..., in_features] -> [..., out_features]; ``out_sharding`` as nnx.Linear's."""
        packed, state = self.weight.get_value(), self.quant_state.get_value()
        return out_sharded(self._matmul(x, packed, state, self.bias is not None, self.sharding), out_sharding)

    def _matmul(self, x, packed, state: QuantState, with_bias: bool = False, sharding=None) -> jax.Array:
        """x . dequantize(W)^T (+ the bias) for the weight (packed, state): the layer's
        call, and (no bias, unsharded) that of one slice of a stacked layer
        (q4jax/_src/projection.py, shared axes). Computed in ``compute_dtype`` (default:
        ``dtype``, else x's), returned in ``dtype`` (default: x's)."""
        x_name = self._check_x(x)
        out = jnp.dtype(x_name) if self.dtype is None else self.dtype
        compute = out if self.compute_dtype is None else self.compute_dtype
        # the bias is cast on a copy: the parameter keeps its dtype
        bias = self.bias.get_value().astype(compute) if with_bias else None
        if sharding is None:
            y = matmul_4bit(x.astype(compute), packed, state, bias, getattr(self, "activation_quant", None))
        else:
            y = sharded_matmul_4bit(x.astype(compute), packed, state, sharding, bias)
        return y.astype(out)

    # -- checkpoint entries (keys relative to the layer's prefix)

    def _state_entries(self) -> dict[str, np.ndarray]:
        packed, state = self._canonical()
        out = {"weight": _host_copy(packed)}
        if self.bias is not None:
            out["bias"] = _host_copy(self.bias.get_value())
        out.update(quant4_entries(out["weight"], {k: _host_copy(v) for k, v in state.to_numpy().to_dict().items()}))
        return out

    def _plan_load(self, d: dict, prefix: str, errs: list[str], used: set[str]) -> Callable[[], None] | None:
        bias_apply = plan_bias(self, d, prefix, errs, used)

        def sharded(st: NpQuantState) -> None:
            if self.sharding is not None:
                try:
                    check_4bit(self.sharding, st.shape, st.blocksize, st.nested)
                except ValueError as e:
                    raise ValueError(f"cannot be loaded into this sharded layer: {e}") from e

        found = plan_4bit_load(d, prefix, (self.out_features, self.in_features), errs, used, check_state=sharded)
        if found is None:
            return None
        data, st = found
        if st is None:  # a float checkpoint: quantize it with this layer's settings
            w = _device_copy(data)

            def apply_float() -> None:
                self.set_weight(w)
                if bias_apply:
                    bias_apply()
                self._place_bias(self.sharding)

            return apply_float
        packed_dev, state = device_4bit(data, st)

        def apply():
            self._install(packed_dev, state)
            if bias_apply:
                bias_apply()
            self._place_bias(self.sharding)

        return apply

    def _install(self, packed: jax.Array, state: QuantState) -> None:
        self.quant_type, self.blocksize = state.quant_type, state.blocksize
        self.compress_statistics = state.nested_absmax is not None
        p, s = (packed, state) if self.sharding is None else shard_4bit(packed, state, self.sharding)
        self.weight.set_value(p)
        self.quant_state.set_value(s)

    def set_quantized(self, packed: np.ndarray, state: NpQuantState) -> Linear4bit:
        """Take already-quantized bytes and state (q4's error-minimising
        quantizers, README "Better 4-bit at the same bytes"), validated
        against this layer's shape; replaces the weight wholesale."""
        st = state.validate()
        if tuple(st.shape) != (self.out_features, self.in_features):
            raise ValueError(
                f"quantized weight shape {tuple(st.shape)} does not match this layer's "
                f"{(self.out_features, self.in_features)}"
            )
        packed = np.ascontiguousarray(packed).view(np.uint8).reshape(-1, 1)
        if packed.shape[0] != formats.packed_bytes(st.numel):
            raise ValueError(f"{packed.shape[0]} packed bytes for shape {tuple(st.shape)}")
        self._install(*device_4bit(packed, st))
        return self


class Linear8bit(_QuantLinear):
    """LLM.int8 linear layer: y ~= x . (CB * SCB[:, None] / 127)^T + b.

    CB int8 [out_features, in_features] and SCB fp32 [out_features] equal
    q4torch's Linear8bitLt / bitsandbytes' for the same weight (W rounded to
    fp16, then row-wise absmax quantization). The input is quantized row-wise
    inside the fused kernel; with ``threshold`` > 0 input columns holding any
    |x| >= threshold are computed in fp32. Output in ``dtype`` (default the
    input's); gradients flow to the input and the bias.

    The weight is quantized through the int8_quantize_rows custom call, so the
    layer can be built inside ``jit`` too.

    ``shard(LinearSharding)`` (or ``shard_model``) lays CB / SCB out over a
    device mesh; the forward then runs ``q4jax.sharded_matmul_8bit`` (the same
    row statistics and outlier columns as on one device). ``state_dict``
    always saves the canonical format.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        use_bias: bool = True,
        dtype=None,
        param_dtype=jnp.float32,
        kernel_init: Callable = _DEFAULT_KERNEL_INIT,
        bias_init: Callable = _DEFAULT_BIAS_INIT,
        threshold: float = 0.0,
        rngs: nnx.Rngs,
    ):
        formats.check_threshold(threshold)
        self.threshold = float(threshold)
        kernel = self._init_common(
            in_features, out_features, use_bias, dtype, param_dtype, kernel_init, bias_init, rngs
        )
        self.weight = QuantStateVar(jnp.zeros((0, 0), jnp.int8))
        self.SCB = QuantStateVar(jnp.zeros((0,), jnp.float32))
        self.set_weight(jnp.asarray(kernel).T)

    def set_weight(self, weight) -> Linear8bit:
        """Quantize a float W [out_features, in_features] (rounded to fp16 first,
        as bitsandbytes does) through the kernels' XLA op, so it also works
        under jit, and replace CB / SCB wholesale."""
        w = weight if isinstance(weight, jax.Array) else jnp.asarray(np.asarray(weight))
        _float_dtype_name(w.dtype, "weight dtype")
        if w.shape != (self.out_features, self.in_features):
            raise ValueError(
                f"weight must have shape (out_features, in_features) = {(self.out_features, self.in_features)}, "
                f"got {w.shape}"
            )
        cb, scb = quantize_int8_weight(w)
        if self.sharding is not None:
            cb, scb = shard_8bit(cb, scb, self.sharding)
        self.weight.set_value(cb)
        self.SCB.set_value(scb)
        return self

    def shard(self, sharding: LinearSharding | None) -> Linear8bit:
        """Lay CB, SCB and the bias out for ``sharding`` and place them on its
        mesh (None: back to the canonical layout on one device). Validates
        before changing anything."""
        if sharding is not None and not isinstance(sharding, LinearSharding):
            raise TypeError(f"sharding must be a q4jax.LinearSharding or None, got {type(sharding).__name__}")
        cb, scb = self._canonical()
        if sharding is not None:
            cb, scb = shard_8bit(cb, scb, sharding)
        self._place_bias(sharding)
        self.weight.set_value(cb)
        self.SCB.set_value(scb)
        self.sharding = sharding
        return self

    def _canonical(self) -> tuple[jax.Array, jax.Array]:
        cb, scb = self.weight.get_value(), self.SCB.get_value()
        return (cb, scb) if self.sharding is None else unshard_8bit(cb, scb, self.sharding)

    @classmethod
    def from_linear(cls, linear: nnx.Linear, *, threshold: float = 0.0) -> Linear8bit:
        """Quantize an nnx.Linear (W = kernel.T); the Linear is not modified."""
        return cls(
            **_from_linear_args(linear),
            threshold=threshold,
            rngs=nnx.Rngs(0),
        )

    def __call__(self, x: jax.Array, out_sharding=None) -> jax.Array:
        """x [..., in_features] -> [..., out_features]; ``out_sharding`` as nnx.Linear's."""
        cb, scb = self.weight.get_value(), self.SCB.get_value()
        return out_sharded(self._matmul(x, cb, scb, self.bias is not None, self.sharding), out_sharding)

    def _matmul(self, x, cb, scb, with_bias: bool = False, sharding=None) -> jax.Array:
        """x . (CB * SCB / 127)^T (+ the bias) in ``dtype`` (default: x's): the layer's
        call, and (no bias, unsharded) that of one slice of a stacked layer."""
        x_name = self._check_x(x)
        compute = jnp.dtype(x_name) if self.dtype is None else self.dtype
        bias = self.bias.get_value() if with_bias else None
        if sharding is None:
            return matmul_8bit(x.astype(compute), cb, scb, bias, self.threshold)
        return sharded_matmul_8bit(x.astype(compute), cb, scb, sharding, bias, self.threshold)

    def _state_entries(self) -> dict[str, np.ndarray]:
        cb, scb = self._canonical()
        out = {"weight": _host_copy(cb)}
        if self.bias is not None:
            out["bias"] = _host_copy(self.bias.get_value())
        out.update(int8_entries(out["weight"], _host_copy(scb)))
        return out

    def _plan_load(self, d: dict, prefix: str, errs: list[str], used: set[str]) -> Callable[[], None] | None:
        bias_apply = plan_bias(self, d, prefix, errs, used)
        found = plan_int8_load(d, prefix, (self.out_features, self.in_features), "the layer", errs, used)
        if found is None:
            return None
        w, scb = found
        if scb is not None:
            cb_dev, scb_dev = _device_copy(w), _device_copy(scb, np.float32)

            def apply():
                c, s = (cb_dev, scb_dev) if self.sharding is None else shard_8bit(cb_dev, scb_dev, self.sharding)
                self.weight.set_value(c)
                self.SCB.set_value(s)
                if bias_apply:
                    bias_apply()
                self._place_bias(self.sharding)

            return apply
        w_host = _host_copy(w)

        def apply_float() -> None:
            self.set_weight(w_host)
            if bias_apply:
                bias_apply()
            self._place_bias(self.sharding)

        return apply_float


def plan_bias(layer, d: dict, prefix: str, errs: list[str], used: set[str]):
    k_b = prefix + "bias"
    if layer.bias is None:
        return None
    if k_b not in d:
        errs.append(f"missing key '{k_b}'")
        return None
    used.add(k_b)
    b = np.asarray(d[k_b])
    want = tuple(layer.bias.get_value().shape)  # (out_features,); a projection's bias keeps its own shape
    if b.shape != want or b.dtype.kind != "f" and b.dtype.name != "bfloat16":
        errs.append(f"'{k_b}' must be a float array of shape {want}, got {b.dtype} {b.shape}")
        return None
    new = _device_copy(b, layer.bias.get_value().dtype)  # the parameter keeps its dtype
    return lambda: layer.bias.set_value(new)


def plan_dense_load(layer: nnx.Linear, d: dict, prefix: str, errs: list[str], used: set[str]):
    """A dense nnx.Linear under the torch key convention: weight = kernel.T."""
    k_w = prefix + "weight"
    bias_apply = plan_bias(layer, d, prefix, errs, used)
    if k_w not in d:
        errs.append(f"missing key '{k_w}'")
        return None
    used.add(k_w)
    w = np.asarray(d[k_w])
    shape = (layer.out_features, layer.in_features)
    if w.shape != shape or w.dtype.name not in FLOAT_DTYPES:
        errs.append(f"'{k_w}' must be a float array of shape {shape}, got {w.dtype} {w.shape}")
        return None
    kernel = _device_copy(w.T, layer.kernel.get_value().dtype)
    return lambda: (layer.kernel.set_value(kernel), bias_apply and bias_apply())


def dense_entries(layer: nnx.Linear) -> dict[str, np.ndarray]:
    out = {"weight": _host_copy(np.asarray(layer.kernel.get_value()).T)}
    if layer.bias is not None:
        out["bias"] = _host_copy(layer.bias.get_value())
    return out


class WeightShape:
    """What a quantized layer shows as its float layer's ``kernel`` / ``embedding``:
    the shape and dtype model code queries (``layer.kernel.shape[1]``), without a float
    array: reading its value is an error that says how to get one."""

    def __init__(self, shape: tuple[int, ...], dtype, owner: str, name: str):
        self.shape, self.dtype, self._owner, self._name = tuple(shape), jnp.dtype(dtype), owner, name

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        return int(np.prod(self.shape))

    def _no_value(self, *_args, **_kwargs):
        raise AttributeError(
            f"{self._owner}.{self._name} is quantized: it has a shape {self.shape} and dtype {self.dtype}, "
            "no float value (q4jax.dequantize_4bit of the layer's weight and quant_state gives one)"
        )

    value = property(_no_value)
    get_value = __getitem__ = __array__ = _no_value

    def __repr__(self) -> str:
        return f"WeightShape({self.shape}, {self.dtype})"
