"""peft integration: LoRA and DoRA adapters over q4torch's quantized layers.

peft's extension point for third-party layers is the custom module mapping of
a ``LoraConfig`` (``_register_custom_module``, documented in peft's "custom
models" guide); :func:`register` fills it with :class:`LoraLinear` for
``Linear4bit`` and ``Linear8bitLt``. Without it peft wraps a q4 layer as a
plain ``nn.Linear`` (forward and training work), but merging writes a float
delta into packed bytes and DoRA calls bitsandbytes to dequantize.

What :class:`LoraLinear` changes, and nothing else:
- merge / unmerge (and so ``merge_and_unload``): dequantize the base weight
  with q4 (fp32), add the adapter's delta (LoRA) or apply DoRA's rescaling,
  and quantize the result again into a new weight of the same layer type
  and settings, as peft does for bitsandbytes; the packed bytes are never
  written in place (copies of the layer keep theirs);
- DoRA: the base weight for the column norms is q4's dequantized weight;
  bitsandbytes is never imported.
Adapter initialisations that rewrite the base weight (PiSSA, OLoRA, ...)
are refused with the option named.

peft has no registry of dispatchers outside a config, so a plain
``LoraConfig`` (what a bitsandbytes user writes) still wraps a q4 layer in
peft's own ``Linear``: training works, but its merge would add a float delta
to packed bytes. Importing this module (``q4torch.peft``, and ``q4torch.hf``
when peft is installed) makes that merge / unmerge raise a ValueError that
names the layer and says to use :func:`register` (:func:`_guard_plain_lora`).
"""

from __future__ import annotations

from typing import Any

import torch
from peft import LoraConfig
from peft.tuners.lora.dora import DoraLinearLayer
from peft.tuners.lora.layer import Linear as PeftLoraLinear
from peft.tuners.lora.variants import DoraLinearVariant
from peft.utils.other import transpose
from torch import nn
from torch.nn import functional as torch_F

from q4torch._src.linear4bit import Linear4bit
from q4torch._src.linear8bit import Linear8bitLt
from q4torch._src.quantize import dequantized_weight, quantized_weight

_PLAIN_INITS = (True, False, "gaussian")


def register(config: LoraConfig) -> LoraConfig:
    """``config`` with q4's LoRA layer registered for ``Linear4bit`` and
    ``Linear8bitLt`` (returned, for chaining):
    ``get_peft_model(model, q4torch.peft.register(LoraConfig(...)))``; for
    saved adapters, ``PeftModel.from_pretrained(model, path,
    config=q4torch.peft.register(LoraConfig.from_pretrained(path)))``."""
    if not isinstance(config, LoraConfig):
        raise TypeError(f"register takes a peft LoraConfig, got {type(config).__name__}")
    config._register_custom_module({Linear4bit: LoraLinear, Linear8bitLt: LoraLinear})
    return config


def requantize(layer: Any, weight: torch.Tensor) -> None:
    """Give a q4 layer a new weight (float [out, in]) quantized with the layer's
    own settings; the old Parameter (and its bytes) is left untouched."""
    old: Any = layer.weight
    w = weight.to(old.device)
    if isinstance(layer, Linear8bitLt):
        layer.weight = quantized_weight(layer, w, 0, False, "int8")
    else:
        layer.weight = quantized_weight(
            layer, w, old.blocksize, old.compress_statistics, old.quant_type, old.quant_storage
        )


