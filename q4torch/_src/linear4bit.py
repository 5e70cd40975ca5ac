"""4-bit layers with bitsandbytes' names, constructor arguments and checkpoint
keys: Params4bit, Linear4bit, LinearNF4, LinearFP4.

Differences from bitsandbytes 0.50.2, all deliberate fixes:
- copying: ``copy.deepcopy`` of a layer gives an independent layer (its
  weight's ``module`` is the copy; nothing points back at the original, and
  quantizing the copy never touches the original);
- reload: ``load_state_dict`` restores a quantized checkpoint (strict or not),
  before or after the first forward, without mutating the caller's tensors;
- a forward never changes a parameter's dtype (the bias is cast on a copy);
- the backward uses the packed weight saved by the forward
  (``save_for_backward``), so recompute under activation checkpointing with
  streamed weights is correct;
- under FSDP2 (``torch.distributed.fsdp.fully_shard``), which replaces the
  weight by a DTensor and then by a plain all-gathered parameter, the layer
  keeps the complete QuantState (``module.quant_state``), attaches it to
  whatever parameter FSDP installs, and checks that the bytes it receives are
  the packed bytes in their storage dtype (a float cast of packed bytes is
  refused, never computed with). See ``q4torch.fully_shard``.
"""

from __future__ import annotations

import copy
import sys
from typing import Any, cast

import torch
from torch import nn

import q4
from q4._src import formats, schema
from q4._src.quant_state import JSON_KEY_PREFIX
from q4torch import functional as F
from q4torch._src import eager
from q4torch._src.torch_internals import make_subclass, parse_to

_QUANT_KEYS = ("absmax", "quant_map", "nested_absmax", "nested_quant_map")


