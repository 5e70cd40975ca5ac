"""transformers integration: q4 as a quantization method of ``from_pretrained``.

Importing this module (``import q4torch.hf``, or touching ``q4torch.Q4Config``)
registers, through transformers' public registration API, the method "q4"
(:class:`Q4Config`, :class:`Q4HfQuantizer`), and makes q4 the backend of the
"bitsandbytes" method too (4-bit and 8-bit): folders that bitsandbytes or
``q4 quantize`` wrote load into q4torch layers, with or without the
bitsandbytes package (:func:`use_for_bitsandbytes` / :func:`restore_bitsandbytes`).

The bytes on disk are bitsandbytes' format, so a folder that q4 saves says so:
``Q4Config.to_dict()`` (what ``save_pretrained`` writes into config.json) is
the equivalent bitsandbytes config. transformers with bitsandbytes loads such a
folder correctly; transformers without bitsandbytes and without q4 refuses it
(it asks for bitsandbytes); nothing loads it as floats.

Data flow on load: transformers builds the model on the meta device;
``_process_model_before_weight_loading`` swaps each ``nn.Linear`` (or GPT-2's
Conv1D) for a q4torch ``Linear4bit`` / ``Linear8bitLt`` on meta; then each
float weight, as it is read from its shard, is quantized by :class:`Q4Quantize`
(one tensor at a time: the float model never exists whole), or a pre-quantized
weight's checkpoint entries are validated and assembled by
:class:`Q4Deserialize`.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import re
from typing import Any

import torch
from torch import nn
from transformers import BitsAndBytesConfig
from transformers.core_model_loading import ConversionOps
from transformers.quantizers import HfQuantizer, register_quantization_config, register_quantizer
from transformers.quantizers import auto as hf_auto
from transformers.quantizers.quantizers_utils import get_module_from_name, should_convert_module
from transformers.utils.quantization_config import QuantizationConfigMixin

import q4
from q4._src import formats, pages, quantizers
from q4._src.quant_state import JSON_KEY_PREFIX
from q4torch._src.quantize import dequantized_weight, quantized_linear, quantized_weight

METHOD = "q4"
_BNB_METHODS = ("bitsandbytes_4bit", "bitsandbytes_8bit")
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_STORAGE = {"uint8": torch.uint8, "int8": torch.int8, "float16": torch.float16, "bfloat16": torch.bfloat16,
            "float32": torch.float32}  # fmt: skip


def _dtype(value, what: str) -> torch.dtype | None:
    if value is None or isinstance(value, torch.dtype):
        return value
    name = str(value).removeprefix("torch.")
    table = _STORAGE if what == "quant_storage" else _DTYPES
    if name not in table:
        raise ValueError(f"{what} must be one of {sorted(table)}, got {value!r}")
    return table[name]


def _skip_patterns(patterns, what: str) -> tuple[str, ...] | None:
    """``patterns`` as a tuple of the module names / regular expressions that
    transformers matches (a prefix at a module boundary, a regex, or a
    suffix), or ValueError naming the entry that is not a regex (a glob such
    as '*lm_head', which q4torch.replace_linear takes, is not one)."""
    if patterns is None:
        return None
    if isinstance(patterns, str):
        raise TypeError(f"{what} must be a list of module names, got the string {patterns!r}")
    out = tuple(patterns)
    for p in out:
        if not isinstance(p, str):
            raise TypeError(f"{what} entries must be strings, got {p!r}")
        try:
            re.compile(p)
        except re.error as e:
            hint = f" (a glob? write {p.lstrip('*')!r} or {'.*' + p.lstrip('*')!r})" if "*" in p else ""
            raise ValueError(
                f"{what} entry {p!r} is not a regular expression ({e}); transformers matches module names by "
                f"prefix, regex or suffix{hint}"
            ) from None
    return out


@dataclasses.dataclass(frozen=True)
class Settings:
    """What the quantizer does, whichever config (Q4Config or
    BitsAndBytesConfig) described it."""

    quant_type: str  # 'nf4' | 'fp4' | 'int8'
    blocksize: int = 64
    compress_statistics: bool = True
    compute_dtype: torch.dtype | None = None
    quant_storage: torch.dtype = torch.uint8
    threshold: float = 6.0
    skip_modules: tuple[str, ...] | None = None
    activation_quant: str | None = None
    method: str = "absmax"  # 4-bit scales: 'absmax' (bitsandbytes') or 'mse'
    quantize_head: bool = False  # the output head quantized too (a tied one from the embedding's weight)

    @classmethod
    def of(cls, config: QuantizationConfigMixin) -> Settings:
        if isinstance(config, Q4Config):
            return config.settings
        if isinstance(config, BitsAndBytesConfig):
            if config.llm_int8_has_fp16_weight:
                raise ValueError(
                    "q4 serves bitsandbytes configs with llm_int8_has_fp16_weight=False only (a frozen int8 "
                    "weight); load the float model and train it, or quantize afterwards"
                )
            skip = _skip_patterns(config.llm_int8_skip_modules, "llm_int8_skip_modules")
            if config.load_in_8bit:
                return cls("int8", threshold=float(config.llm_int8_threshold), skip_modules=skip)
            formats.check_quant_type(config.bnb_4bit_quant_type)
            return cls(
                config.bnb_4bit_quant_type,
                compress_statistics=bool(config.bnb_4bit_use_double_quant),
                compute_dtype=_dtype(config.bnb_4bit_compute_dtype, "compute_dtype"),
                quant_storage=_dtype(config.bnb_4bit_quant_storage, "quant_storage") or torch.uint8,
                skip_modules=skip,
            )
        raise TypeError(f"q4 cannot serve a {type(config).__name__}")

    def bitsandbytes_dict(self) -> dict[str, Any]:
        """The equivalent bitsandbytes quantization_config (config.json form)."""
        skip = list(self.skip_modules) if self.skip_modules is not None else ([] if self.quantize_head else None)
        qc = q4.checkpoint.bitsandbytes_quantization_config(
            self.quant_type, nested=self.compress_statistics, skip_modules=skip, threshold=self.threshold
        )
        if self.quant_type != "int8":
            qc["bnb_4bit_compute_dtype"] = str(self.compute_dtype or torch.float32).removeprefix("torch.")
            qc["bnb_4bit_quant_storage"] = str(self.quant_storage).removeprefix("torch.")
        return qc


@register_quantization_config(METHOD)
class Q4Config(QuantizationConfigMixin):
    """Quantize a transformers model with q4 while it loads:
    ``AutoModel.from_pretrained(path, quantization_config=q4torch.Q4Config("nf4"))``.

    ``quant_type`` 'nf4' | 'fp4' (``Linear4bit``, blockwise ``blocksize``,
    nested absmax when ``compress_statistics``) or 'int8' (``Linear8bitLt``,
    LLM.int8 with outlier ``threshold``; 0 disables outliers).
    ``skip_modules``: module names kept in full precision (transformers'
    matching: a prefix at a module boundary, a regex, or a suffix; an entry
    that is not a regex, such as the glob '*lm_head', is refused); None keeps
    transformers' default (the output head). ``compute_dtype`` and
    ``activation_quant`` ('int8': W4A8) as for ``q4torch.nn.Linear4bit``;
    ``method='mse'`` chooses each block's scale by error (same format).
    ``quantize_head=True`` quantizes the output head too: at batch 1 a float head
    is the largest read of a decoder's token (Llama-3.2-1B: 525 MB in bf16, all its
    4-bit linears together 486 MB). A head tied to the input embedding is untied:
    the embedding stays float for its lookups, the head holds the quantized copy
    (``config.tie_word_embeddings`` becomes False, so the saved folder stores
    ``lm_head.weight`` quantized and reloads as it is).

    The layers, bytes and results are those of ``q4torch.replace_linear`` with
    the same arguments. ``save_pretrained`` writes the bitsandbytes format and,
    in config.json, the equivalent bitsandbytes config (``to_dict``); loading
    that folder needs q4torch.hf imported or bitsandbytes installed.
    """

    def __init__(
        self,
        quant_type: str = "nf4",
        blocksize: int = 64,
        compress_statistics: bool = True,
        compute_dtype: torch.dtype | str | None = None,
        threshold: float = 6.0,
        skip_modules: list[str] | None = None,
        activation_quant: str | None = None,
        quant_storage: torch.dtype | str = torch.uint8,
        method: str = "absmax",
        quantize_head: bool = False,
        **kwargs: Any,
    ):
        self.quant_method = METHOD  # type: ignore[assignment]  # transformers' enum has no member for it
        formats.check_layer_options(quant_type, blocksize, activation_quant)
        formats.check_threshold(threshold)
        if method == "gptq":
            raise ValueError(
                "Q4Config method must be 'absmax' or 'mse', got 'gptq' (it needs calibration: "
                "q4torch.replace_linear(model, method='gptq', calibration=...))"
            )
        quantizers.check_method_options(method, quant_type, None)
        unknown = sorted(set(kwargs) - {"q4", "quant_method"})
        if unknown:
            raise TypeError(f"Q4Config got unexpected arguments {unknown}")
        self.settings = Settings(
            quant_type,
            blocksize=int(blocksize),
            compress_statistics=bool(compress_statistics),
            compute_dtype=_dtype(compute_dtype, "compute_dtype"),
            quant_storage=_dtype(quant_storage, "quant_storage") or torch.uint8,
            threshold=float(threshold),
            skip_modules=_skip_patterns(skip_modules, "skip_modules"),
            activation_quant=activation_quant,
            method=method,
            quantize_head=bool(quantize_head),
        )

    def __getattr__(self, name: str):
        settings = self.__dict__.get("settings")
        if settings is not None and name in Settings.__dataclass_fields__:
            return getattr(settings, name)
        raise AttributeError(f"'Q4Config' object has no attribute {name!r}")

    @classmethod
    def from_dict(cls, config_dict: dict, return_unused_kwargs: bool = False, **kwargs):
        d = {k: v for k, v in {**config_dict, **kwargs}.items() if k != "quant_method"}
        config = cls(**d)
        return (config, {}) if return_unused_kwargs else config

    def to_dict(self) -> dict[str, Any]:
        """The equivalent bitsandbytes config, plus q4's own settings under
        "q4" (ignored by bitsandbytes): the file is bitsandbytes' format."""
        s = self.settings
        qc = s.bitsandbytes_dict()
        qc["q4"] = {
            "quant_type": s.quant_type,
            "blocksize": s.blocksize,
            "activation_quant": s.activation_quant,
            "method": s.method,
            "quantize_head": s.quantize_head,
        }
        return qc

    def __repr__(self) -> str:
        return f"Q4Config({self.settings})"