def merge_and_dequantize(peft_model: nn.Module) -> nn.Module:
    """The base model of ``peft_model`` with every q4 LoRA layer replaced, in
    place, by an ``nn.Linear`` holding the merged weight in fp32 (q4's
    dequantized base plus each active adapter's delta, DoRA's rescaling
    applied) and the base bias (plus LoRA biases): the adapters' function
    without the second rounding that ``merge_and_unload`` (which quantizes the
    merged weight again) adds. Returns the base model."""
    get_base = getattr(peft_model, "get_base_model", None)
    base_model: nn.Module = get_base() if callable(get_base) else peft_model
    lora_layers = [(name, layer) for name, layer in base_model.named_modules() if isinstance(layer, LoraLinear)]
    if not lora_layers:
        # e.g. after merge_and_unload(), which already merged (and quantized again) every adapter:
        # returning the model unchanged would pass off a 4-bit model as the dequantized merge
        raise ValueError(
            f"merge_and_dequantize: {type(peft_model).__name__} has no q4 LoRA layer; pass the peft model "
            "before merge_and_unload() (which merges the adapters into the 4-bit weights, rounding them again)"
        )
    for name, layer in lora_layers:
        if layer.merged:
            raise ValueError(f"{name}: adapters already merged into the quantized weight; unmerge() first")
        base: Any = layer.get_base_layer()
        w = dequantized_weight(base)
        bias = None if base.bias is None else base.bias.detach().float().clone()
        for adapter in layer.active_adapters:
            if adapter in layer.lora_A:
                w = layer._merged(adapter, w, +1)
                if layer.lora_bias[adapter]:
                    bias = bias + layer._lora_b(adapter).bias.detach().float()
        new = nn.Linear(base.in_features, base.out_features, bias=bias is not None, device="meta")
        new.weight = nn.Parameter(w.detach(), requires_grad=False)
        if bias is not None:
            new.bias = nn.Parameter(bias, requires_grad=base.bias.requires_grad)
        base_model.set_submodule(name, new)
    return base_model


def _guard_plain_lora() -> None:
    """peft's LoRA ``Linear.merge`` / ``unmerge`` over a q4 layer (a config
    without :func:`register`) raise a clear error instead of writing a float
    delta into the packed bytes (peft's own message: a tensor size mismatch).
    Idempotent; q4's LoraLinear overrides both and is not affected."""
    for name in ("merge", "unmerge"):
        method = getattr(PeftLoraLinear, name)
        if getattr(method, "_q4_guard", False):
            continue

        def guarded(self, *args, _method=method, _name=name, **kwargs):
            base = self.get_base_layer()
            if isinstance(base, (Linear4bit, Linear8bitLt)) and not isinstance(self, LoraLinear):
                raise ValueError(
                    f"peft cannot {_name} a LoRA adapter into the q4torch {type(base).__name__} it wraps "
                    f"({base.in_features} -> {base.out_features}): the adapters were created without q4's LoRA "
                    "layer. Create them with get_peft_model(model, q4torch.peft.register(LoraConfig(...))) "
                    "(or PeftModel.from_pretrained(model, path, config=q4torch.peft.register("
                    "LoraConfig.from_pretrained(path)))): merging then dequantizes, adds the delta and quantizes "
                    "again; the trained adapters load as they are"
                )
            return _method(self, *args, **kwargs)

        guarded._q4_guard = True  # type: ignore[attr-defined]
        guarded.__name__, guarded.__doc__ = method.__name__, method.__doc__
        setattr(PeftLoraLinear, name, guarded)


class Q4DoraLayer(DoraLinearLayer):
    """DoRA's magnitude vector over a q4 base: the column norms use q4's
    dequantized weight W (fp32), ||W + s * B A|| per output row, never
    differentiated (DoRA paper, section 4.3)."""

    def update_layer(self, *, base_layer, lora_A, lora_B, scaling, place_on_cpu=False) -> None:
        w = dequantized_weight(base_layer).to(lora_A.device)
        norm = torch.linalg.norm(w + scaling * (lora_B.float() @ lora_A.float()), dim=1)
        self.weight = nn.Parameter(norm.to("cpu" if place_on_cpu else lora_A.device, lora_A.dtype), requires_grad=True)

    def forward(self, x, *, lora_A, lora_B, scaling, base_layer, base_result=None, adapter_name="default"):
        """What DoRA adds to the base layer's output (its bias excluded):
        (m / ||W + s B A|| - 1) * x W^T + (m / ||W + s B A||) * s * x A^T B^T."""
        w = dequantized_weight(base_layer).to(x.dtype)
        lora_w = (lora_B.weight @ lora_A.weight).detach().to(x.dtype)
        norm = torch.linalg.norm(w + scaling * lora_w, dim=1).detach()
        scale = (self.weight / norm).view(1, -1)
        if base_result is None:
            base_result = torch_F.linear(x, w)
        elif base_layer.bias is not None:
            base_result = base_result - base_layer.bias
        return (scale - 1) * base_result + scale * lora_B(lora_A(x)) * scaling


