"""replace_linear: swap every nn.Linear of a model for a quantized layer;
load_quantized: load a quantized checkpoint into a float model."""

from __future__ import annotations

import fnmatch
import logging
import os
from collections.abc import Mapping

import numpy as np
import torch
from torch import nn

import q4
from q4._src import formats, quantizers
from q4._src.report import EMBEDDINGS_OFF, SKIP_RULE, QuantizeReport, ReportRow
from q4torch._src.embedding import Embedding4bit, Embedding8bit, StableEmbedding, quantized_embedding
from q4torch._src.linear4bit import Linear4bit
from q4torch._src.linear8bit import Linear8bitLt
from q4torch._src.quantize import quantized_linear

logger = logging.getLogger("q4torch")

QUANT_TYPES = formats.LAYER_TYPES  # (the name q4torch has exported)


def _skipped(name: str, skip) -> bool:
    last = name.rsplit(".", 1)[-1]
    return any(fnmatch.fnmatchcase(name, pat) or fnmatch.fnmatchcase(last, pat) for pat in skip)


def replace_linear(
    model: nn.Module,
    quant_type: str = "nf4",
    *,
    compute_dtype: torch.dtype | None = None,
    blocksize: int = 64,
    compress_statistics: bool = True,
    threshold: float = 0.0,
    skip=("lm_head",),
    activation_quant: str | None = None,
    embeddings: bool = False,
    method: str = "absmax",
    calibration=None,
    gptq_damp: float = 0.01,
    strict: bool = False,
    return_report: bool = False,
):
    """Replace every ``nn.Linear`` of ``model`` in place by a quantized layer
    (``Linear4bit`` for 'nf4'/'fp4', ``Linear8bitLt`` for 'int8'), keeping its
    weights and bias, quantized at once on the layer's device.

    ``skip`` holds module names or glob patterns (matched against the full
    dotted name and the last component). A module registered under several
    names (tied) is replaced once, by one shared quantized layer. What was
    replaced is logged (logger "q4torch", INFO); returns ``model``.
    ``activation_quant='int8'`` makes the 4-bit layers W4A8 (README "W4A8";
    every replaced layer's in_features must be a multiple of its block).

    ``embeddings=True`` also replaces every ``nn.Embedding`` (same skip rules)
    by an ``Embedding4bit`` with the same quant_type, blocksize and
    compress_statistics, or an ``Embedding8bit`` for 'int8'.

    ``method`` chooses the 4-bit scales and codes (the bytes stay
    bitsandbytes' format; README "Better 4-bit at the same bytes"): 'absmax'
    (bitsandbytes' quantizer, the default), 'mse' (per-block scale search,
    no data) or 'gptq' (GPTQ with each layer's inputs over ``calibration``,
    an iterable of model inputs: a tensor, a tuple of positional arguments,
    or a dict of keyword arguments, whose 'attention_mask', if any, leaves
    padding tokens out). One calibration pass runs the float model first.
    ``gptq_damp``: the damping added to each Hessian's diagonal, as a
    fraction of its mean (GPTQ's 0.01 by default; with little calibration
    data a larger value can do better, README "Better 4-bit at the same bytes").

    Nothing is left float in silence: with ``return_report=True`` the call returns
    ``(model, q4.QuantizeReport)``, listing each layer replaced and each
    weight-bearing layer or float parameter of two or more axes left float, with the
    reason: skip rule, embeddings=False, a subclass of nn.Linear / nn.Embedding (its
    forward and attributes are its own: not replaced), a W4A8 layer whose in_features
    is not a multiple of its block, or a layer type q4torch does not quantize
    (transformers' Conv1D, convolutions). Leftovers no option asked for are logged at
    WARNING; ``strict=True`` raises a ValueError naming them.
    """
    formats.check_layer_options(quant_type, blocksize, activation_quant)
    quantizers.check_method_options(method, quant_type, calibration, gptq_damp)
    if isinstance(skip, str):
        skip = (skip,)
    hessians = _calibrate(model, skip, calibration, blocksize) if method == "gptq" else {}
    replaced: dict[int, nn.Module] = {}
    names: list[str] = []
    report = QuantizeReport()
    seen: set[int] = set()
    before = after = 0
    for parent_name, parent in list(model.named_modules(remove_duplicate=False)):
        for child_name, child in list(parent._modules.items()):
            name = f"{parent_name}.{child_name}" if parent_name else child_name
            reason = _left_float(child, name, skip, embeddings)
            if reason is not None:
                if id(child) not in seen:
                    report.left_float.append(ReportRow(name, type(child).__name__, reason))
                seen.add(id(child))
                continue
            is_embedding = type(child) is nn.Embedding
            if type(child) is not nn.Linear and not is_embedding:
                continue
            if id(child) not in replaced and is_embedding:
                try:
                    replaced[id(child)] = quantized_embedding(child, quant_type, blocksize, compress_statistics)
                except ValueError as e:
                    raise ValueError(f"{name}: {e}") from None
                before += child.weight.numel() * child.weight.element_size()
                after += sum(t.numel() * t.element_size() for t in replaced[id(child)].state_dict().values())
                names.append(name)
                report.quantized.append(ReportRow(name, "Embedding", type(replaced[id(child)]).__name__))
            if id(child) not in replaced:
                if activation_quant is not None:
                    try:
                        formats.check_w4a8_features(child.in_features, blocksize)
                    except ValueError as e:
                        report.left_float.append(ReportRow(name, "Linear", f"activation_quant='int8': {e}"))
                        seen.add(id(child))
                        continue
                try:
                    new = quantized_linear(
                        child,
                        quant_type,
                        compute_dtype,
                        blocksize,
                        compress_statistics,
                        threshold,
                        activation_quant,
                        method,
                        hessians.get(id(child)),
                        gptq_damp,
                    )
                except ValueError as e:
                    raise ValueError(f"{name}: {e}") from None
                replaced[id(child)] = new
                if method != "absmax":
                    logger.info("replace_linear(method=%r): %s (%d layers done)", method, name, len(replaced))
                before += child.weight.numel() * child.weight.element_size()
                after += sum(t.numel() * t.element_size() for t in new.state_dict().values())
                names.append(name)
                report.quantized.append(ReportRow(name, "Linear", f"{type(new).__name__} ({quant_type})"))
            setattr(parent, child_name, replaced[id(child)])
    _report_float_params(model, report, skip)
    logger.info(
        "replace_linear(%s): replaced %d nn.Linear%s layers (%s); weights %.2f MiB -> %.2f MiB",
        quant_type,
        len(names),
        " / nn.Embedding" if embeddings else "",
        ", ".join(names) if len(names) <= 8 else f"{', '.join(names[:8])}, ...",
        before / 2**20,
        after / 2**20,
    )
    report.log_left_float(logger, "replace_linear")
    if strict:
        report.check_strict("replace_linear", "q4torch quantizes nn.Linear (and nn.Embedding with embeddings=True)")
    return (model, report) if return_report else model