def _release_float(value: torch.Tensor) -> None:
    """The float weight's pages in the checkpoint's mapping, back to the system once it is
    quantized (q4/_src/pages.py): transformers keeps the file mapped while the model holds
    any float tensor of it, and every page read would stay resident."""
    if value.device.type == "cpu" and value.is_contiguous():
        pages.release(value.data_ptr(), value.numel() * value.element_size())


def _layer_kind():
    from q4torch.nn import Linear4bit, Linear8bitLt

    return Linear4bit, Linear8bitLt


class Q4Quantize(ConversionOps):
    """A float weight, as read from its shard, quantized into its q4 layer."""

    def __init__(self, hf_quantizer: Q4HfQuantizer):
        self.hf_quantizer = hf_quantizer

    def convert(self, input_dict, full_layer_name=None, model=None, **kwargs):
        s = self.hf_quantizer.settings
        result = {}
        for name, value in input_dict.items():
            value = value[0] if isinstance(value, list) else value
            module, _ = get_module_from_name(model, name)
            if getattr(module, "source_is_conv1d", False):  # GPT-2's Conv1D stores [in, out]
                value = value.T
            if tuple(value.shape) != (module.out_features, module.in_features):
                raise ValueError(
                    f"{name}: the checkpoint's weight has shape {tuple(value.shape)}, the layer expects "
                    f"{(module.out_features, module.in_features)}"
                )
            try:
                result[name] = quantized_weight(
                    module, value, s.blocksize, s.compress_statistics, s.quant_type, s.quant_storage, method=s.method
                )
            except ValueError as e:
                raise ValueError(f"{name}: {e}") from None
            module._is_hf_initialized = True
            _release_float(value)
        return result