class Params4bit(nn.Parameter):
    """A weight that is quantized to 4 bits on its first move to a device
    (``.to(device)``, ``.cpu()``, ``.cuda()``), or explicitly with
    :meth:`quantize`. Before that it holds the float weight; after, the packed
    bytes ``(ceil(n*k/2), 1)`` viewed as ``quant_storage``, with ``quant_state``.
    """

    blocksize: int
    compress_statistics: bool
    quant_type: str
    quant_state: F.QuantState | None
    quant_storage: torch.dtype
    bnb_quantized: bool
    module: Linear4bit | None

    def __new__(
        cls,
        data: torch.Tensor | None = None,
        requires_grad: bool = False,
        quant_state: F.QuantState | None = None,
        blocksize: int | None = None,
        compress_statistics: bool = True,
        quant_type: str = "fp4",
        quant_storage: torch.dtype = torch.uint8,
        module: Linear4bit | None = None,
        bnb_quantized: bool = False,
        **kwargs: Any,
    ) -> Params4bit:
        if data is None:
            data = torch.empty(0)
        self = make_subclass(cls, data, requires_grad)
        self.blocksize = q4.check_blocksize(64 if blocksize is None else blocksize)
        self.compress_statistics = compress_statistics
        formats.check_quant_type(quant_type)
        self.quant_type = quant_type
        self.quant_state = quant_state
        self.quant_storage = F.check_quant_storage(quant_storage)
        self.bnb_quantized = bnb_quantized
        self.module = module
        return self

    # -- state proxies (FSDP's state-dict traversal resolves "weight.absmax" by getattr)

    def _qs(self, name: str, nested: bool = False):
        qs = self.__dict__.get("quant_state")
        if qs is None or (nested and qs.state2 is None):
            raise AttributeError(f"'{type(self).__name__}' object has no attribute '{name}'")
        return qs

    absmax = property(lambda self: self._qs("absmax").absmax)
    code = property(lambda self: self._qs("code").code)
    quant_map = property(lambda self: self._qs("quant_map").code)
    offset = property(lambda self: self._qs("offset").offset)
    state2 = property(lambda self: self._qs("state2").state2)
    nested_absmax = property(lambda self: self._qs("nested_absmax", True).state2.absmax)
    nested_blocksize = property(lambda self: self._qs("nested_blocksize", True).state2.blocksize)
    nested_quant_map = property(lambda self: self._qs("nested_quant_map", True).state2.code)
    nested_dtype = property(lambda self: self._qs("nested_dtype", True).state2.dtype)
    nested_offset = property(lambda self: self._qs("nested_offset").offset)

    # -- copying and pickling

    def __getstate__(self):
        state = self.__dict__.copy()
        state["data"] = self.data
        state["requires_grad"] = self.requires_grad
        return state

    def __setstate__(self, state):
        self.requires_grad = state["requires_grad"]
        for key in ("blocksize", "compress_statistics", "quant_type", "quant_state", "quant_storage", "bnb_quantized"):
            setattr(self, key, state[key])
        self.data = state["data"]
        self.module = state.get("module")

    def __reduce_ex__(self, protocol):
        return (_rebuild_params4bit, (self.__getstate__(),))

    def __deepcopy__(self, memo):
        # Everything is deep-copied through `memo`, so a quant_state shared
        # with the owning module stays shared inside the copy, and `module`
        # points at the module's copy when the module is being copied (and at
        # nothing otherwise): the copy never reaches back into the original.
        if id(self) in memo:
            return memo[id(self)]
        new = type(self).__new__(type(self), self.data.clone(), self.requires_grad)
        memo[id(self)] = new
        for key in ("blocksize", "compress_statistics", "quant_type", "quant_storage", "bnb_quantized"):
            setattr(new, key, getattr(self, key))
        new.quant_state = copy.deepcopy(self.quant_state, memo)
        new.module = memo.get(id(self.module)) if self.module is not None else None
        return new

    def __copy__(self):
        new = type(self).__new__(type(self), self.data, self.requires_grad)
        new.__setstate__(self.__getstate__())
        return new

    # -- construction from a checkpoint

    @classmethod
    def from_prequantized(
        cls,
        data: torch.Tensor,
        quantized_stats: dict[str, Any],
        requires_grad: bool = False,
        device="cuda",
        module: Linear4bit | None = None,
        **kwargs: Any,
    ) -> Params4bit:
        """A quantized weight from checkpoint entries (bitsandbytes keys, with or
        without the ``weight.`` prefix). Every entry is validated; the caller's
        tensors are copied, never aliased."""
        quant_state = F.QuantState.from_dict(dict(quantized_stats), device=device)
        check_packed(data, quant_state, "weight")
        self = cls(
            data.detach().to(device, copy=True),
            requires_grad=requires_grad,
            quant_state=quant_state,
            blocksize=quant_state.blocksize,
            compress_statistics=quant_state.nested,
            quant_type=quant_state.quant_type,
            quant_storage=data.dtype,
            module=module,
            bnb_quantized=True,
        )
        if module is not None:
            module.quant_state = quant_state
            module.quant_storage = data.dtype
        return self

    # -- quantization

    def _quantize(self, device) -> Params4bit:
        w = self.data.contiguous().to(device)
        if not w.is_floating_point() or w.dim() != 2:
            raise ValueError(
                f"Params4bit can only quantize a 2-D float weight, got {w.dtype} with shape {tuple(w.shape)}"
            )
        packed, quant_state = F.quantize_4bit(
            w,
            blocksize=self.blocksize,
            compress_statistics=self.compress_statistics,
            quant_type=self.quant_type,
            quant_storage=self.quant_storage,
        )
        self.data = packed
        self.quant_state = quant_state
        if self.module is not None:
            self.module.quant_state = quant_state
            self.module.quant_storage = packed.dtype
        self.bnb_quantized = True
        return self

    def quantize(self) -> Params4bit:
        """Quantize in place on the weight's current device (no-op if quantized)."""
        return self if self.bnb_quantized else self._quantize(self.device)

    def cpu(self):
        return self.to(device="cpu")

    def cuda(self, device=None, non_blocking: bool = False):  # type: ignore[override]
        return self.to(device="cuda" if device is None else device, non_blocking=non_blocking)

    def to(self, *args, **kwargs):
        device, dtype, non_blocking, _ = parse_to(*args, **kwargs)
        if device is not None and device.type != "meta" and not self.bnb_quantized:
            return self._quantize(device)
        if self.quant_state is not None and device is not None:
            self.quant_state.to(device)
        # the packed bytes never change dtype: a dtype argument applies to float params only
        moved = super().to(device=device, dtype=None if self.bnb_quantized else dtype, non_blocking=non_blocking)
        return self.with_data(moved)

    def with_data(self, data: torch.Tensor, **changes: Any) -> Params4bit:
        """A Params4bit over `data` with this one's attributes (those named in
        `changes` replaced): the one place that lists them all."""
        attrs: dict[str, Any] = {
            "requires_grad": self.requires_grad,
            "quant_state": self.quant_state,
            "blocksize": self.blocksize,
            "compress_statistics": self.compress_statistics,
            "quant_type": self.quant_type,
            "quant_storage": self.quant_storage,
            "module": self.module,
            "bnb_quantized": self.bnb_quantized,
        }
        attrs.update(changes)
        return Params4bit(data, **attrs)

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        # torch.chunk / torch.split (FSDP sharding) keep the quantization attributes
        result = super().__torch_function__(func, types, args, kwargs or {})
        if func in (torch.chunk, torch.split):
            src = args[0]

            return tuple(src.with_data(t) for t in result) if isinstance(result, tuple) else src.with_data(result)
        return result