def _q4_layer_types() -> tuple[type, ...]:
    return (Linear4bit, Linear8bitLt, Embedding4bit, Embedding8bit, StableEmbedding)


def _left_float(child: nn.Module, name: str, skip, embeddings: bool) -> str | None:
    """Why replace_linear leaves a weight-bearing child float, or None (it is replaced,
    already quantized, or holds no weight of its own kind)."""
    if isinstance(child, _q4_layer_types()):
        return None
    if isinstance(child, (nn.Linear, nn.Embedding)):
        kind = "nn.Linear" if isinstance(child, nn.Linear) else "nn.Embedding"
        if _skipped(name, skip):
            return SKIP_RULE
        if type(child) not in (nn.Linear, nn.Embedding):
            return f"a subclass of {kind}: its forward and attributes are its own, not replaced"
        if kind == "nn.Embedding" and not embeddings:
            return EMBEDDINGS_OFF
    return None


def _report_float_params(model: nn.Module, report: QuantizeReport, skip) -> None:
    """Float parameters of two or more axes outside every q4 layer and every module
    already reported (transformers' Conv1D, convolutions, raw matrices); a skip rule
    matching the module makes it deliberate."""
    q4_types = _q4_layer_types()
    reported = {r.path for r in report.left_float}
    inside: list[str] = []
    seen: set[int] = set()
    for name, module in model.named_modules():
        if isinstance(module, q4_types) or name in reported:
            inside.append(name + ".")
            continue
        if any((name + ".").startswith(p) for p in inside):
            continue
        for pname, p in module.named_parameters(recurse=False):
            if p.dim() < 2 or not p.is_floating_point() or id(p) in seen:
                continue
            seen.add(id(p))
            path = f"{name}.{pname}" if name else pname
            why = f"a float parameter {tuple(p.shape)} of {type(module).__name__}, not a layer type q4torch quantizes"
            report.left_float.append(
                ReportRow(
                    path, type(module).__name__, SKIP_RULE if _skipped(name, skip) or _skipped(path, skip) else why
                )
            )