class Q4Deserialize(ConversionOps):
    """A pre-quantized weight from its checkpoint entries (bitsandbytes keys):
    validated, copied (never aliased), into the q4 layer."""

    def __init__(self, hf_quantizer: Q4HfQuantizer):
        self.hf_quantizer = hf_quantizer

    def convert(self, input_dict, model=None, full_layer_name=None, **kwargs):
        from q4torch._src.linear8bit import check_weight_format
        from q4torch.nn import Int8Params, Linear8bitLt, Params4bit

        entries = {k: (v[0] if isinstance(v, list) else v) for k, v in input_dict.items()}
        module, tensor_name = get_module_from_name(model, full_layer_name)
        if not isinstance(module, _layer_kind()):
            # any other module's "weight" (a norm, an embedding, a skipped linear)
            stored = sorted(k for k in entries if k == "SCB" or JSON_KEY_PREFIX in k)
            if stored:
                raise ValueError(
                    f"{full_layer_name}: the checkpoint stores this layer quantized ({', '.join(stored)}), but it is "
                    f"kept as a float {type(module).__name__} (skip_modules / llm_int8_skip_modules names it, or "
                    "q4 cannot quantize it): remove it from skip_modules, or load the float model and quantize "
                    "it with the skip"
                )
            # transformers casts only what no quantizer op touches: this float weight gets the model's dtype here
            target = module._parameters.get(tensor_name, module._buffers.get(tensor_name))
            return {
                k: v.to(target.dtype)
                if target is not None
                and target.is_floating_point()
                and v.is_floating_point()
                and v.dtype != target.dtype
                else v
                for k, v in entries.items()
            }
        weight = entries.pop("weight", None)
        if weight is None:
            raise ValueError(f"{full_layer_name}: the checkpoint has no 'weight' entry, only {sorted(entries)}")
        if isinstance(module, Linear8bitLt):
            if "SCB" not in entries:
                raise ValueError(f"{full_layer_name}: an int8 weight needs its 'SCB' (row scales) entry")
            errs: list[str] = []
            if "weight_format" in entries:
                check_weight_format({"weight_format": entries["weight_format"]}, "weight_format", errs)
            if errs:
                raise ValueError(f"{full_layer_name}: {'; '.join(errs)}")
            if weight.dtype != torch.int8 or tuple(weight.shape) != (module.out_features, module.in_features):
                raise ValueError(
                    f"{full_layer_name}: expected an int8 weight of shape {(module.out_features, module.in_features)},"
                    f" got {weight.dtype} {tuple(weight.shape)}"
                )
            scb = entries["SCB"]
            if scb.dtype != torch.float32 or tuple(scb.shape) != (module.out_features,):
                raise ValueError(
                    f"{full_layer_name}: expected SCB float32 of shape ({module.out_features},), "
                    f"got {scb.dtype} {tuple(scb.shape)}"
                )
            new: nn.Parameter = Int8Params(weight.clone(), requires_grad=False, has_fp16_weights=False, SCB=scb.clone())
        else:
            stats = {k.removeprefix("weight."): v for k, v in entries.items()}
            if not any(k.startswith(JSON_KEY_PREFIX) for k in stats):
                raise ValueError(
                    f"{full_layer_name}: a 4-bit weight needs its quant_state entries, found only {sorted(entries)}"
                )
            new = Params4bit.from_prequantized(weight, stats, requires_grad=False, device=weight.device, module=module)
            shape = tuple(new.quant_state.shape)
            if shape != (module.out_features, module.in_features):
                raise ValueError(
                    f"{full_layer_name}: the checkpoint quantizes a weight of shape {shape}, the layer expects "
                    f"{(module.out_features, module.in_features)}"
                )
        module._is_hf_initialized = True
        return {"weight": new}