def _rebuild_params4bit(state):
    p = Params4bit.__new__(Params4bit, state["data"], state["requires_grad"])
    p.__setstate__(state)
    return p


def check_packed(data: torch.Tensor, quant_state: F.QuantState, key: str) -> None:
    """A packed weight's bytes (whatever its storage dtype, but bool) against its QuantState's shape."""
    if data.dtype not in F.QUANT_STORAGE_DTYPES:
        raise q4.QuantStateError(
            f"'{key}' is stored as {data.dtype}; packed 4-bit bytes must be one of "
            f"{', '.join(str(d) for d in F.QUANT_STORAGE_DTYPES)}"
            + (" (a copy of a bool tensor turns every non-zero byte into 1)" if data.dtype is torch.bool else "")
        )
    n = 1
    for s in quant_state.shape:
        n *= int(s)
    formats.check_packed_size(
        data.numel() * data.element_size(),
        n,
        f"'{key}'",
        f"its quant_state shape {tuple(quant_state.shape)}",
        q4.QuantStateError,
    )


def is_dtensor(t: Any) -> bool:
    """Whether t is a DTensor (without importing torch.distributed when nothing else has)."""
    tensor_mod = sys.modules.get("torch.distributed.tensor")
    return tensor_mod is not None and isinstance(t, tensor_mod.DTensor)


def load_all_but_weight(module_load, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, errs):
    """The standard load (module_load: nn.Module._load_from_state_dict) of
    everything but a quantized ``weight`` and its ``weight.*`` entries (bias,
    extra parameters); then (weight data, {entry: value}) or None when the
    weight is absent (recorded as missing, or an error if only its entries are
    there)."""
    weight_key = prefix + "weight"
    quant_keys = [k for k in state_dict if k.startswith(weight_key + ".")]
    rest = {k: v for k, v in state_dict.items() if k != weight_key and k not in quant_keys}
    module_load(rest, prefix, local_metadata, strict, missing_keys, unexpected_keys, errs)
    if weight_key in missing_keys:
        missing_keys.remove(weight_key)
    if weight_key not in state_dict:
        if quant_keys:
            errs.append(f"'{weight_key}' is missing but its quantization entries are present")
        else:
            missing_keys.append(weight_key)
        return None
    return state_dict[weight_key], {k[len(weight_key) + 1 :]: state_dict[k] for k in quant_keys}


# Per module class: whether its `weight` and `bias` attributes are the
# entries of _parameters (no class in the MRO defines either name, as a
# property for example).
_PLAIN_PARAMS: dict[type, bool] = {}


def weight_and_bias(module: nn.Module) -> tuple[Any, Any]:
    """(module.weight, module.bias), read from _parameters where those are the
    attributes: ``module.weight`` goes through nn.Module.__getattr__ (~0.55 us
    per name, after the failed normal lookup), which at batch 1 on a small
    layer is a tenth of the call."""
    cls = type(module)
    plain = _PLAIN_PARAMS.get(cls)
    if plain is None:
        plain = _PLAIN_PARAMS[cls] = not any(name in c.__dict__ for c in cls.__mro__ for name in ("weight", "bias"))
    params = module._parameters
    if plain and "weight" in params and "bias" in params:
        return params["weight"], params["bias"]
    return module.weight, module.bias


# ---------------------------------------------- FSDP2 (q4torch._src.fsdp builds on these)
# They need nothing of torch.distributed, so the layer calls them without importing it
# (fsdp.py imports this module, one way).


# Attributes a Params4bit resolves from its QuantState, set as plain attributes on a
# parameter that FSDP2 installs in its place (a DTensor shard or the all-gathered tensor),
# so that code reading ``layer.weight.quant_state`` and state-dict traversal by getattr
# (torch.distributed.checkpoint.state_dict resolves "weight.absmax") keep working.
_PROXIES = {
    "absmax": lambda qs: qs.absmax,
    "quant_map": lambda qs: qs.code,
    "nested_absmax": lambda qs: qs.state2.absmax if qs.nested else None,
    "nested_quant_map": lambda qs: qs.state2.code if qs.nested else None,
}


