"""replace_linear: swap every nn.Linear of a model for a quantized layer."""

from __future__ import annotations

import fnmatch
import logging

import torch
from torch import nn

import q4

logger = logging.getLogger("q4torch")

QUANT_TYPES = ("nf4", "fp4", "int8")


def _skipped(name: str, skip) -> bool:
    last = name.rsplit(".", 1)[-1]
    return any(fnmatch.fnmatchcase(name, pat) or fnmatch.fnmatchcase(last, pat) for pat in skip)


def _quantized(linear: nn.Linear, quant_type, compute_dtype, blocksize, compress_statistics, threshold) -> nn.Module:
    from q4torch.nn import Int8Params, Linear4bit, Linear8bitLt, Params4bit

    device = linear.weight.device
    weight = linear.weight.detach()
    if quant_type == "int8":
        new = Linear8bitLt(
            linear.in_features,
            linear.out_features,
            bias=linear.bias is not None,
            has_fp16_weights=False,
            threshold=threshold,
            device="meta",
        )
        new.weight = Int8Params(weight.clone(), requires_grad=False, has_fp16_weights=False)
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
        new.weight = Params4bit(
            weight.clone(),
            requires_grad=False,
            blocksize=blocksize,
            compress_statistics=compress_statistics,
            quant_type=quant_type,
            module=new,
        )
    if linear.bias is not None:
        new.bias = nn.Parameter(linear.bias.detach().clone(), requires_grad=linear.bias.requires_grad)
    return new.to(device)


def replace_linear(
    model: nn.Module,
    quant_type: str = "nf4",
    *,
    compute_dtype: torch.dtype | None = None,
    blocksize: int = 64,
    compress_statistics: bool = True,
    threshold: float = 0.0,
    skip=("lm_head",),
) -> nn.Module:
    """Replace every ``nn.Linear`` of ``model`` in place by a quantized layer
    (``Linear4bit`` for 'nf4'/'fp4', ``Linear8bitLt`` for 'int8'), keeping its
    weights and bias, quantized at once on the layer's device.

    ``skip`` holds module names or glob patterns (matched against the full
    dotted name and the last component). A module registered under several
    names (tied) is replaced once, by one shared quantized layer. What was
    replaced is logged (logger "q4torch", INFO); returns ``model``.
    """
    if quant_type not in QUANT_TYPES:
        raise ValueError(f"quant_type must be one of {QUANT_TYPES}, got {quant_type!r}")
    if quant_type != "int8":
        q4.check_blocksize(blocksize)
    if isinstance(skip, str):
        skip = (skip,)
    replaced: dict[int, nn.Module] = {}
    names: list[str] = []
    before = after = 0
    for parent_name, parent in list(model.named_modules(remove_duplicate=False)):
        for child_name, child in list(parent._modules.items()):
            name = f"{parent_name}.{child_name}" if parent_name else child_name
            if type(child) is not nn.Linear or _skipped(name, skip):
                continue
            if id(child) not in replaced:
                new = _quantized(child, quant_type, compute_dtype, blocksize, compress_statistics, threshold)
                replaced[id(child)] = new
                before += child.weight.numel() * child.weight.element_size()
                after += sum(t.numel() * t.element_size() for t in new.state_dict().values())
                names.append(name)
            setattr(parent, child_name, replaced[id(child)])
    logger.info(
        "replace_linear(%s): replaced %d nn.Linear layers (%s); weights %.2f MiB -> %.2f MiB",
        quant_type,
        len(names),
        ", ".join(names) if len(names) <= 8 else f"{', '.join(names[:8])}, ...",
        before / 2**20,
        after / 2**20,
    )
    return model