def _check_stored_layers(model, checkpoint_files) -> None:
    """Every q4 layer of a model loaded from a pre-quantized folder must find
    its weight in the safetensors files: a missing one cannot be initialised
    at random (packed bytes), so it is named here, before anything loads."""
    from safetensors import safe_open

    files = [str(f) for f in checkpoint_files or () if str(f).endswith(".safetensors")]
    if not files or len(files) != len(checkpoint_files):
        return  # (other formats: transformers' own report)
    stored: set[str] = set()
    for f in files:
        with safe_open(f, "pt") as h:
            stored.update(k[: -len(".weight")] for k in h.keys() if k.endswith(".weight"))
    missing = []
    for name, module in model.named_modules():
        if not isinstance(module, _layer_kind()) or name in stored:
            continue
        # (a checkpoint of the base model under a head model's prefix, or the other way round)
        if not any(s.endswith("." + name) or name.endswith("." + s) for s in stored):
            missing.append(name)
    if missing:
        more = f" and {len(missing) - 3} more" if len(missing) > 3 else ""
        raise ValueError(
            f"the checkpoint has no weight for the quantized layers {', '.join(repr(m) for m in missing[:3])}{more} "
            f"(no '<layer>.weight' in {', '.join(files)}): a quantized layer cannot be initialised at random; "
            "complete the checkpoint, or keep those layers float with skip_modules / llm_int8_skip_modules"
        )