def attach_quant_state(param: torch.Tensor, quant_state: F.QuantState) -> None:
    """Let a parameter that is not a Params4bit carry the layer's QuantState
    (the same object: the layer's state stays the one source of truth)."""
    attrs = {
        "quant_state": quant_state,
        "quant_type": quant_state.quant_type,
        "blocksize": quant_state.blocksize,
        "compress_statistics": quant_state.nested,
        "quant_storage": param.dtype,
        "bnb_quantized": True,
    }
    for name, value in attrs.items():
        setattr(param, name, value)
    for name, get in _PROXIES.items():
        value = get(quant_state)
        if value is not None:
            setattr(param, name, value)
        else:
            param.__dict__.pop(name, None)


def load_sharded(layer: Linear4bit, weight_key: str, data: torch.Tensor, stats: dict[str, Any]) -> None:
    """Load a quantized checkpoint into a weight that FSDP2 has sharded (a DTensor).

    ``data`` must be a DTensor too (a state dict of a sharded model, as
    DCP loads it, or a whole checkpoint distributed by
    ``set_model_state_dict(..., options=StateDictOptions(full_state_dict=True))``),
    in the weight's storage dtype. FSDP keeps the parameter object, so the
    bytes are copied into its local shard in place (same dtype: bit for
    bit). The QuantState is not sharded: every rank rebuilds it whole.
    """
    weight = layer.weight
    if not any(k.startswith(JSON_KEY_PREFIX) for k in stats):
        raise ValueError(
            f"'{weight_key}' is sharded (FSDP) and the checkpoint has no '{weight_key}.{JSON_KEY_PREFIX}<nf4|fp4>' "
            "entry: a sharded weight cannot be quantized, load float weights before fully_shard"
        )
    if not is_dtensor(data):
        raise TypeError(
            f"'{weight_key}' is a plain {data.dtype} tensor but the layer's weight is sharded (a DTensor): load "
            "a whole checkpoint with torch.distributed.checkpoint.state_dict.set_model_state_dict(model, sd, "
            "options=StateDictOptions(full_state_dict=True))"
        )
    if data.dtype != weight.dtype:
        raise TypeError(
            f"'{weight_key}' is a {data.dtype} DTensor, but the sharded weight stores its bytes as {weight.dtype}"
        )
    quant_state = F.QuantState.from_dict(stats, device=weight.device)
    layer.check_state_shape(weight_key, quant_state)
    check_packed(data, quant_state, weight_key)
    with torch.no_grad():
        weight.copy_(data)
    layer.quant_state = quant_state
    layer.quant_storage = weight.dtype
    attach_quant_state(weight, quant_state)


def save_4bit_entries(destination: dict, prefix: str, quant_state: F.QuantState, keep_vars: bool) -> None:
    """A 4-bit weight's quantization entries (``{prefix}weight.absmax``, ...,
    its quant_state JSON) added to a state dict that holds its packed
    ``{prefix}weight``, through the checkpoint schema's writer (q4/_src/schema.py)."""
    entries = {k: v if keep_vars else v.detach() for k, v in quant_state.as_dict(packed=True).items()}
    destination.update(schema.quant4_entries(destination[prefix + "weight"], entries, prefix=prefix))