def _targets(model: nn.Module, skip) -> dict[int, tuple[str, nn.Linear]]:
    """The nn.Linear layers replace_linear would replace (each once), by id."""
    out: dict[int, tuple[str, nn.Linear]] = {}
    for name, m in model.named_modules(remove_duplicate=False):
        if type(m) is nn.Linear and not _skipped(name, skip):
            out.setdefault(id(m), (name, m))
    return out


# q4jax's name for the same operation (q4jax.quantize_model), so that code
# written for both front ends reads the same; one function, two names.
quantize_model = replace_linear


def _calibrate(model: nn.Module, skip, calibration, blocksize: int) -> dict[int, np.ndarray]:
    """GPTQ's Hessians: sum of x x^T (fp64) of each target layer's inputs over
    the calibration batches, from one eval-mode, no-grad pass of the float
    model (forward hooks; attention_mask rows of 0 left out)."""
    targets = _targets(model, skip)
    quantizers.check_gptq_layers([(name, m.in_features) for name, m in targets.values()], blocksize)
    acc = {i: quantizers.HessianAccumulator(m.in_features) for i, (_, m) in targets.items()}
    mask: list = [None]

    def hook(i):
        def record(module, args):
            acc[i].add(args[0].detach().float().cpu().numpy(), mask[0])

        return record

    handles = [m.register_forward_pre_hook(hook(i)) for i, (_, m) in targets.items()]
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            quantizers.run_calibration(
                model,
                calibration,
                mask,
                lambda m: m.detach().cpu().numpy(),
                lambda msg, *a: logger.info("replace_linear(method='gptq'): " + msg, *a),
            )
    finally:
        for h in handles:
            h.remove()
        model.train(was_training)
    return quantizers.hessians(acc, {i: name for i, (name, _) in targets.items()})


# config attributes that bound a sequence's length, as transformers' configs name them
_POSITION_LIMITS = ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length")


