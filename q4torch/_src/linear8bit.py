"""LLM.int8 layers with bitsandbytes' names, constructor arguments and
checkpoint keys: Int8Params, Linear8bitLt.

A quantized weight is the Int8Params itself: its data is CB (int8
[out, in], row-major) and its ``SCB`` attribute the fp32 per-row absmax
[out], so that W ~= CB * SCB[:, None] / 127. The layer keeps no other copy of
them (bitsandbytes moves them into a ``MatmulLtState`` on the first forward);
``layer.state`` is a view built from the weight on each access.

Checkpoint keys, as bitsandbytes 0.50.2 writes them: ``weight`` (int8 CB),
``bias``, ``SCB`` (fp32 [out]) and ``weight_format`` (``tensor(0, uint8)``,
meaning row-major); an unquantized layer saves ``weight`` (float) and
``bias`` only.

Differences from bitsandbytes 0.50.2, all deliberate fixes:
- reload: ``load_state_dict`` restores an int8 checkpoint before or after the
  first forward, in train or eval mode, into a layer quantized or still
  waiting for its first ``.to()`` (has_fp16_weights=False); it never writes
  into existing tensors, so neither the caller's state dict nor one taken
  earlier from this layer changes; loaded entries are validated;
- a forward never changes a parameter's dtype or storage (bitsandbytes casts
  the bias to the input dtype in place and swaps the weight's data);
- pickling keeps the Int8Params type (bitsandbytes unpickles a plain
  Parameter carrying CB/SCB attributes);
- a float checkpoint loaded into a quantized layer is an error (bitsandbytes
  casts the float weight to int8 in place, truncating it);
- the forward is one fused kernel for every mode and device: x is quantized
  row-wise in its own dtype (bitsandbytes rounds x to fp16 first, and on the
  CPU in training mode multiplies by the dequantized weight instead);
- an int8 weight cannot be cast to a float dtype with ``.to(dtype)``; a
  weight whose fp16 rounding overflows refuses to quantize (bitsandbytes
  stores an infinite scale); quantizing drops requires_grad (bitsandbytes
  fails on ``Int8Params(w).to(device)`` with the default requires_grad=True).
"""

from __future__ import annotations

import copy
from typing import Any, cast

import torch
from torch import nn

from q4._src import formats, schema, weights
from q4._src.checkpoint import CheckpointError, parse_weight_format
from q4torch import functional as F
from q4torch._src import eager
from q4torch._src.linear4bit import weight_and_bias
from q4torch._src.torch_internals import make_subclass, parse_to

_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _is_int8(w: torch.Tensor | None) -> bool:
    return w is not None and w.dtype == torch.int8


def apply_keeping_scb(module: nn.Module, module_apply, fn, recurse: bool):
    """Module._apply for a module holding an Int8Params ``weight``: _apply may
    keep the Parameter object and swap its data, which would leave SCB (a
    plain attribute) and CB behind on the old device."""
    w = cast(torch.Tensor, module.weight)
    scb = getattr(w, "SCB", None) if _is_int8(w) else None
    module_apply(fn, recurse)
    w = cast(torch.Tensor, module.weight)
    if isinstance(w, Int8Params) and _is_int8(w):
        if w.SCB is None:
            w.SCB = scb
        if w.SCB is not None and w.SCB.device != w.device and w.device.type != "meta":
            w.SCB = w.SCB.to(w.device)
        w.CB = w.data
    return module


def check_weight_format(state_dict, k_fmt: str, errs: list[str]) -> None:
    """An LLM.int8 checkpoint's optional ``weight_format`` entry must name the
    row-major layout; anything else is appended to errs with the key."""
    if k_fmt not in state_dict:
        return
    fmt = state_dict[k_fmt]
    try:
        fmt = parse_weight_format(fmt.detach().cpu() if isinstance(fmt, torch.Tensor) else fmt, k_fmt)
    except CheckpointError as e:
        errs.append(str(e))
    else:
        if fmt != "row":
            errs.append(f"{k_fmt}: only the row-major format (0 or 'row') is supported, got {fmt!r}")