class Linear4bit(nn.Linear):
    """A linear layer with a 4-bit weight (NF4 or FP4, blockwise, optionally
    nested absmax), as bitsandbytes.nn.Linear4bit.

    Quantization happens on the first move to a device (``.to("cpu")``) or
    with :meth:`quantize`. The forward runs the fused kernel in the input's
    dtype (or ``compute_dtype`` when given) and returns the input's dtype;
    gradients flow to the input and the bias. ``activation_quant='int8'``
    (keyword-only, a runtime setting, not saved in checkpoints) opts in to
    W4A8: activations quantized to int8, integer dot products (README "W4A8").
    """

    quant_state: F.QuantState | None

    def __init__(
        self,
        input_features: int,
        output_features: int,
        bias: bool = True,
        compute_dtype: torch.dtype | None = None,
        compress_statistics: bool = True,
        quant_type: str = "fp4",
        quant_storage: torch.dtype = torch.uint8,
        device=None,
        *,
        activation_quant: str | None = None,
    ):
        super().__init__(input_features, output_features, bias, device)
        self.activation_quant = formats.check_activation_quant(activation_quant)
        self.weight = Params4bit(
            self.weight.data,
            requires_grad=False,
            compress_statistics=compress_statistics,
            quant_type=quant_type,
            quant_storage=quant_storage,
            module=self,
        )
        self.compute_dtype = compute_dtype
        self.quant_state = None
        self.quant_storage = quant_storage
        if activation_quant is not None:
            formats.check_w4a8_features(input_features, self.weight.blocksize)

    def quantize(self) -> Linear4bit:
        """Quantize the weight now, on its current device (no-op if quantized)."""
        if not isinstance(self.weight, Params4bit):
            raise TypeError(f"weight must be a Params4bit, got {type(self.weight).__name__}")
        self.weight.module = self
        self.weight.quantize()
        self.quant_state = self.weight.quant_state
        self.quant_storage = self.weight.dtype
        return self

    def packed_weight(self) -> tuple[torch.Tensor, F.QuantState]:
        """The packed weight the forward computes with, and its QuantState.

        A Params4bit carries its own state. Any other parameter (FSDP2 installs
        the all-gathered bytes as a plain tensor) is the packed weight only if
        its dtype is the layer's ``quant_storage`` and its size that of the
        packed bytes; the layer's ``quant_state`` describes it. A DTensor (a
        shard) or a cast copy is refused with the offending value in the error:
        viewing cast bytes as packed codes would compute with other weights.
        """
        weight = self.weight
        if isinstance(weight, Params4bit):
            quant_state = weight.quant_state or self.quant_state
            if not weight.bnb_quantized or quant_state is None:
                raise RuntimeError(
                    "Linear4bit weight is not quantized yet: call .to(device) or .quantize() before the forward"
                )
            return weight, quant_state
        quant_state = self.quant_state
        if quant_state is None:
            raise RuntimeError(
                f"Linear4bit weight is a {type(weight).__name__} and the layer has no quant_state: "
                "quantize the layer (or load a quantized checkpoint) before wrapping it"
            )
        if is_dtensor(weight):
            shard: Any = weight
            raise RuntimeError(
                f"Linear4bit weight is a DTensor shard (placements {tuple(shard.placements)}, local shape "
                f"{tuple(shard.to_local().shape)}): run the forward through the module fully_shard was applied "
                "to, or unshard() it first"
            )
        if weight.dtype != self.quant_storage:
            raise TypeError(
                f"Linear4bit weight arrived as {weight.dtype}, but its packed bytes are stored as "
                f"{self.quant_storage}: something cast the packed 4-bit bytes as floats (for example FSDP's "
                f"MixedPrecisionPolicy(param_dtype={weight.dtype})), which rewrites them. Use param_dtype=None "
                f"or {self.quant_storage}, or quant_storage=torch.uint8 (FSDP never casts integer parameters)"
            )
        check_packed(weight, quant_state, "weight")
        if weight.__dict__.get("quant_state") is not quant_state:  # the all-gathered bytes FSDP2 installed
            attach_quant_state(weight, quant_state)
        return weight, cast(F.QuantState, quant_state)  # checked not None above

    def _eager_forward(self, x: torch.Tensor) -> torch.Tensor | None:
        """The forward of the common case, flat, or None: a quantized
        Params4bit, an input in the compute dtype, and eager.matmul_4bit's
        conditions (nothing recording, CPU). A bias of another dtype is cast
        on a copy, as forward does."""
        weight, bias = weight_and_bias(self)
        if (
            type(weight) is not Params4bit
            or not weight.bnb_quantized
            or x.dim() == 0
            or x.shape[-1] != self.in_features
        ):
            return None
        if self.compute_dtype is not None and self.compute_dtype != x.dtype:
            return None
        if bias is not None and bias.dtype != x.dtype:
            if bias.requires_grad and torch.is_grad_enabled():
                return None  # (the cast would be recorded, then dropped: the general forward casts it once)
            bias = bias.to(x.dtype)
        quant_state = weight.quant_state or self.quant_state
        if quant_state is None:
            return None
        activation_quant = getattr(self, "activation_quant", None)  # (modules unpickled from older versions)
        return eager.matmul_4bit(x, weight, quant_state, bias, activation_quant)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self._eager_forward(x)
        if y is not None:
            return y
        weight, quant_state = self.packed_weight()
        if x.dim() == 0 or x.shape[-1] != self.in_features:
            got = "a 0-d input (no features dimension)" if x.dim() == 0 else f"input has {x.shape[-1]} features"
            raise ValueError(f"Linear4bit: {got}, this layer expects in_features={self.in_features}")
        compute = self.compute_dtype if self.compute_dtype is not None else x.dtype
        # (no .to() calls when the dtypes already agree: ~0.7 us each, at batch 1 on a small layer a tenth of the call)
        bias: torch.Tensor | None = self.bias
        if bias is not None and bias.dtype != compute:
            bias = bias.to(compute)  # a copy: the parameter keeps its dtype
        activation_quant = getattr(self, "activation_quant", None)  # (modules unpickled from older versions)
        xc = x if compute == x.dtype else x.to(compute)
        y = F.matmul_4bit(xc, weight, quant_state=quant_state, bias=bias, activation_quant=activation_quant)
        return y if y.dtype == x.dtype else y.to(x.dtype)

    # -- checkpoints

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        super()._save_to_state_dict(destination, prefix, keep_vars)
        weight = self.weight
        if isinstance(weight, Params4bit):
            quant_state = weight.quant_state
        else:  # a parameter installed by FSDP2 (a DTensor shard): the layer holds the state
            quant_state = self.quant_state
            if quant_state is not None:
                attach_quant_state(weight, quant_state)
        if quant_state is not None:
            save_4bit_entries(destination, prefix, quant_state, keep_vars)

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, errs):
        weight_key = prefix + "weight"
        found = load_all_but_weight(
            super()._load_from_state_dict,
            state_dict,
            prefix,
            local_metadata,
            strict,
            missing_keys,
            unexpected_keys,
            errs,
        )
        if found is None:
            return
        data, stats = found
        device = self.weight.device
        try:
            if is_dtensor(self.weight):
                load_sharded(self, weight_key, data, stats)
            elif any(k.startswith(JSON_KEY_PREFIX) for k in stats):
                new = Params4bit.from_prequantized(data, stats, device=device, module=self)
                self.check_state_shape(weight_key, new.quant_state)
                self.weight = new
                self.quant_state = new.quant_state
            elif stats:
                raise q4.QuantStateError(
                    f"'{weight_key}' has quantization entries {sorted(weight_key + '.' + k for k in stats)} but no "
                    f"'{weight_key}.{JSON_KEY_PREFIX}<nf4|fp4>' entry"
                )
            else:
                if tuple(data.shape) != (self.out_features, self.in_features):
                    raise ValueError(
                        f"size mismatch for {weight_key}: checkpoint {tuple(data.shape)}, "
                        f"layer ({self.out_features}, {self.in_features})"
                    )
                was_quantized = getattr(self.weight, "bnb_quantized", False)
                w = self.weight
                self.weight = w.with_data(
                    data.detach().to(
                        device, dtype=torch.float32 if not data.is_floating_point() else data.dtype, copy=True
                    ),
                    requires_grad=False,
                    quant_state=None,
                    module=self,
                    bnb_quantized=False,
                )
                self.quant_state = None
                if was_quantized:  # a float checkpoint into a quantized layer: quantize it the same way
                    self.quantize()
        except (ValueError, TypeError) as e:
            errs.append(f"while loading '{weight_key}': {e}")

    def check_state_shape(self, weight_key: str, quant_state: F.QuantState) -> None:
        if tuple(quant_state.shape) != (self.out_features, self.in_features):
            raise q4.QuantStateError(
                f"'{weight_key}' quant_state shape {tuple(quant_state.shape)} does not match this "
                f"layer's ({self.out_features}, {self.in_features})"
            )


class _FixedQuantType(Linear4bit):
    """Linear4bit with its quant_type fixed by the subclass (bitsandbytes'
    LinearFP4 / LinearNF4 signatures)."""

    QUANT_TYPE = ""

    def __init__(
        self,
        input_features,
        output_features,
        bias=True,
        compute_dtype=None,
        compress_statistics=True,
        quant_storage=torch.uint8,
        device=None,
        *,
        activation_quant=None,
    ):
        super().__init__(
            input_features,
            output_features,
            bias,
            compute_dtype,
            compress_statistics,
            self.QUANT_TYPE,
            quant_storage,
            device,
            activation_quant=activation_quant,
        )


class LinearFP4(_FixedQuantType):
    """Linear4bit with FP4 codes."""

    QUANT_TYPE = "fp4"


class LinearNF4(_FixedQuantType):
    """Linear4bit with NF4 codes (QLoRA's NormalFloat4)."""

    QUANT_TYPE = "nf4"