def _realign(model) -> None:
    """A q4 layer's tensors that a file maps at an offset that is not a
    multiple of their element size (folders that older q4 versions wrote) are copied: the kernels read aligned elements only."""
    for module in model.modules():
        if not isinstance(module, _layer_kind()):
            continue
        for p in list(module.parameters(recurse=False)):
            if p.device.type != "meta" and p.data_ptr() % p.element_size():
                p.data = p.data.clone()
        qs = getattr(module.weight, "quant_state", None)
        for holder, attr in ((qs, "absmax"), (qs, "offset"), (getattr(qs, "state2", None), "absmax")):
            t = getattr(holder, attr, None) if holder is not None else None
            if isinstance(t, torch.Tensor) and t.device.type != "meta" and t.data_ptr() % t.element_size():
                setattr(holder, attr, t.clone())


def _tied(model) -> bool:
    cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    return bool(getattr(cfg, "tie_word_embeddings", False))


def _head_name(model) -> str | None:
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if not isinstance(head, nn.Linear):
        return None
    return next((name for name, m in model.named_modules() if m is head), None)


def _quantize_tied_head(model, name: str, s: Settings) -> None:
    """Replace the tied output head ``name`` by a q4 layer quantized from its (the input
    embedding's) weight and untie it: the embedding keeps the float table for lookups."""
    head = model.get_submodule(name)
    float_head = nn.Linear(head.in_features, head.out_features, bias=head.bias is not None, device="meta")
    float_head.weight = nn.Parameter(head.weight.detach(), requires_grad=False)
    if head.bias is not None:
        float_head.bias = head.bias
    new = quantized_linear(
        float_head, s.quant_type, s.compute_dtype, s.blocksize, s.compress_statistics, s.threshold, s.activation_quant,
        s.method,
    )  # fmt: skip
    new.requires_grad_(False)
    _release_float(head.weight.detach())  # the embedding's pages: a lookup reads back only its rows
    for cfg in {id(c): c for c in (model.config, model.config.get_text_config())}.values():
        cfg.tie_word_embeddings = False
    model.set_submodule(name, new)


