"""Quantized weights and layers built from float ones, and back:
quantized_weight (a new Params4bit / Int8Params), quantized_linear (a new
Linear4bit / Linear8bitLt), dequantized_weight (the fp32 weight a layer
computes with). Above the parameter and linear layer modules and below
everything that builds or unpacks quantized layers (embeddings,
replace_linear, transformers and peft integration), so that none of those
import each other for it."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch import nn

from q4._src.weights import quantize_weight_4bit
from q4torch import functional as F
from q4torch._src.linear4bit import Linear4bit, Params4bit
from q4torch._src.linear8bit import Int8Params, Linear8bitLt

__all__ = ["dequantized_weight", "quantized_linear", "quantized_weight"]


def quantized_linear(
    linear: nn.Linear,
    quant_type,
    compute_dtype,
    blocksize,
    compress_statistics,
    threshold,
    activation_quant=None,
    method: str = "absmax",
    hessian: np.ndarray | None = None,
    damp: float = 0.01,
) -> nn.Module:
    """A Linear8bitLt ('int8') or Linear4bit holding ``linear``'s weight (quantized
    by quantized_weight) and a copy of its bias, on the weight's device: the one
    place that builds a quantized linear layer from a float one (replace_linear,
    load_quantized, transformers' quantized tied head)."""
    device = linear.weight.device
    weight = linear.weight.detach()
    new: Linear8bitLt | Linear4bit
    if quant_type == "int8":
        new = Linear8bitLt(
            linear.in_features,
            linear.out_features,
            bias=linear.bias is not None,
            has_fp16_weights=False,
            threshold=threshold,
            device="meta",
        )
    else:
        new = Linear4bit(
            linear.in_features,
            linear.out_features,
            bias=linear.bias is not None,
            compute_dtype=compute_dtype,
            compress_statistics=compress_statistics,
            quant_type=quant_type,
            device="meta",
        )
        new.activation_quant = activation_quant
    new.weight = quantized_weight(
        new, weight, blocksize, compress_statistics, quant_type, method=method, hessian=hessian, damp=damp
    )
    if linear.bias is not None:
        new.bias = nn.Parameter(linear.bias.detach().clone(), requires_grad=linear.bias.requires_grad)
    return new.to(device)


def quantized_weight(
    layer: nn.Module,
    weight: torch.Tensor,
    blocksize: int,
    compress_statistics: bool,
    quant_type: str,
    quant_storage: torch.dtype = torch.uint8,
    *,
    method: str = "absmax",
    hessian: np.ndarray | None = None,
    damp: float = 0.01,
) -> nn.Parameter:
    """A new quantized weight Parameter for the q4 ``layer`` (a linear or
    embedding layer) from a float ``weight`` (nothing existing is written):
    for 'int8' an ``Int8Params`` (quantized as it moves to the weight's
    device); else a ``Params4bit`` with the given 4-bit settings (the
    layer's quant_state follows it), its scales and codes by ``method``:
    'absmax' (bitsandbytes') quantizes on the weight's device as the
    parameters' first move there does (a meta weight stays unquantized);
    'mse' / 'gptq' (``hessian``, ``damp``) run q4's quantizers on the host
    (q4/_src/quantizers.py) and place the result on the weight's device.
    The one place that builds them: replace_linear, quantized embeddings,
    transformers' quantize on load and peft's requantize."""
    weight = weight.detach()
    if quant_type == "int8":
        # Int8Params quantizes on a move from the CPU (bitsandbytes' rule)
        return Int8Params(weight.cpu(), requires_grad=False, has_fp16_weights=False).to(weight.device)
    if method == "absmax":
        return Params4bit(
            weight,
            requires_grad=False,
            blocksize=blocksize,
            compress_statistics=compress_statistics,
            quant_type=quant_type,
            quant_storage=quant_storage,
            module=layer,  # type: ignore[arg-type]
        ).to(weight.device)
    packed, st = quantize_weight_4bit(
        weight.float().cpu().numpy(), blocksize, quant_type, compress_statistics, method,
        hessian=hessian, damp=damp, dtype=str(weight.dtype).removeprefix("torch."),
    )  # fmt: skip
    stats = {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in st.to_dict().items()}
    return Params4bit.from_prequantized(torch.from_numpy(packed), stats, device=weight.device, module=layer)  # type: ignore[arg-type]


def dequantized_weight(module: nn.Module) -> torch.Tensor:
    """The fp32 weight [out, in] a q4torch Linear4bit / Linear8bitLt computes with."""
    w: Any = module.weight
    if isinstance(module, Linear8bitLt):
        if w.dtype != torch.int8:
            return w.detach().float()
        return F.int8_vectorwise_dequant(w.detach(), w.SCB)
    if not getattr(w, "bnb_quantized", False):
        return w.detach().float()
    return F.dequantize_4bit(w.detach(), w.quant_state).float()