def _quantize_weight(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(CB int8 [out, in], SCB fp32 [out]) of a 2-D float weight, exactly as
    bitsandbytes' Int8Params quantizes it: the weight is rounded to fp16 first."""
    if not w.is_floating_point() or w.dim() != 2:
        raise ValueError(f"Int8Params can only quantize a 2-D float weight, got {w.dtype} {tuple(w.shape)}")
    CB, SCB, _ = F.int8_vectorwise_quant(w.contiguous().to(torch.float16))
    if torch.compiler.is_compiling():  # the check below needs a host sync
        return CB, SCB
    if not bool(torch.isfinite(SCB).all()):
        weights.check_int8_scales(SCB.detach().cpu().numpy())
    return CB, SCB


def save_int8_entries(destination: dict, prefix: str, scb: torch.Tensor, keep_vars: bool) -> None:
    """An int8 weight's ``{prefix}SCB`` and ``{prefix}weight_format`` (row-major)
    added to a state dict that holds its ``{prefix}weight``, through the
    checkpoint schema's writer (q4/_src/schema.py), in bitsandbytes' order."""
    scb = scb if keep_vars else scb.detach()
    destination.update(
        schema.int8_entries(destination[prefix + "weight"], scb, prefix=prefix, as_tensor=torch.from_numpy)
    )


class Int8Params(nn.Parameter):
    """A weight that is quantized to int8 (LLM.int8, one absmax per row) on its
    first move to a device (``.to(device)``, ``.cpu()``, ``.cuda()``) unless
    ``has_fp16_weights``. After that ``data`` is CB (int8 [out, in]), ``CB``
    aliases it and ``SCB`` holds the fp32 row absmax [out].
    """

    CB: torch.Tensor | None
    SCB: torch.Tensor | None
    has_fp16_weights: bool

    def __new__(
        cls,
        data: torch.Tensor | None = None,
        requires_grad: bool = True,
        has_fp16_weights: bool = False,
        CB: torch.Tensor | None = None,
        SCB: torch.Tensor | None = None,
        **kwargs: Any,
    ) -> Int8Params:
        if data is None:
            data = torch.empty(0)
        self = make_subclass(cls, data, requires_grad)
        self.CB = CB
        self.SCB = SCB
        self.has_fp16_weights = has_fp16_weights
        return self

    # -- quantization and moves

    def _quantize(self, device) -> Int8Params:
        if self.has_fp16_weights:
            return cast(Int8Params, super().to(device))
        CB, SCB = _quantize_weight(self.data.to(device))
        if self.requires_grad:  # an int8 tensor cannot require grad
            self.requires_grad_(False)
        self.data = CB
        self.CB = CB
        self.SCB = SCB
        return self

    def cpu(self):
        return self.to(device="cpu")

    def cuda(self, device=None, non_blocking: bool = False):  # type: ignore[override]
        return self.to(device="cuda" if device is None else device, non_blocking=non_blocking)

    def to(self, *args, **kwargs):
        device, dtype, non_blocking, _ = parse_to(*args, **kwargs)
        quantized = self.dtype == torch.int8
        if not quantized and device is not None and device.type != "meta" and self.device.type == "cpu":
            return self._quantize(device)
        if quantized and dtype is not None and dtype != torch.int8:
            raise TypeError(
                f"cannot cast a quantized int8 weight to {dtype}; dequantize it (CB * SCB[:, None] / 127) instead"
            )
        new = Int8Params(
            super().to(device=device, dtype=dtype, non_blocking=non_blocking),
            requires_grad=self.requires_grad,
            has_fp16_weights=self.has_fp16_weights,
        )
        if quantized:
            new.CB = new.data
            new.SCB = self.SCB
            if device is not None and self.SCB is not None and self.SCB.device.type != "meta":
                new.SCB = self.SCB.to(device, non_blocking=non_blocking)
        return new

    # -- copying and pickling

    def __deepcopy__(self, memo):
        # Through `memo`, so a weight (or SCB) shared inside the copied
        # structure stays shared in the copy, and nothing in the copy aliases
        # the original.
        if id(self) in memo:
            return memo[id(self)]
        new = type(self).__new__(
            type(self), self.data.clone(), self.requires_grad, self.has_fp16_weights, SCB=None, CB=None
        )
        memo[id(self)] = new
        if self.CB is not None:
            aliases_data = self.CB.untyped_storage().data_ptr() == self.untyped_storage().data_ptr()
            new.CB = new.data if aliases_data else copy.deepcopy(self.CB, memo)
        new.SCB = copy.deepcopy(self.SCB, memo)
        return new

    def __reduce_ex__(self, protocol):
        cb_is_data = self.CB is not None and self.CB.untyped_storage().data_ptr() == self.untyped_storage().data_ptr()
        state = {
            "has_fp16_weights": self.has_fp16_weights,
            "SCB": self.SCB,
            "CB": None if cb_is_data else self.CB,
            "cb_is_data": cb_is_data,
        }
        return (_rebuild_int8_params, (self.data, self.requires_grad, state))


def _rebuild_int8_params(data: torch.Tensor, requires_grad: bool, state: dict[str, Any]) -> Int8Params:
    p = Int8Params(data, requires_grad, state["has_fp16_weights"], CB=state["CB"], SCB=state["SCB"])
    if state["cb_is_data"]:
        p.CB = p.data
    return p


class MatmulLtState:
    """bitsandbytes' ``MatmulLtState`` fields as a view of a Linear8bitLt,
    built on each ``layer.state`` access (never stored, so never stale).

    ``CB`` / ``SCB`` are the weight's int8 data and row absmax (None while the
    weight is unquantized); ``threshold`` and ``has_fp16_weights`` read and
    write the layer's settings; assigning CB or SCB changes only this view.
    """

    def __init__(self, layer: Linear8bitLt):
        self._layer = layer
        w = layer.weight
        self.CB = w.detach() if _is_int8(w) else None
        self.SCB = getattr(w, "SCB", None) if _is_int8(w) else None
        self.idx = None

    threshold = property(
        lambda self: self._layer.threshold, lambda self, v: setattr(self._layer, "threshold", float(v))
    )
    has_fp16_weights = property(
        lambda self: getattr(self._layer.weight, "has_fp16_weights", True),
        lambda self, v: setattr(self._layer.weight, "has_fp16_weights", bool(v)),
    )
    is_training = property(lambda self: self._layer.training)
    # True: the forward multiplies by the dequantized weight (CB * SCB / 127, in
    # the input's dtype) instead of the int8 product (written to the layer)
    force_no_igemmlt = property(
        lambda self: getattr(self._layer, "force_no_igemmlt", False),
        lambda self, v: setattr(self._layer, "force_no_igemmlt", bool(v)),
    )
    use_pool = property(lambda self: self.threshold > 0.0 and not self.has_fp16_weights)

    def _key(self):
        return (self.threshold, self.has_fp16_weights, self.is_training, self.CB is None, self.SCB is None)

    def __eq__(self, other):
        if not isinstance(other, MatmulLtState):
            return NotImplemented
        return (
            self._key() == other._key()
            and (self.CB is None or torch.equal(self.CB, other.CB))
            and (self.SCB is None or torch.equal(self.SCB, other.SCB))
        )

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self):
        cb = None if self.CB is None else tuple(self.CB.shape)
        return f"MatmulLtState(threshold={self.threshold}, has_fp16_weights={self.has_fp16_weights}, CB={cb})"