class Q4HfQuantizer(HfQuantizer):
    """transformers' quantizer for q4 (and, once registered for it, for
    bitsandbytes configs): q4torch layers, q4's kernels, bitsandbytes' bytes."""

    requires_calibration = False

    def __init__(self, quantization_config: QuantizationConfigMixin, **kwargs: Any):
        super().__init__(quantization_config, **kwargs)
        self.settings = Settings.of(quantization_config)
        self.modules_to_not_convert: list[str] = []
        int8 = self.settings.quant_type == "int8"
        self.serialized_names = (
            {"weight": ["weight", "SCB", "weight_format"]}
            if int8
            else {
                "weight": [
                    "weight",
                    "weight.absmax",
                    "weight.quant_map",
                    "weight.nested_absmax",
                    "weight.nested_quant_map",
                    *(f"weight.{JSON_KEY_PREFIX}{qt}" for qt in formats.QUANT_TYPES),
                ]
            }
        )

    @property
    def quantized_element_size(self) -> float:
        return 1.0 if self.settings.quant_type == "int8" else 0.5

    def update_device_map(self, device_map):
        return {"": "cpu"} if device_map is None else device_map

    def param_needs_quantization(self, model, param_name: str, **kwargs) -> bool:
        module, name = get_module_from_name(model, param_name)
        return isinstance(module, _layer_kind()) and name == "weight"

    def _process_model_before_weight_loading(self, model, device_map=None, **kwargs):
        from transformers.pytorch_utils import Conv1D

        from q4torch.nn import Linear4bit, Linear8bitLt, Params4bit

        s = self.settings
        skip = None if s.skip_modules is None else list(s.skip_modules)
        if s.quantize_head and skip is None:
            skip = []
        self.modules_to_not_convert = self.get_modules_to_not_convert(model, skip, model._keep_in_fp32_modules)
        # a head tied to the input embedding loads as that float weight: it stays an nn.Linear
        # while loading and is quantized from it afterwards (_process_model_after_weight_loading)
        self.tied_head = None
        if not self.pre_quantized and _tied(model):
            head = _head_name(model)
            if head is not None and should_convert_module(head, self.modules_to_not_convert):
                self.tied_head = head
                self.modules_to_not_convert = [*self.modules_to_not_convert, head]
        replaced = 0
        for name, module in list(model.named_modules()):
            if not (type(module) is nn.Linear or isinstance(module, Conv1D)):
                continue
            if not should_convert_module(name, self.modules_to_not_convert):
                continue
            if isinstance(module, Conv1D):
                k, n = module.weight.shape
            else:
                k, n = module.in_features, module.out_features
            has_bias = module.bias is not None
            if s.activation_quant is not None:
                try:
                    formats.check_w4a8_features(k, s.blocksize)
                except ValueError as e:
                    raise ValueError(
                        f"{name}: {e}; skip it (skip_modules=...) or leave activation_quant unset"
                    ) from None
            with torch.device("meta"):
                new: nn.Module
                if s.quant_type == "int8":
                    # (a pre-quantized weight stays a float placeholder until Q4Deserialize
                    # assembles weight + SCB: the meta model's state dict names only weight)
                    new = Linear8bitLt(k, n, has_bias, has_fp16_weights=False, threshold=s.threshold)
                else:
                    new4 = Linear4bit(
                        k,
                        n,
                        has_bias,
                        compute_dtype=s.compute_dtype,
                        compress_statistics=s.compress_statistics,
                        quant_type=s.quant_type,
                        quant_storage=s.quant_storage,
                        activation_quant=s.activation_quant,
                    )
                    new4.weight = Params4bit(
                        new4.weight.data.to(s.quant_storage) if self.pre_quantized else new4.weight.data,
                        requires_grad=False,
                        blocksize=s.blocksize,
                        compress_statistics=s.compress_statistics,
                        quant_type=s.quant_type,
                        quant_storage=s.quant_storage,
                        module=new4,
                    )
                    new = new4
            new.source_is_conv1d = isinstance(module, Conv1D)
            new.requires_grad_(False)
            model.set_submodule(name, new)
            replaced += 1
        if replaced == 0:
            raise ValueError(
                f"q4 found no nn.Linear layer to quantize in this model (skip_modules: {self.modules_to_not_convert})"
            )
        if self.pre_quantized:
            _check_stored_layers(model, kwargs.get("checkpoint_files"))
        return model

    def _process_model_after_weight_loading(self, model, **kwargs):
        _realign(model)
        if getattr(self, "tied_head", None) is not None:
            _quantize_tied_head(model, self.tied_head, self.settings)
        setattr(model, "is_loaded_in_8bit" if self.settings.quant_type == "int8" else "is_loaded_in_4bit", True)
        return model

    def is_serializable(self) -> bool:
        return True

    @property
    def is_trainable(self) -> bool:
        return True

    def _dequantize(self, model, dtype=None):
        return dequantize_model(model, dtype)

    def get_quantize_ops(self):
        return Q4Quantize(self)

    def get_load_operations(self):
        return {"deserialize": Q4Deserialize}