class Q4DoraVariant(DoraLinearVariant):
    """peft's DoRA variant with :class:`Q4DoraLayer` (merging: LoraLinear)."""

    @staticmethod
    def init(module, adapter_name: str, **kwargs: Any) -> None:
        if not module.lora_magnitude_vector:
            module.adapter_layer_names = module.adapter_layer_names[:] + ("lora_magnitude_vector",)
        layer = Q4DoraLayer(fan_in_fan_out=False)
        layer.update_layer(
            base_layer=module.get_base_layer(),
            lora_A=module.lora_A[adapter_name].weight,
            lora_B=module.lora_B[adapter_name].weight,
            scaling=module.scaling[adapter_name],
        )
        module.lora_magnitude_vector[adapter_name] = layer


class LoraLinear(PeftLoraLinear):
    """peft's LoRA layer over a q4torch ``Linear4bit`` / ``Linear8bitLt``: the
    forward is peft's (q4's fused kernel for the base, then the adapters);
    merging dequantizes, merges in fp32 and quantizes again (module docstring)."""

    def __init__(self, base_layer: nn.Module, adapter_name: str, config: LoraConfig, **kwargs: Any):
        if config.init_lora_weights not in _PLAIN_INITS:
            raise ValueError(
                f"init_lora_weights={config.init_lora_weights!r} rewrites the base weight, which a q4 layer keeps "
                f"quantized; use one of {_PLAIN_INITS}"
            )
        if config.fan_in_fan_out:
            raise ValueError("fan_in_fan_out=True does not apply to q4 layers (their weight is [out, in])")
        super().__init__(base_layer, adapter_name, config=config, **kwargs)

    def resolve_lora_variant(self, *, config: LoraConfig, **kwargs: Any):
        variant = super().resolve_lora_variant(config=config, **kwargs)
        if variant is None:
            return None
        if type(variant) is DoraLinearVariant:
            return Q4DoraVariant()
        raise ValueError(f"q4 layers take LoRA and DoRA adapters, not {type(variant).__name__}")

    def _merged(self, adapter: str, w: torch.Tensor, sign: int) -> torch.Tensor:
        delta = self.get_delta_weight(adapter).float()
        if adapter not in self.lora_variant:
            return w + sign * delta
        magnitude = self.lora_magnitude_vector[adapter].weight.float()
        if sign > 0:
            norm = torch.linalg.norm(w + delta, dim=1).detach()
            self._cache_store(f"{adapter}-weight_norm", norm)
            return (magnitude / norm).view(-1, 1) * (w + delta)
        norm = self._cache_pop(f"{adapter}-weight_norm")
        return w / (magnitude / norm).view(-1, 1) - delta

    def merge(self, safe_merge: bool = False, adapter_names: list[str] | None = None) -> None:
        from peft.tuners.tuners_utils import check_adapters_to_merge

        for adapter in check_adapters_to_merge(self, adapter_names):
            if adapter not in self.lora_A:
                continue
            base: Any = self.get_base_layer()
            w = self._merged(adapter, dequantized_weight(base), +1)
            if safe_merge and not torch.isfinite(w).all():
                raise ValueError(f"NaNs detected in the merged weights. The adapter {adapter} seems to be broken")
            requantize(base, w)
            if self.lora_bias[adapter]:
                base.bias.data = base.bias.data + self._lora_b(adapter).bias
            self.merged_adapters.append(adapter)

    def unmerge(self) -> None:
        while self.merged_adapters:
            adapter = self.merged_adapters.pop()
            if adapter not in self.lora_A:
                continue
            base: Any = self.get_base_layer()
            requantize(base, self._merged(adapter, dequantized_weight(base), -1))
            if self.lora_bias[adapter]:
                base.bias.data = base.bias.data - self._lora_b(adapter).bias

    def _lora_b(self, adapter: str) -> Any:
        return self.lora_B[adapter]

    def get_delta_weight(self, adapter: str) -> torch.Tensor:
        a: Any = self.lora_A[adapter]
        return transpose(self._lora_b(adapter).weight @ a.weight, False) * self.scaling[adapter]

    def __repr__(self) -> str:
        return "q4." + super().__repr__()


_guard_plain_lora()
