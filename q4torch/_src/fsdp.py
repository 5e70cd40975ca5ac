"""FSDP2 (``torch.distributed.fsdp.fully_shard``) and torch.distributed.checkpoint
(DCP) for models with Linear4bit layers.

What FSDP2 does to a packed weight, and why the bytes survive (measured in
tests/torch/test_fsdp.py, torch 2.13, CPU/gloo):

- ``fully_shard`` replaces the Params4bit by a DTensor sharded on dim 0 of the
  packed ``(rows, 1)`` tensor (rows = packed bytes / itemsize of
  ``quant_storage``), padding the last shard when rows do not divide by the
  world size. Every copy on that path (chunk, pad, all-gather copy-in, the
  collective, copy-out, DCP write/read) is a same-dtype copy, which moves bits:
  all 65,536 bf16 (and fp16) bit patterns, NaNs included, come back unchanged.
- The Params4bit attributes are lost; the layer keeps the whole QuantState
  (``module.quant_state``, never sharded) and attaches it to the parameters
  FSDP installs.
- The one place FSDP converts values is MixedPrecisionPolicy.param_dtype,
  applied to every floating-point parameter: a packed weight stored as
  bf16/fp16/fp32 would be cast. bf16 -> fp32 widens exactly, but the layer
  would then read fp32 bytes, and any cast back canonicalises NaN payloads
  (x86 CPU: 253 of the 254 bf16 NaN patterns become 0xFFFF; fp16 -> fp32 ->
  fp16 quiets signalling NaNs); bf16 -> fp16 changes 56,935 of the 65,536
  words. :func:`fully_shard` refuses that request; the layer's forward
  refuses any weight whose dtype is not its ``quant_storage``.
  Integer storage (``quant_storage=torch.uint8``) is never cast by FSDP.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.fsdp import fully_shard as _torch_fully_shard
from torch.distributed.tensor import DTensor

from q4._src.quant_state import JSON_KEY_PREFIX
from q4torch._src.linear4bit import Linear4bit, Params4bit, attach_quant_state

__all__ = ["QuantStateLoadPlanner", "fully_shard"]


def _managed_layers(modules: tuple[nn.Module, ...], ignored: set) -> list[tuple[str, Linear4bit]]:
    """The Linear4bit layers whose weight a fully_shard call on `modules` would shard
    (not already sharded by an earlier call on a submodule, not ignored)."""
    seen, found = set(), []
    for root in modules:
        for name, layer in root.named_modules():
            if isinstance(layer, Linear4bit) and id(layer) not in seen:
                seen.add(id(layer))
                weight = layer.weight
                if not isinstance(weight, DTensor) and not any(weight is p for p in ignored):
                    found.append((name or type(layer).__name__, layer))
    return found


def _check_layer(name: str, layer: Linear4bit, mp_policy: Any, shard_placement_fn: Any) -> None:
    weight = layer.weight
    if isinstance(weight, Params4bit):
        if not weight.bnb_quantized or weight.quant_state is None:
            raise ValueError(
                f"Linear4bit '{name}' is not quantized: call .quantize() (or .to(device)) before fully_shard; "
                "a sharded weight cannot be quantized"
            )
        layer.quant_state = weight.quant_state  # the layer's copy is what survives sharding
        layer.quant_storage = weight.dtype
    elif layer.quant_state is None:
        raise ValueError(f"Linear4bit '{name}' has a {type(weight).__name__} weight and no quant_state")
    param_dtype = getattr(mp_policy, "param_dtype", None)
    if param_dtype is not None and weight.dtype.is_floating_point and param_dtype != weight.dtype:
        raise ValueError(
            f"MixedPrecisionPolicy(param_dtype={param_dtype}) would cast the packed 4-bit weight of Linear4bit "
            f"'{name}' (quant_storage {weight.dtype}); a float cast rewrites packed bytes (NaN bit patterns are "
            f"canonicalised). Use quant_storage={param_dtype} or torch.uint8 for this layer, or shard it in its "
            "own fully_shard call without param_dtype"
        )
    if shard_placement_fn is not None:
        result = shard_placement_fn(weight)
        placement = getattr(result, "placement", result)
        dim = getattr(placement, "dim", 0)
        if dim not in (0, -weight.dim()):
            raise ValueError(
                f"shard_placement_fn returned {placement!r} for the packed 4-bit weight of Linear4bit '{name}' "
                f"(shape {tuple(weight.shape)}): packed bytes can only be sharded on dim 0"
            )


def fully_shard(module: nn.Module | list[nn.Module], **kwargs: Any):
    """``torch.distributed.fsdp.fully_shard(module, **kwargs)`` after checking the
    Linear4bit layers it would shard; returns what torch's returns.

    Refused with a ValueError naming the layer and the offending value: a layer
    that is not quantized yet; ``mp_policy=MixedPrecisionPolicy(param_dtype=d)``
    with ``d`` a float dtype other than the layer's ``quant_storage`` (FSDP would
    cast the packed bytes); a ``shard_placement_fn`` that shards a packed weight
    on a dim other than 0. Weights in ``ignored_params`` are not checked (FSDP
    leaves them alone).

    Invariant after the call (and after every all-gather): the packed bytes each
    layer computes with are bit-identical to the unsharded layer's, and
    ``layer.weight.quant_state is layer.quant_state`` holds the whole state on
    every rank. Layers sharded with torch's ``fully_shard`` directly work the
    same way; they only lose the early checks (the forward still refuses a cast
    weight).
    """
    modules = (module,) if isinstance(module, nn.Module) else tuple(module)
    layers = _managed_layers(modules, set(kwargs.get("ignored_params") or ()))
    for name, layer in layers:
        _check_layer(name, layer, kwargs.get("mp_policy"), kwargs.get("shard_placement_fn"))
    result = _torch_fully_shard(module, **kwargs)
    for _, layer in layers:
        if isinstance(layer.weight, DTensor) and layer.quant_state is not None:  # (checked quantized above)
            attach_quant_state(layer.weight, layer.quant_state)
    return result


class QuantStateLoadPlanner(DefaultLoadPlanner):
    """A torch.distributed.checkpoint ``DefaultLoadPlanner`` for state dicts with
    4-bit layers: ``dcp.load(state, checkpoint_id=..., planner=QuantStateLoadPlanner())``.

    A quantized layer's ``weight.quant_state.bitsandbytes__<nf4|fp4>`` entry is
    UTF-8 JSON (bitsandbytes' format) whose length depends on its values (the
    nested absmax offset), so a fresh model's entry can differ in length from
    the checkpoint's and DCP refuses to load it in place. This planner gives
    such entries the checkpoint's length before planning; every other entry is
    loaded exactly as DefaultLoadPlanner does (sizes must match). Then call
    ``model.load_state_dict(state)``, which rebuilds each layer's QuantState.
    """

    def set_up_planner(self, state_dict, metadata=None, is_coordinator: bool = False) -> None:
        if metadata is not None:
            _fit_json_entries(state_dict, metadata.state_dict_metadata, "")
        super().set_up_planner(state_dict, metadata, is_coordinator)


def _fit_json_entries(state_dict: dict, saved: dict, prefix: str) -> None:
    """Resize (in the caller's dict) the quant-state JSON entries to their saved size,
    following DCP's flattening of nested dicts ('outer.inner' keys)."""
    for key, value in list(state_dict.items()):
        fqn = prefix + str(key)
        if isinstance(value, dict):
            _fit_json_entries(value, saved, fqn + ".")
            continue
        if "." + JSON_KEY_PREFIX not in "." + fqn or not isinstance(value, torch.Tensor) or isinstance(value, DTensor):
            continue
        md = saved.get(fqn)
        if isinstance(md, TensorStorageMetadata) and md.size != value.size() and md.properties.dtype == value.dtype:
            state_dict[key] = torch.empty(md.size, dtype=value.dtype, device=value.device)