def dequantize_model(model: nn.Module, dtype: torch.dtype | None = None) -> nn.Module:
    """Every q4torch ``Linear4bit`` / ``Linear8bitLt`` of ``model`` replaced, in
    place, by an ``nn.Linear`` holding its dequantized weight (in ``dtype``,
    fp32 by default) and its bias. Returns ``model``."""
    for name, module in list(model.named_modules()):
        if not isinstance(module, _layer_kind()):
            continue
        weight = dequantized_weight(module).to(dtype or torch.float32)
        new = nn.Linear(module.in_features, module.out_features, bias=module.bias is not None, device="meta")
        new.weight = nn.Parameter(weight, requires_grad=False)
        if module.bias is not None:
            new.bias = module.bias
        model.set_submodule(name, new)
    return model


_saved: dict[str, Any] = {}


def use_for_bitsandbytes() -> None:
    """Serve transformers' "bitsandbytes" method (4-bit and 8-bit configs)
    with q4: ``from_pretrained`` of a bitsandbytes-format folder builds q4torch
    layers, whether or not bitsandbytes is installed. Done on import of
    q4torch.hf; undone by :func:`restore_bitsandbytes`."""
    for key in _BNB_METHODS:
        current = hf_auto.AUTO_QUANTIZER_MAPPING[key]
        if current is not Q4HfQuantizer:
            _saved[key] = current
            hf_auto.AUTO_QUANTIZER_MAPPING[key] = Q4HfQuantizer


def restore_bitsandbytes() -> None:
    """Give transformers' "bitsandbytes" method back to bitsandbytes."""
    for key, cls in list(_saved.items()):
        hf_auto.AUTO_QUANTIZER_MAPPING[key] = cls
        del _saved[key]


def serves_bitsandbytes() -> bool:
    """Whether q4 currently serves bitsandbytes-format configs in transformers (use_for_bitsandbytes)."""
    return all(hf_auto.AUTO_QUANTIZER_MAPPING[key] is Q4HfQuantizer for key in _BNB_METHODS)


register_quantizer(METHOD)(Q4HfQuantizer)
use_for_bitsandbytes()

if importlib.util.find_spec("peft") is not None:
    # a plain peft LoraConfig over the layers this loads: merging raises, naming q4torch.peft.register
    import q4torch._src.peft  # noqa: F401, E402