def calibration_hessians(folder, texts: list[str], blocksize: int) -> dict[str, np.ndarray]:
    """GPTQ's Hessians by layer name for the model folder ``folder``, loaded
    float with transformers (``AutoModelForCausalLM`` when its config names a
    causal LM, else ``AutoModel``; layer names then match the checkpoint's
    keys), each text one unpadded batch from the folder's tokenizer; layers
    whose in_features is not a multiple of ``blocksize`` are left out (the
    caller quantizes them otherwise). Progress on the "q4torch" logger."""
    from transformers import AutoConfig, AutoModel, AutoModelForCausalLM, AutoTokenizer

    config = AutoConfig.from_pretrained(folder)
    causal = any(a.endswith("ForCausalLM") for a in (getattr(config, "architectures", None) or []))
    model = (AutoModelForCausalLM if causal else AutoModel).from_pretrained(folder, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(folder)
    batches = [dict(tok(t, return_tensors="pt")) for t in texts]
    limit = next((v for a in _POSITION_LIMITS if isinstance(v := getattr(config, a, None), int) and v > 0), None)
    for i, b in enumerate(batches):
        n = int(b["input_ids"].shape[-1])
        if limit is not None and n > limit:
            raise ValueError(
                f"calibration line {i + 1}: {n} tokens, more than the model's {limit} positions "
                "(max_position_embeddings): shorten or split the line"
            )
    targets = _targets(model, ())
    off_block = tuple(name for name, m in targets.values() if m.in_features % blocksize)
    return {targets[i][0]: h for i, h in _calibrate(model, off_block, batches, blocksize).items()}


def _to_torch(value) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        return value
    arr = np.asarray(value)
    if arr.dtype.name == "bfloat16":  # ml_dtypes, as q4.checkpoint returns it
        return torch.from_numpy(arr.view(np.uint16).copy()).view(torch.bfloat16)
    return torch.from_numpy(arr.copy())


class _NumpyView(Mapping):
    """A state dict seen as numpy arrays, converted on access (only the
    quantized layers' entries are read)."""

    def __init__(self, d: Mapping):
        self._d = d

    def __getitem__(self, key):
        v = self._d[key]
        return v.detach().cpu().numpy() if isinstance(v, torch.Tensor) else v

    def __iter__(self):
        return iter(self._d)

    def __len__(self) -> int:
        return len(self._d)


def load_quantized(model: nn.Module, checkpoint, *, strict: bool = True) -> nn.Module:
    """Load a quantized checkpoint into a float model, in place.

    ``checkpoint`` is a path (a safetensors file, a sharded checkpoint's
    ``*.index.json``, or a model folder as ``q4 quantize DIR OUT`` writes) or
    a state dict of tensors / numpy arrays in the bitsandbytes format; entries
    naming one of the model's non-persistent buffers are ignored. Every ``nn.Linear`` that the checkpoint stores quantized is first
    replaced by a ``Linear4bit`` / ``Linear8bitLt``, and every ``nn.Embedding``
    it stores quantized (``q4 quantize --embeddings``) by an ``Embedding4bit`` /
    ``Embedding8bit``, built with the file's quant type, block size and
    nesting; then the whole state dict is loaded (``strict`` as in
    ``load_state_dict``). A quantized layer the model has as neither is a
    ValueError naming it. Returns ``model``.
    """
    if isinstance(checkpoint, (str, os.PathLike)):
        checkpoint = q4.checkpoint.load_checkpoint(checkpoint)
    if not isinstance(checkpoint, Mapping):
        raise TypeError(f"checkpoint must be a path or a state dict, got {type(checkpoint).__name__}")
    # entries for the model's non-persistent buffers (transformers' position_ids,
    # saved by older versions) are not state: load_state_dict would call them unexpected
    transient = {
        f"{name}.{b}" if name else b for name, m in model.named_modules() for b in m._non_persistent_buffers_set
    }
    checkpoint = {k: v for k, v in checkpoint.items() if k not in transient}
    groups = q4.checkpoint.quantized_groups(_NumpyView(checkpoint))
    modules = dict(model.named_modules(remove_duplicate=False))
    wanted = {name for names in groups.values() for name in names}
    plain = (nn.Linear, nn.Embedding)
    unknown = sorted(n for n in wanted if type(modules.get(n)) not in plain and not _is_quantized(modules.get(n)))
    if unknown:
        raise ValueError(
            f"the checkpoint quantizes layers this model does not have as nn.Linear or nn.Embedding: {unknown}"
        )
    replaced: dict[int, nn.Module] = {}
    for (quant_type, blocksize, nested), names in groups.items():
        for name in names:
            linear = modules[name]
            if type(linear) not in plain:
                continue  # already quantized: load_state_dict takes the checkpoint's format
            if id(linear) not in replaced:
                replaced[id(linear)] = (
                    quantized_embedding(linear, quant_type, blocksize or 64, bool(nested))
                    if type(linear) is nn.Embedding
                    else quantized_linear(linear, quant_type, None, blocksize or 64, bool(nested), 0.0)
                )
            model.set_submodule(name, replaced[id(linear)])
    model.load_state_dict({k: _to_torch(v) for k, v in checkpoint.items()}, strict=strict)
    return model


def _is_quantized(module) -> bool:
    return isinstance(module, (Linear4bit, Linear8bitLt, Embedding4bit, Embedding8bit))