class Linear8bitLt(nn.Linear):
    """LLM.int8 linear layer, as bitsandbytes.nn.Linear8bitLt.

    y = x . (CB * SCB / 127)^T (+ bias), x quantized row-wise inside the fused
    kernel, with input columns holding any |x| >= threshold (threshold > 0)
    computed in fp32 instead. The output has x's dtype (fp32, fp16 or bf16);
    the bias is read in its own dtype and never cast in place. Gradients flow
    to x and the bias; the int8 weight is frozen.

    With has_fp16_weights=False (the usual case) the weight is quantized on the
    layer's first ``.to(device)`` / ``.cuda()`` / ``.cpu()``. An unquantized
    float weight (has_fp16_weights=True, or before that first move) is
    quantized afresh on every forward, as bitsandbytes does, and receives the
    straight-through gradient dL/dW = g^T x when it requires grad.
    """

    def __init__(
        self,
        input_features: int,
        output_features: int,
        bias: bool = True,
        has_fp16_weights: bool = True,
        threshold: float = 0.0,
        index=None,
        device=None,
    ):
        super().__init__(input_features, output_features, bias, device)
        formats.check_threshold(threshold)
        self.threshold = float(threshold)
        self.index = index
        self.weight = Int8Params(self.weight.data, requires_grad=has_fp16_weights, has_fp16_weights=has_fp16_weights)

    @property
    def state(self) -> MatmulLtState:
        return MatmulLtState(self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w, bias = weight_and_bias(self)
        if w.dtype == torch.int8:
            scb = getattr(w, "SCB", None)
            if scb is None:
                raise RuntimeError(
                    "Linear8bitLt: the weight is int8 but has no SCB (row scales); "
                    "set weight.SCB or load a checkpoint with an 'SCB' entry"
                )
            if getattr(self, "force_no_igemmlt", False):
                wd = (w.detach().to(torch.float32) * (scb.to(torch.float32) * (1.0 / 127.0)).unsqueeze(1)).to(x.dtype)
                return nn.functional.linear(x, wd, None if bias is None else bias.to(x.dtype))
            if x.dtype == torch.float64:  # (the kernels take fp32/fp16/bf16: fp64 computes in fp32, as Linear4bit)
                b = None if bias is None else bias.to(torch.float32)
                return F.int8_linear(x.to(torch.float32), w, scb, self.threshold, b).to(x.dtype)
            y = eager.int8_linear(x, w, scb, self.threshold, bias)
            return F.int8_linear(x, w, scb, self.threshold, bias) if y is None else y
        # Unquantized float weight: quantize a temporary copy (nothing stored).
        CB, SCB = _quantize_weight(w.detach())
        y = F.int8_linear(x, CB, SCB, self.threshold, bias)
        if w.requires_grad and torch.is_grad_enabled():
            # Straight-through for the weight: adds exactly zero to y, gives dL/dW = g^T x.
            dense = nn.functional.linear(x.detach().to(w.dtype), w).to(x.dtype)
            y = y + (dense - dense.detach())
        return y

    # -- device moves

    def _apply(self, fn, recurse=True):
        return apply_keeping_scb(self, super()._apply, fn, recurse)

    # -- checkpoints

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        super()._save_to_state_dict(destination, prefix, keep_vars)
        w = self.weight
        if _is_int8(w):
            scb = getattr(w, "SCB", None)
            if scb is None:
                raise RuntimeError(
                    f"cannot save {prefix}weight: it is int8 but has no SCB (row scales), "
                    "so the checkpoint could not be loaded"
                )
            save_int8_entries(destination, prefix, scb, keep_vars)

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, errs):
        """Validates everything first and changes nothing on error. Loaded
        tensors are copied onto the layer's device (its dtype for the bias and
        a float weight); no existing tensor is written into."""
        for hook in self._load_state_dict_pre_hooks.values():
            hook(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, errs)
        k_w, k_b, k_scb, k_fmt = (prefix + s for s in ("weight", "bias", "SCB", "weight_format"))
        assign = local_metadata.get("assign_to_params_buffers", False)
        n_errs = len(errs)
        w = self.weight
        out_f, in_f = self.out_features, self.in_features

        check_weight_format(state_dict, k_fmt, errs)

        new_w = new_scb = None
        w_in, scb_in = state_dict.get(k_w), state_dict.get(k_scb)
        if w_in is not None and not isinstance(w_in, torch.Tensor):
            errs.append(f"{k_w}: expected a tensor, got {type(w_in).__name__}")
        elif w_in is not None and tuple(w_in.shape) != (out_f, in_f):
            errs.append(f"size mismatch for {k_w}: checkpoint has {tuple(w_in.shape)}, the layer is {(out_f, in_f)}")
        elif _is_int8(w_in):
            if scb_in is None:
                errs.append(f"{k_scb} is missing: an int8 {k_w} needs its row scales")
            elif not isinstance(scb_in, torch.Tensor) or not scb_in.is_floating_point() or scb_in.dim() != 1:
                what = f"{scb_in.dtype} {tuple(scb_in.shape)}" if isinstance(scb_in, torch.Tensor) else type(scb_in)
                errs.append(f"{k_scb} must be a 1-D float tensor, got {what}")
            elif scb_in.shape[0] != out_f:
                errs.append(f"{k_scb} has {scb_in.shape[0]} values, the layer has {out_f} output features")
            elif not isinstance(w, Int8Params) or (w.has_fp16_weights and not _is_int8(w)):
                errs.append(
                    "Loading a quantized checkpoint into non-quantized Linear8bitLt is not supported: "
                    f"{k_w} is int8 but this layer keeps a float weight "
                    f"({'has_fp16_weights=True' if isinstance(w, Int8Params) else type(w).__name__}); "
                    "build it with has_fp16_weights=False"
                )
            else:
                device = w_in.device if w.is_meta else w.device
                new_w = w_in.detach().to(device, copy=True)
                new_scb = scb_in.detach().to(device, torch.float32, copy=True)
        elif w_in is not None and w_in.is_floating_point():
            if scb_in is not None:
                errs.append(
                    "Loading a quantized checkpoint into non-quantized Linear8bitLt is not supported: "
                    f"{k_scb} given with a float (unquantized) {k_w} ({w_in.dtype})"
                )
            elif _is_int8(w):
                errs.append(
                    f"{k_w} is a float ({w_in.dtype}) weight but this layer is already quantized; "
                    "load it before the layer's first .to(device), or into a fresh layer"
                )
            else:
                device = w_in.device if w.is_meta else w.device
                new_w = w_in.detach().to(device, w.dtype, copy=True)
        elif w_in is not None:
            errs.append(f"{k_w} must be int8 (quantized) or float, got {w_in.dtype}")
        elif scb_in is not None:
            errs.append(f"{k_scb} given without {k_w}")

        new_b = None
        b_in = state_dict.get(k_b)
        if self.bias is not None and b_in is not None:
            if not isinstance(b_in, torch.Tensor) or tuple(b_in.shape) != (out_f,):
                got = tuple(b_in.shape) if isinstance(b_in, torch.Tensor) else type(b_in).__name__
                errs.append(f"size mismatch for {k_b}: checkpoint has {got}, the layer has ({out_f},)")
            elif assign:
                new_b = b_in
            else:
                device = b_in.device if self.bias.is_meta else self.bias.device
                new_b = b_in.detach().to(device, self.bias.dtype, copy=True)

        if len(errs) > n_errs:
            return
        if new_w is not None:
            with torch.no_grad():
                if new_w.dtype == torch.int8 and w.requires_grad:
                    w.requires_grad_(False)
                w.data = new_w
            if isinstance(w, Int8Params):
                w.CB, w.SCB = (new_w, new_scb) if new_scb is not None else (None, None)
        if new_b is not None:
            if assign:
                self.bias = nn.Parameter(new_b, requires_grad=self.bias.requires_grad)
            else:
                with torch.no_grad():
                    self.bias.data = new_b

        if strict:
            if w_in is None:
                missing_keys.append(k_w)
            if self.bias is not None and b_in is None:
                missing_keys.append(k_b)
            known = {"weight", "SCB", "weight_format"} | ({"bias"} if self.bias is not None else set())
            unexpected_keys.extend(k for k in state_dict if k.startswith(prefix) and k[len(prefix) :] not in known)
