"""bitsandbytes-shaped functional API over the q4 kernels.

Signatures and defaults follow ``bitsandbytes.functional`` so that code can
switch by changing the import. Results are bit-identical to bitsandbytes'
CPU path for the 4-bit formats; see the README for the nested 8-bit absmax.
"""

from __future__ import annotations

import copy
import math
import warnings
import weakref
from typing import Any

import numpy as np
import torch

import q4
from q4._src import formats, quantizers
from q4._src.quant_state import JSON_KEY_PREFIX
from q4._src.quant_state import QuantState as _NpQuantState
from q4torch._src import ops

__all__ = [
    "QuantState",
    "create_fp8_map",
    "create_linear_map",
    "create_normal_map",
    "gemv_4bit",
    "has_avx512bf16",
    "int8_double_quant",
    "int8_linear",
    "int8_linear_matmul",
    "int8_mm_dequant",
    "int8_vectorwise_dequant",
    "int8_vectorwise_quant",
    "matmul_4bit",
    "dequantize_4bit",
    "dequantize_blockwise",
    "dequantize_fp4",
    "dequantize_nf4",
    "get_4bit_type",
    "create_dynamic_map",
    "quantize_4bit",
    "quantize_blockwise",
    "quantize_fp4",
    "quantize_nf4",
]

_TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
_DTYPE_NAMES = {v: k for k, v in _TORCH_DTYPES.items()}
# read from the kernel library once: check_quant_state runs inside torch.compile
# graphs, where a ctypes call cannot be traced
_MIN_BLOCKSIZE, _MAX_BLOCKSIZE = formats.min_blocksize(), formats.max_blocksize()
_NESTED_BLOCKSIZE = formats.nested_blocksize()
_INV_127 = 1.0 / 127.0  # fp32(1/127), LLM.int8's dequantization
_INV_127_SQ = 1.0 / 16129.0  # fp32(1/127^2)


def get_4bit_type(typename: str, device=None) -> torch.Tensor:
    """The 16-entry code book of 'nf4' or 'fp4' (read from the kernel library)."""
    formats.check_quant_type(typename)
    return torch.from_numpy(formats.code_table(typename).copy()).to(device or "cpu")


def create_dynamic_map(signed=True, max_exponent_bits=7, total_bits=8, device=None) -> torch.Tensor:
    """The dynamic map: 256 sorted values in [-1, 1] (bitsandbytes' signature).
    The default, signed 8-bit map is the kernel library's table; other
    parameters build the generalised map (a dynamic exponent of up to
    max_exponent_bits decimal digits, linearly spaced fractions in [0.1, 1]),
    padded with zeros to 256 values."""
    if isinstance(signed, (torch.device, str)) and device is None:  # create_dynamic_map(device)
        signed, device = True, signed
    if signed is True and max_exponent_bits == 7 and total_bits == 8:
        return torch.from_numpy(formats.code_table("dynamic").copy()).to(device or "cpu")
    if not (1 <= total_bits <= 8) or not (1 <= max_exponent_bits <= total_bits):
        raise ValueError(
            f"create_dynamic_map needs 1 <= total_bits <= 8 and 1 <= max_exponent_bits <= total_bits, "
            f"got total_bits={total_bits}, max_exponent_bits={max_exponent_bits}"
        )
    values: list[float] = []
    fraction_bits = total_bits - 1 - max_exponent_bits  # bits beside the sign and the exponent's indicator
    sides = (1.0, -1.0) if signed else (1.0,)

    def scaled(scale: float, count: int) -> list[float]:
        # fp32 midpoints of `count` equal steps over [0.1, 1], times the scale (in fp32)
        edges = torch.linspace(0.1, 1, count + 1, dtype=torch.float32)
        means = (edges[:-1] + edges[1:]) / 2.0
        return [v for side in sides for v in ((side * scale) * means).tolist()]

    for e in range(max_exponent_bits):
        count = int(2.0 ** (e + fraction_bits + (0 if signed else 1)))  # below 1: none
        values += scaled(10.0 ** (e - (max_exponent_bits - 1)), count)
    extra = int(2**fraction_bits - 1)  # the codes whose exponent bits are all zero
    if extra > 0:
        values += scaled(1.0, extra)  # at the largest exponent's scale
    values += [0.0, 1.0]
    values += [0.0] * (256 - len(values))
    return torch.tensor(sorted(values), dtype=torch.float32, device=device or "cpu")


def create_linear_map(signed=True, total_bits=8, add_zero=True) -> torch.Tensor:
    """2**total_bits evenly spaced values over [-1, 1] (signed) or [0, 1], one
    fewer when signed with add_zero (so that 0 is a value), zero-padded in the
    middle to 256 entries (bitsandbytes' layout)."""
    count = 2**total_bits
    if (add_zero or total_bits < 8) and signed:
        count -= 1
    values = torch.linspace(-1.0 if signed else 0.0, 1.0, count)
    gap = 256 - values.numel()
    if gap == 0:
        return values
    half = values.numel() // 2
    return torch.cat([values[:half], torch.zeros(gap), values[half:]])


def create_normal_map(offset=0.9677083, use_extra_value=True) -> torch.Tensor:
    """The NormalFloat map: quantiles of N(0, 1) at evenly spaced probabilities
    from `offset` to 0.5 (8 positive and 7 negative values with
    use_extra_value, else 7 and 7), zero-padded to 256, sorted, scaled so the
    largest is 1. The default's 16 non-zero-padding values are q4's NF4 table."""
    try:
        from scipy.stats import norm
    except ImportError as e:  # pragma: no cover - scipy is a test dependency
        raise ImportError("create_normal_map needs scipy") from e
    positive = norm.ppf(torch.linspace(offset, 0.5, 9 if use_extra_value else 8)[:-1].numpy()).tolist()
    negative = (-norm.ppf(torch.linspace(offset, 0.5, 8)[:-1].numpy())).tolist()
    values = torch.tensor(positive + [0.0] * (256 - len(positive) - len(negative)) + negative)
    values = values.sort().values
    return values / values.max()


def create_fp8_map(signed=True, exponent_bits=5, precision_bits=2, total_bits=8) -> torch.Tensor:
    """A small floating-point format's values (exponent bias 2**(exponent_bits - 1),
    subnormals at exponent 0), both signs when signed, zero-padded to 256,
    sorted and scaled so the largest is 1 (bitsandbytes' code-book builder; its
    4-bit E2M1 variant is not the FP4 table, whose smallest value differs)."""
    if exponent_bits + precision_bits != total_bits - (1 if signed else 0):
        raise ValueError(
            f"exponent_bits + precision_bits must be total_bits - {1 if signed else 0}, got "
            f"{exponent_bits} + {precision_bits} with total_bits {total_bits}"
        )
    bias = 2 ** (exponent_bits - 1)
    values: list[float] = []
    for e in range(2**exponent_bits):
        for m in range(2**precision_bits):
            fraction = m / 2**precision_bits  # mantissa bits, most significant first
            v = fraction * 2.0**-bias if e == 0 else (1 + fraction) * 2.0 ** -(e - bias - 1)
            values += [v, -v] if signed else [v]
    values += [0.0] * (256 - len(values))
    code = torch.tensor(sorted(values))
    return code / code.max()


class QuantState:
    """Quantization state of a 4-bit (or 8-bit blockwise) tensor, as in bitsandbytes.

    For nested 4-bit states ``absmax`` holds the uint8 codes of
    (absmax - offset), ``offset`` the fp32 mean and ``state2`` the 8-bit state
    (its absmax and the dynamic map).
    """

    valid_quant_types = ("fp4", "nf4")
    valid_qs_type_keys = [f"{JSON_KEY_PREFIX.split('.', 1)[1]}{x}" for x in valid_quant_types]
    valid_qs_keys = [
        "absmax",
        "quant_map",
        "nested_absmax",
        "nested_quant_map",
        "quant_state",
        "quant_type",
        "blocksize",
        "dtype",
        "shape",
        "nested_blocksize",
        "nested_dtype",
        "nested_offset",
    ]

    def __init__(
        self, absmax, shape=None, code=None, blocksize=None, quant_type=None, dtype=None, offset=None, state2=None
    ):
        self.absmax = absmax
        self.shape = shape
        self.code = code
        self.dtype = dtype
        self.blocksize = blocksize
        self.quant_type = quant_type
        self.offset = offset
        self.state2 = state2
        self.nested = state2 is not None

    def __getattr__(self, name):
        # FSDP-style traversal resolves the packed key "quant_state.bitsandbytes__nf4" by getattr.
        if "quant_state." + name in [JSON_KEY_PREFIX + t for t in self.valid_quant_types]:
            packed = self.as_dict(packed=True)
            key = "quant_state." + name
            if key in packed:
                return packed[key]
        raise AttributeError(f"'{type(self).__name__}' object has no attribute '{name}'")

    # ---------------------------------------------------------------- numpy

    def to_numpy(self) -> _NpQuantState:
        """The framework-neutral state (validated)."""
        return _NpQuantState(
            quant_type=self.quant_type,
            blocksize=int(self.blocksize),
            shape=tuple(int(s) for s in self.shape),
            dtype=_DTYPE_NAMES[self.dtype],
            absmax=self.absmax.detach().cpu().numpy(),
            nested_absmax=self.state2.absmax.detach().cpu().numpy() if self.nested else None,
            nested_offset=float(self.offset) if self.nested else None,
            nested_blocksize=int(self.state2.blocksize) if self.nested else formats.nested_blocksize(),
        ).validate()

    @classmethod
    def from_numpy(cls, st: _NpQuantState, device="cpu") -> QuantState:
        st.validate()
        state2 = offset = None
        if st.nested:
            assert st.nested_offset is not None  # validate(): a nested state has its offset
            offset = torch.tensor(float(st.nested_offset), dtype=torch.float32, device=device)
            state2 = cls(
                absmax=torch.from_numpy(np.array(st.nested_absmax)).to(device),
                blocksize=st.nested_blocksize,
                code=create_dynamic_map(device),
                dtype=torch.float32,
            )
        return cls(
            absmax=torch.from_numpy(np.array(st.absmax)).to(device),
            shape=torch.Size(st.shape),
            code=get_4bit_type(st.quant_type, device),
            blocksize=st.blocksize,
            quant_type=st.quant_type,
            dtype=_TORCH_DTYPES[st.dtype],
            offset=offset,
            state2=state2,
        )

    # ---------------------------------------------------------- checkpoints

    @classmethod
    def from_dict(cls, qs_dict: dict[str, Any], device) -> QuantState:
        """Rebuild from checkpoint entries (prefixes such as 'weight.' are stripped).

        Validates every entry; a corrupted or truncated entry raises
        q4.QuantStateError naming it.
        """
        if not any("quant_state." in k for k in qs_dict) and qs_dict.get("quant_type", "") is None:
            return cls._blockwise_from_dict(qs_dict, device)
        if not any("quant_state." in k for k in qs_dict) and "quant_type" in qs_dict:
            # the unpacked form (as_dict(packed=False)): its plain values are what
            # the packed JSON entry holds, so they go through the same checks
            meta = {}
            for k, v in list(qs_dict.items()):
                if not isinstance(v, torch.Tensor):
                    meta[k.split(".")[-1]] = list(v) if isinstance(v, (tuple, torch.Size)) else v
            qs_dict = {k: v for k, v in qs_dict.items() if isinstance(v, torch.Tensor)}
            if not isinstance(meta.get("quant_type"), str) or meta["quant_type"] not in cls.valid_quant_types:
                raise q4.QuantStateError(
                    f"quant_type must be 'nf4' or 'fp4', got {formats.short_repr(meta.get('quant_type'))}"
                )
            try:
                packed_meta = q4._src.quant_state.pack_json(meta)
            except (TypeError, ValueError) as e:
                raise q4.QuantStateError(f"quant state entries are not plain values: {e}") from None
            qs_dict[JSON_KEY_PREFIX + meta["quant_type"]] = torch.from_numpy(packed_meta)
        entries = {}
        for k, v in qs_dict.items():
            key = k if k.startswith("quant_state.") else k.split(".")[-1]
            if "quant_state." in k:
                key = "quant_state." + k.split("quant_state.")[-1]
            entries[key] = v.detach().cpu().numpy() if isinstance(v, torch.Tensor) else np.asarray(v)
        return cls.from_numpy(_NpQuantState.from_dict(entries), device)

    @classmethod
    def _blockwise_from_dict(cls, qs_dict: dict[str, Any], device) -> QuantState:
        """An 8-bit blockwise state from its unpacked as_dict() (quant_type None)."""
        d = {k.split(".")[-1]: v for k, v in qs_dict.items()}
        for key in ("absmax", "quant_map", "blocksize", "dtype"):
            if key not in d:
                raise q4.QuantStateError(f"8-bit blockwise state lacks '{key}'")
        absmax, code = d["absmax"], d["quant_map"]
        if not isinstance(absmax, torch.Tensor) or absmax.dtype != torch.float32 or absmax.dim() != 1:
            raise q4.QuantStateError(f"absmax must be a 1-D float32 tensor, got {formats.short_repr(absmax)}")
        if not isinstance(code, torch.Tensor) or code.dtype != torch.float32 or code.numel() != 256:
            raise q4.QuantStateError(f"quant_map must be 256 float32 values, got {formats.short_repr(code)}")
        if d["dtype"] not in _TORCH_DTYPES:
            raise q4.QuantStateError(
                f"dtype must be float32, float16 or bfloat16, got {formats.short_repr(d['dtype'])}"
            )
        try:
            blocksize = formats.check_blocksize8(d["blocksize"])
        except ValueError as e:
            raise q4.QuantStateError(str(e)) from None
        state2 = offset = None
        if "nested_absmax" in d:
            offset = torch.tensor(float(d["nested_offset"]), dtype=torch.float32, device=device)
            state2 = cls(
                absmax=d["nested_absmax"].to(device),
                blocksize=d["nested_blocksize"],
                code=d["nested_quant_map"].to(device),
                dtype=_TORCH_DTYPES[d.get("nested_dtype", "float32")],
            )
        shape = d.get("shape")
        return cls(
            absmax=absmax.to(device),
            shape=torch.Size(shape) if shape is not None else None,
            code=code.to(device),
            blocksize=blocksize,
            dtype=_TORCH_DTYPES[d["dtype"]],
            offset=offset,
            state2=state2,
        )

    def as_dict(self, packed: bool = False) -> dict[str, Any]:
        """Entries for a state dict; packed=True gives tensors only (safetensors-ready),
        byte-identical to bitsandbytes' packing."""
        qs = {
            "quant_type": self.quant_type,
            "absmax": self.absmax,
            "blocksize": self.blocksize,
            "quant_map": self.code,
            "dtype": _DTYPE_NAMES.get(self.dtype, str(self.dtype).removeprefix("torch.")),
            "shape": tuple(self.shape) if self.shape is not None else None,
        }
        if self.nested:
            qs.update(
                nested_absmax=self.state2.absmax,
                nested_blocksize=self.state2.blocksize,
                nested_quant_map=self.state2.code.clone(),
                nested_dtype=_DTYPE_NAMES.get(self.state2.dtype, str(self.state2.dtype).removeprefix("torch.")),
                nested_offset=float(self.offset),
            )
        if not packed or self.quant_type is None:
            return qs
        out = {k: v for k, v in qs.items() if isinstance(v, torch.Tensor)}
        meta = {k: (list(v) if isinstance(v, tuple) else v) for k, v in qs.items() if not isinstance(v, torch.Tensor)}
        out[JSON_KEY_PREFIX + self.quant_type] = torch.from_numpy(q4._src.quant_state.pack_json(meta))
        return out

    def to(self, device):
        self.code = self.code.to(device)
        self.absmax = self.absmax.to(device)
        if self.nested:
            self.offset = self.offset.to(device)
            self.state2.absmax = self.state2.absmax.to(device)
            self.state2.code = self.state2.code.to(device)

    def __eq__(self, other):
        if not isinstance(other, QuantState):
            return False
        same = (
            self.shape == other.shape
            and self.dtype == other.dtype
            and self.blocksize == other.blocksize
            and self.quant_type == other.quant_type
            and self.nested == other.nested
            and torch.equal(self.absmax, other.absmax)
            and (self.code is None) == (other.code is None)
            and (self.code is None or torch.equal(self.code, other.code))
        )
        if same and self.nested:
            same = torch.equal(self.offset, other.offset) and self.state2 == other.state2
        return same

    __hash__ = None  # type: ignore[assignment]


def _check_tensors(**named) -> None:
    """A must be a tensor; optional tensor arguments must be tensors or None."""
    for name, value in named.items():
        required = name in ("A", "B")
        if (value is not None or required) and not isinstance(value, torch.Tensor):
            raise TypeError(
                f"{name} must be a torch.Tensor{'' if required else ' or None'}, got {type(value).__name__}"
            )


def check_quant_state(quant_state, packed: torch.Tensor | None = None, what: str = "quant_state") -> QuantState:
    """The one check of a 4-bit QuantState (every function that takes one calls
    it): quant_type, blocksize, dtype, a non-empty shape; absmax holds
    ceil(n/blocksize) values (floating, or uint8 codes when nested); a nested
    state has state2 (float32 absmax of ceil(n_blocks/256) values, block 256)
    and a one-element float offset. With `packed` (viewed as uint8), its byte
    count must be ceil(n/2). Raises TypeError / ValueError naming the value."""
    if not isinstance(quant_state, QuantState):
        raise TypeError(f"{what} must be a q4torch.functional.QuantState, got {type(quant_state).__name__}")
    qs = quant_state
    formats.check_quant_type(qs.quant_type)
    bs = qs.blocksize
    if isinstance(bs, bool) or not isinstance(bs, int) or not (_MIN_BLOCKSIZE <= bs <= _MAX_BLOCKSIZE) or bs & (bs - 1):
        raise ValueError(f"{what}.blocksize must be a power of two in [{_MIN_BLOCKSIZE}, {_MAX_BLOCKSIZE}], got {bs!r}")
    if qs.dtype not in _DTYPE_NAMES:
        raise ValueError(f"{what}.dtype must be torch.float32, float16 or bfloat16, got {qs.dtype!r}")
    try:
        shape = tuple(qs.shape)
    except TypeError:
        shape = None
    if not shape or not all(isinstance(d, int) and not isinstance(d, bool) and d > 0 for d in shape):
        raise ValueError(f"{what}.shape must be a non-empty sequence of positive ints, got {qs.shape!r}")
    n = math.prod(shape)
    nb = formats.num_blocks(n, qs.blocksize)
    if not isinstance(qs.absmax, torch.Tensor):
        raise TypeError(f"{what}.absmax must be a tensor, got {type(qs.absmax).__name__}")
    ok_dtype = qs.absmax.dtype == torch.uint8 if qs.nested else qs.absmax.dtype.is_floating_point
    if qs.absmax.numel() != nb or not ok_dtype:
        kind = "uint8 codes (nested)" if qs.nested else "floating-point values"
        raise ValueError(
            f"{what}.absmax must hold {nb} {kind} for shape {shape} and blocksize {qs.blocksize}, "
            f"got {qs.absmax.dtype}[{qs.absmax.numel()}]"
        )
    if qs.nested:
        s2 = qs.state2
        n2 = formats.num_blocks(nb, _NESTED_BLOCKSIZE)
        if not isinstance(s2, QuantState) or not isinstance(s2.absmax, torch.Tensor):
            raise TypeError(f"{what}.state2 must be a QuantState holding the nested absmax, got {type(s2).__name__}")
        if s2.absmax.dtype != torch.float32 or s2.absmax.numel() != n2:
            raise ValueError(f"{what}.state2.absmax must be float32[{n2}], got {s2.absmax.dtype}[{s2.absmax.numel()}]")
        if s2.blocksize != _NESTED_BLOCKSIZE:
            raise ValueError(f"{what}.state2.blocksize must be {_NESTED_BLOCKSIZE}, got {s2.blocksize!r}")
        off = qs.offset
        if not isinstance(off, torch.Tensor) or off.numel() != 1 or not off.dtype.is_floating_point:
            got = (
                "None"
                if off is None
                else (f"{off.dtype}[{off.numel()}]" if isinstance(off, torch.Tensor) else repr(off))
            )
            raise ValueError(f"{what} is nested and needs offset, a one-element float tensor; got {got}")
    if packed is not None:
        formats.check_packed_size(packed.numel() * packed.element_size(), n, "packed weight", f"{what}.shape {shape}")
    return qs


# dtypes the packed 4-bit bytes may be viewed as (bitsandbytes' quant_storage): every copy keeps the
# bytes. Not bool: a copy of a bool tensor turns every non-zero byte into 1, so other codes.
QUANT_STORAGE_DTYPES = (torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.float16,
                        torch.bfloat16, torch.float32, torch.float64)  # fmt: skip


def check_quant_storage(dtype, what: str = "quant_storage") -> torch.dtype:
    """``dtype`` if the packed 4-bit bytes may be stored as it, else ValueError naming ``what``."""
    if not isinstance(dtype, torch.dtype) or dtype not in QUANT_STORAGE_DTYPES:
        why = " (a copy of a bool tensor turns every non-zero byte into 1)" if dtype is torch.bool else ""
        raise ValueError(f"{what} must be one of {', '.join(str(d) for d in QUANT_STORAGE_DTYPES)}, got {dtype!r}{why}")
    return dtype


def _check_devices(**named) -> None:
    """No tensor on the meta device (no data: a kernel would read leftover
    memory) unless every one is (shape propagation)."""
    tensors = {k: v for k, v in named.items() if isinstance(v, torch.Tensor)}
    meta = sorted(k for k, v in tensors.items() if v.is_meta)
    if meta and len(meta) < len(tensors):
        raise ValueError(
            f"{', '.join(meta)} {'is' if len(meta) == 1 else 'are'} on the meta device (no data) while "
            f"{', '.join(sorted(set(tensors) - set(meta)))} {'is' if len(tensors) - len(meta) == 1 else 'are'} "
            "not: load or materialise the quantized weight (e.g. load_state_dict(..., assign=True), or "
            "to_empty() and a checkpoint) before computing with it"
        )


def _state_tensors(qs: QuantState) -> dict[str, Any]:
    nested = qs.nested and isinstance(qs.state2, QuantState)
    return {
        "quant_state.absmax": qs.absmax,
        "quant_state.state2.absmax": qs.state2.absmax if nested else None,
        "quant_state.offset": qs.offset if nested else None,
    }


def _resolve_blocksize(blocksize, default):
    return formats.check_blocksize(default if blocksize is None else blocksize)


def quantize_4bit(
    A: torch.Tensor,
    absmax: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    blocksize: int | None = None,
    compress_statistics: bool = False,
    quant_type: str = "fp4",
    quant_storage: torch.dtype = torch.uint8,
) -> tuple[torch.Tensor, QuantState]:
    """Quantize A (fp32/fp16/bf16, any shape; a non-contiguous A is copied) to
    4 bits in blocks of `blocksize` (default 64) consecutive elements.

    Returns (packed [ceil(n/2), 1] of quant_storage, QuantState). With
    compress_statistics the absmax is itself quantized (nested, block 256).
    NaN in a block makes its absmax NaN and every nibble 15 (see the README);
    with compress_statistics a NaN or Inf is refused (ValueError naming the
    blocks: it would turn every block into NaN), and scales whose float32
    mean overflows get a float64 mean as the nested offset.
    """
    _check_tensors(A=A, absmax=absmax, out=out)
    bs = _resolve_blocksize(blocksize, 64)
    check_quant_storage(quant_storage)
    packed, _absmax = ops.quantize_4bit(A, bs, quant_type)
    if quant_storage != torch.uint8:
        if packed.numel() * 1 % quant_storage.itemsize:
            raise ValueError(
                f"{packed.numel()} packed bytes cannot be viewed as {quant_storage} (itemsize {quant_storage.itemsize})"
            )
        packed = packed.squeeze(1).view(quant_storage).unsqueeze(1)
    code = get_4bit_type(quant_type, A.device)
    if compress_statistics:
        codes, absmax2, offset = ops.quantize_nested(_absmax)
        if not bool(torch.isfinite(offset)):
            # a NaN / Inf in A (refused, naming the blocks), or finite scales whose fp32 mean overflows
            c, a2, off = quantizers.nested_fallback(_absmax.detach().cpu().numpy(), bs)
            codes = torch.from_numpy(c).to(A.device).reshape(codes.shape)
            absmax2 = torch.from_numpy(a2).to(A.device)
            offset = torch.tensor(float(off), dtype=torch.float32, device=A.device)
        state2 = QuantState(
            absmax=absmax2, code=create_dynamic_map(A.device), blocksize=formats.nested_blocksize(), dtype=torch.float32
        )
        state = QuantState(
            absmax=codes,
            shape=A.shape,
            dtype=A.dtype,
            blocksize=bs,
            code=code,
            quant_type=quant_type,
            offset=offset,
            state2=state2,
        )
    else:
        state = QuantState(absmax=_absmax, shape=A.shape, dtype=A.dtype, blocksize=bs, code=code, quant_type=quant_type)
    if out is not None:
        packed = out.copy_(packed)
    if absmax is not None:
        state.absmax = absmax.copy_(state.absmax)
    return packed, state


def _state_absmax(state: QuantState) -> torch.Tensor:
    """The fp32 per-block absmax of a state (decoding a nested one)."""
    if not state.nested:
        return state.absmax.float() if state.absmax.dtype != torch.float32 else state.absmax
    s2 = state.state2
    return ops.dequantize_blockwise(state.absmax, s2.absmax, s2.code, s2.blocksize, torch.float32, state.offset)


def dequantize_4bit(
    A: torch.Tensor,
    quant_state: QuantState | None = None,
    absmax: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    blocksize: int | None = None,
    quant_type: str = "fp4",
) -> torch.Tensor:
    """Dequantize packed 4-bit data: decode(nibble) * absmax[block] in fp32,
    rounded to the state's dtype (exactly bitsandbytes' values)."""
    if quant_state is None:
        if absmax is None or out is None:
            raise ValueError("dequantize_4bit needs quant_state, or both absmax and out")
        quant_state = QuantState(
            absmax=absmax,
            shape=out.shape,
            dtype=out.dtype,
            blocksize=_resolve_blocksize(blocksize, 64),
            quant_type=quant_type,
        )
    _check_tensors(A=A, out=out)
    check_quant_state(quant_state, A)
    check_quant_storage(A.dtype, "the packed weight's dtype")
    _check_devices(A=A, **_state_tensors(quant_state))
    packed = A if A.dtype == torch.uint8 else A.view(torch.uint8)
    absmax = _state_absmax(quant_state)
    if (
        out is not None
        and out.is_contiguous()
        and out.dtype == quant_state.dtype
        and out.numel() == math.prod(quant_state.shape)
    ):
        ops.dequantize_4bit_out(packed.reshape(-1), absmax, quant_state.blocksize, quant_state.quant_type, out)
        result = out
    else:
        result = ops.dequantize_4bit(
            packed.reshape(-1),
            absmax,
            quant_state.blocksize,
            quant_state.quant_type,
            list(quant_state.shape),
            quant_state.dtype,
        )
        if out is not None:
            result = out.copy_(result)
    return result.t() if A.shape[0] == 1 else result


def quantize_fp4(A, absmax=None, out=None, blocksize=None, compress_statistics=False, quant_storage=torch.uint8):
    """quantize_4bit with quant_type="fp4" (bitsandbytes' name)."""
    return quantize_4bit(A, absmax, out, blocksize, compress_statistics, "fp4", quant_storage)


def quantize_nf4(A, absmax=None, out=None, blocksize=None, compress_statistics=False, quant_storage=torch.uint8):
    """quantize_4bit with quant_type="nf4" (bitsandbytes' name)."""
    return quantize_4bit(A, absmax, out, blocksize, compress_statistics, "nf4", quant_storage)


def dequantize_fp4(A, quant_state=None, absmax=None, out=None, blocksize=None):
    """dequantize_4bit of an FP4 weight (bitsandbytes' name)."""
    return dequantize_4bit(A, quant_state, absmax, out, blocksize, "fp4")


def dequantize_nf4(A, quant_state=None, absmax=None, out=None, blocksize=None):
    """dequantize_4bit of an NF4 weight (bitsandbytes' name)."""
    return dequantize_4bit(A, quant_state, absmax, out, blocksize, "nf4")


def quantize_blockwise(
    A: torch.Tensor,
    code: torch.Tensor | None = None,
    absmax: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    blocksize: int = 4096,
    nested: bool = False,
) -> tuple[torch.Tensor, QuantState]:
    """8-bit blockwise quantization with the dynamic map (or `code`): each
    element gets the code whose reconstruction code[j] * absmax is nearest."""
    _check_tensors(A=A, code=code, absmax=absmax, out=out)
    bs = formats.check_blocksize8(blocksize)
    code = create_dynamic_map(A.device) if code is None else code.to(A.device)
    _out, _absmax = ops.quantize_blockwise(A, code, bs)
    if nested:
        offset = _absmax.mean()
        qabsmax, state2 = quantize_blockwise(_absmax - offset, blocksize=bs, nested=False)
        state = QuantState(absmax=qabsmax, code=code.clone(), blocksize=bs, dtype=A.dtype, offset=offset, state2=state2)
    else:
        state = QuantState(absmax=_absmax, code=code.clone(), blocksize=bs, dtype=A.dtype)
    if out is not None:
        _out = out.copy_(_out)
    if absmax is not None:
        state.absmax = absmax.copy_(state.absmax)
    return _out, state


def dequantize_blockwise(
    A: torch.Tensor,
    quant_state: QuantState | None = None,
    absmax: torch.Tensor | None = None,
    code: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    blocksize: int = 4096,
    nested: bool = False,
) -> torch.Tensor:
    """Inverse of quantize_blockwise: code[A] * absmax[block] in the state's dtype."""
    if quant_state is None:
        if absmax is None:
            raise ValueError("dequantize_blockwise needs quant_state or absmax")
        quant_state = QuantState(
            absmax=absmax,
            code=create_dynamic_map(A.device) if code is None else code,
            blocksize=blocksize,
            dtype=torch.float32,
        )
    scale = quant_state.absmax
    if quant_state.state2 is not None:
        s2 = quant_state.state2
        scale = ops.dequantize_blockwise(scale, s2.absmax, s2.code, s2.blocksize, torch.float32, quant_state.offset)
    result = ops.dequantize_blockwise(A, scale, quant_state.code, quant_state.blocksize, quant_state.dtype)
    if out is not None:
        result = out.copy_(result)
    return result


# Validated kernel arguments of a 4-bit weight, per QuantState: (key, args).
# The arguments are pointers and sizes, a function of the key alone (the
# pointers, sizes, dtypes and layout of the packed bytes and scales, and the
# state's fields), so an entry is either exactly what validation would produce
# now or it does not match: it cannot go stale. The nested offset's value is
# read on every call (tensors made under inference_mode have no version
# counter that could tell an in-place change).
# Keyed by id(state) (QuantState compares by value, so it is not hashable);
# an entry holds a weak reference to its state and leaves with it.
_PREPARED: dict[int, tuple] = {}


def _prepared_key(qs: QuantState, B: torch.Tensor):
    a = qs.absmax
    key: tuple[Any, ...] = (B.data_ptr(), B.numel(), B.element_size(), B.is_contiguous(), qs.blocksize, qs.quant_type)
    key += (tuple(qs.shape), qs.dtype, qs.nested, a.data_ptr(), a.numel(), a.dtype, a.is_contiguous())
    if qs.nested:
        s2, off = qs.state2, qs.offset
        a2 = s2.absmax
        key += (a2.data_ptr(), a2.numel(), a2.dtype, a2.is_contiguous(), s2.blocksize)
        key += (off.numel(), off.dtype)
    return key


def _prepared_args(qs: QuantState, B: torch.Tensor):
    """(n, k, scales) for the C ABI, validated once per distinct key."""
    try:
        key = _prepared_key(qs, B)
    except (AttributeError, TypeError):  # not tensors where tensors belong: the full check says which
        key = None
    hit = _PREPARED.get(id(qs))
    if key is not None and hit is not None and hit[0]() is qs and hit[1] == key:
        n, k, scales = hit[2]
        if qs.nested:  # the offset's current value (a tensor never cached)
            scales = scales[:5] + (float(qs.offset.item()),) + scales[6:]
        return n, k, scales
    check_quant_state(qs, B)
    if len(qs.shape) != 2:
        raise ValueError(f"matmul_4bit needs a 2-D weight, quant_state.shape is {tuple(qs.shape)}")
    n, k = (int(s) for s in qs.shape)
    packed = (B if B.dtype == torch.uint8 else B.view(torch.uint8)).reshape(-1)
    nested = qs.nested
    scales = ops.weight_args(
        packed,
        qs.absmax,
        qs.state2.absmax if nested else None,
        qs.offset if nested else None,
        n,
        k,
        int(qs.blocksize),
        qs.quant_type,
    )
    args = (n, k, scales)
    if key is not None:
        ident = id(qs)

        def forget(_ref: weakref.ref, i: int = ident) -> None:
            _PREPARED.pop(i, None)

        _PREPARED[ident] = (weakref.ref(qs, forget), key, args)
    return args


def _plain(t) -> bool:
    """A tensor with no torch function of its own: torch.Tensor, or an
    nn.Parameter (or a subclass, such as Int8Params, that keeps Parameter's
    disabled one)."""
    tp = type(t)
    return tp is torch.Tensor or getattr(tp, "__torch_function__", None) is torch._C._disabled_torch_function_impl


def _records(A: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """Whether autograd records this call (A or the bias requires grad, grad mode on)."""
    return torch.is_grad_enabled() and (A.requires_grad or (bias is not None and bias.requires_grad))


def _eager_cpu(A: torch.Tensor, bias: torch.Tensor | None, records: bool = False) -> bool:
    """Whether matmul_4bit may call the CPU kernel directly rather than through
    the q4::gemm_4bit op: eager mode, plain CPU tensors, nothing recording
    (no autograd graph, no tracing, no torch function or dispatch mode). The
    result is the op's, byte for byte (the same kernel with the same
    arguments); what is skipped is the dispatcher's per-call cost, which at
    batch 1 is a tenth of the whole call. records=True also allows an
    autograd graph (A or the bias requiring grad) outside functorch's
    transforms: the caller records it itself (ops.EagerGemm4bit)."""
    if type(A) is not torch.Tensor or not A.is_cpu or torch.compiler.is_compiling():
        return False
    if _records(A, bias) and (not records or torch._C._functorch.is_functorch_wrapped_tensor(A)):
        return False
    if bias is not None and (not _plain(bias) or not bias.is_cpu):  # (a layer's bias: an nn.Parameter)
        return False
    return not torch._C._is_torch_function_mode_enabled() and torch._C._len_torch_dispatch_stack() == 0


def _cpu_tensor(t) -> bool:
    return isinstance(t, torch.Tensor) and t.is_cpu


def _eager_matmul_4bit(A, B, quant_state, bias, activation_quant) -> torch.Tensor | None:
    """matmul_4bit(A, B, quant_state, bias=bias, activation_quant=...) by a
    direct call of the CPU kernel, or None where the q4::gemm_4bit op (or the
    general path's checks and errors) must run: the conditions of _eager_cpu,
    a QuantState of a 2-D [N, K] weight whose K is A's last dimension, a
    non-empty A, a contiguous CPU B. activation_quant is already checked.
    Linear4bit.forward calls it directly: at batch 1 on a small layer the
    Python around the kernel is most of the call. Where A or the bias
    requires grad, ops.EagerGemm4bit records the op's autograd (same kernels,
    same saved tensors) without the op's dispatch: in a training step of a
    small layer that dispatch cost more than the kernels."""
    if not isinstance(quant_state, QuantState) or not _eager_cpu(A, bias, records=True):
        return None
    shape = quant_state.shape
    # (a mismatch: an error, or the [K, N] orientation, in the general path)
    if shape is None or len(shape) != 2 or A.dim() == 0 or A.numel() == 0 or A.shape[-1] != shape[-1]:
        return None
    # (a Params4bit's own __torch_function__ would cost ~1 us per method call)
    with torch._C.DisableTorchFunctionSubclass():
        absmax = quant_state.absmax  # (a non-tensor or meta absmax: the general path's checks name it)
        if not isinstance(B, torch.Tensor) or not B.is_cpu or not B.is_contiguous() or not _cpu_tensor(absmax):
            return None
        if B.dtype is torch.bool or (quant_state.nested and not _cpu_tensor(quant_state.state2.absmax)):
            return None
        n, k, scales = _prepared_args(quant_state, B)
        bs, qt = int(quant_state.blocksize), quant_state.quant_type
        if not _records(A, bias):
            return ops.gemm_4bit_call(A, B.data_ptr(), n, k, scales, bs, qt, bias, activation_quant)
        packed = (B if B.dtype == torch.uint8 else B.view(torch.uint8)).reshape(-1)
        nested = quant_state.nested
        absmax, state2, offset = quant_state.absmax, quant_state.state2, quant_state.offset
        nested_absmax, nested_offset = (state2.absmax, offset) if nested else (None, None)
    return ops.EagerGemm4bit.apply(
        A, packed, absmax, nested_absmax, nested_offset, bias, n, k, scales, bs, qt, activation_quant
    )


def matmul_4bit(
    A: torch.Tensor,
    B: torch.Tensor,
    quant_state: QuantState,
    out: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    activation_quant: str | None = None,
) -> torch.Tensor:
    """A . dequantize(B)^T (+ bias) through the fused kernels, differentiable in
    A and bias (the quantized weight is frozen). B is the packed weight (any
    quant_storage view, transposed or not); quant_state.shape = (out, in).

    Neither direction materialises the dequantized weight; the backward uses
    the packed weight saved by the forward (save_for_backward).

    activation_quant='int8' (opt-in W4A8): A is quantized to int8 per row in
    blocks of min(64, blocksize) and multiplied with the codes as int8 values
    in integer dot products (README "W4A8"): faster on VNNI CPUs, less exact
    (about 1e-2 relative error); in_features must be a multiple of the
    block. Its gradient is the exact one of A . dequantize(B)^T.
    """
    if quant_state is None:
        raise ValueError("matmul_4bit needs the weight's quant_state")
    formats.check_activation_quant(activation_quant)
    if out is None:
        y = _eager_matmul_4bit(A, B, quant_state, bias, activation_quant)
        if y is not None:
            return y
    _check_tensors(A=A, B=B, out=out, bias=bias)
    check_quant_state(quant_state, B)
    check_quant_storage(B.dtype, "the packed weight B's dtype")
    _check_devices(A=A, B=B, bias=bias, **_state_tensors(quant_state))
    if A.dim() == 0:
        raise ValueError(
            f"matmul_4bit needs an input with at least one dimension (features last), got a 0-d tensor; "
            f"the weight takes {quant_state.shape[-1] if len(quant_state.shape) == 2 else '?'} features"
        )
    if len(quant_state.shape) != 2:
        raise ValueError(f"matmul_4bit needs a 2-D weight, quant_state.shape is {tuple(quant_state.shape)}")
    n, k = (int(s) for s in quant_state.shape)
    packed = B if B.dtype == torch.uint8 else B.view(torch.uint8)
    nested = quant_state.nested
    if A.dim() >= 1 and A.shape[-1] == n and n != k:
        # a weight quantized from a [K, N] tensor (bitsandbytes accepts it, deprecated)
        warnings.warn(
            f"matmul_4bit: the weight was quantized from a [K, N] tensor (quant_state.shape={list(quant_state.shape)}). "
            "Re-quantize from the weight in [N, K] (out_features, in_features) orientation",
            DeprecationWarning,
            stacklevel=2,
        )
        if activation_quant is not None:
            raise ValueError("activation_quant needs a weight quantized in [N, K] orientation")
        y = _MatmulKN.apply(A, packed.reshape(-1), quant_state)
        y = y if bias is None else y + bias
        return y if out is None else out.copy_(y)
    if A.dim() >= 1 and A.numel() == 0 and A.shape[-1] == k:
        # no rows: an empty result that still joins the autograd graph
        y = torch.matmul(A, A.new_zeros((k, n)))
        y = y if bias is None else y + bias
        return y if out is None else out.copy_(y)
    op = ops.gemm_4bit if activation_quant is None else ops.gemm_4bit_w4a8
    y = op(
        A,
        packed.reshape(-1),
        quant_state.absmax,
        quant_state.state2.absmax if nested else None,
        quant_state.offset if nested else None,
        n,
        k,
        int(quant_state.blocksize),
        quant_state.quant_type,
        bias,
    )
    if out is not None:
        return out.copy_(y)
    return y


def _weight_operands(packed: torch.Tensor, qs: QuantState) -> tuple:
    nested = qs.nested
    return (
        packed,
        qs.absmax,
        qs.state2.absmax if nested else None,
        qs.offset if nested else None,
        int(qs.shape[0]),
        int(qs.shape[1]),
        int(qs.blocksize),
        qs.quant_type,
    )


class _MatmulKN(torch.autograd.Function):
    """A . W for a 4-bit W stored as [K, N] (quant_state.shape): the input-gradient
    kernel computes it (x . W), the forward kernel its gradient (g . W^T)."""

    @staticmethod
    def forward(ctx, A, packed, qs):
        ctx.save_for_backward(packed)
        ctx.qs = qs
        rows = A.reshape(-1, A.shape[-1]) if A.numel() else A.reshape(0, A.shape[-1])
        if rows.shape[0] == 0:
            return A.new_zeros(A.shape[:-1] + (int(qs.shape[1]),))
        return ops.gemm_4bit_grad_input(rows, *_weight_operands(packed, qs)).reshape(A.shape[:-1] + (-1,))

    @staticmethod
    def backward(ctx, grad):
        (packed,) = ctx.saved_tensors
        if grad.numel() == 0:
            return grad.new_zeros(grad.shape[:-1] + (int(ctx.qs.shape[0]),)), None, None
        g = grad.contiguous()
        return ops.gemm_4bit(g, *_weight_operands(packed, ctx.qs), None), None, None


def _int8_rows(A, fn: str, name: str = "A") -> torch.Tensor:
    """A [..., k] as its rows [m, k] (k >= 1), or ValueError naming ``fn`` and the shape."""
    _check_tensors(A=A)
    if A.dim() == 0 or A.shape[-1] == 0:
        raise ValueError(
            f"{fn}: {name} must have at least one dimension with a non-empty last (features) dimension, "
            f"got shape {tuple(A.shape)}"
        )
    return A.reshape(-1, A.shape[-1])


def _check_stats(stats, n: int, fn: str, name: str, what: str) -> None:
    if not isinstance(stats, torch.Tensor) or stats.numel() != n:
        got = f"{stats.dtype}{list(stats.shape)}" if isinstance(stats, torch.Tensor) else type(stats).__name__
        raise ValueError(f"{fn}: {name} must hold one value per {what} ({n}), got {got}")


def int8_vectorwise_quant(A: torch.Tensor, threshold: float = 0.0):
    """LLM.int8 row-wise quantization, as bitsandbytes.functional.int8_vectorwise_quant:
    (int8 rows, fp32 row_stats, outlier column indices or None when threshold is 0)."""
    rows = _int8_rows(A, "int8_vectorwise_quant")
    q, stats, cols = ops.int8_quantize_rows(rows, float(threshold))
    outlier_cols = torch.nonzero(cols).reshape(-1) if threshold > 0 else None
    return q.reshape(A.shape), stats, outlier_cols


def int8_linear(
    A: torch.Tensor,
    CB: torch.Tensor,
    SCB: torch.Tensor,
    threshold: float = 0.0,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """LLM.int8 linear through the fused kernel, differentiable in A and bias:
    y ~= A . (CB * SCB / 127)^T (+ bias); input columns with any |A| >= threshold
    (threshold > 0) go through fp32 unquantized."""
    if _eager_cpu(A, bias, records=True) and _plain(CB) and _plain(SCB) and CB.is_cpu and SCB.is_cpu:
        # the op's bytes, without the dispatcher (recording the op's autograd itself where needed)
        if _records(A, bias):
            return ops.EagerInt8Linear.apply(A, CB, SCB, float(threshold), bias)
        return ops.int8_linear_call(A, CB, SCB, float(threshold), bias)
    return ops.int8_linear(A, CB, SCB, float(threshold), bias)


# ------------------------------------------------------------ bitsandbytes' functional API


def has_avx512bf16() -> bool:
    """Whether this CPU (and OS) supports AVX512_BF16, from q4's feature detection."""
    return bool(q4.cpu_features()["features"]["avx512_bf16"])


def _convert_weight_packed_for_cpu(qweight: torch.Tensor, quant_state: QuantState, block_n: int = 32):
    """bitsandbytes repacks a 4-bit weight for its CPU gemv; q4's kernels read
    the packed bytes as they are, so this returns copies in the same layout
    (a pure function: the arguments are not modified)."""
    check_quant_state(quant_state, qweight)
    return qweight.detach().clone(), copy.copy(quant_state)


def gemv_4bit(
    A: torch.Tensor,
    B: torch.Tensor,
    out: torch.Tensor | None = None,
    transposed_A=False,
    transposed_B=False,
    state: QuantState | None = None,
) -> torch.Tensor:
    """A . dequantize(B)^T for the packed 4-bit B (any view of it), as
    bitsandbytes.functional.gemv_4bit: the fused kernel (any batch)."""
    if state is None:
        raise ValueError("state cannot be None: gemv_4bit needs the state from quantize_4bit()")
    return matmul_4bit(A, B, state, out=out)


def int8_linear_matmul(A: torch.Tensor, B: torch.Tensor, out: torch.Tensor | None = None, dtype=torch.int32):
    """The exact int32 product A . B^T of int8 A [..., k] and int8 B [n, k]."""
    for name, t in (("A", A), ("B", B)):
        if not isinstance(t, torch.Tensor) or t.dtype != torch.int8:
            raise TypeError(f"int8_linear_matmul: {name} must be an int8 tensor, got {getattr(t, 'dtype', type(t))}")
    if dtype != torch.int32:
        raise ValueError(f"int8_linear_matmul computes int32, got dtype={dtype}")
    if B.dim() != 2 or A.dim() < 1 or A.shape[-1] != B.shape[-1]:
        raise ValueError(f"int8_linear_matmul: A {tuple(A.shape)} and B {tuple(B.shape)} do not share k")
    if A.shape[-1] > 2**37:  # |sum| < 128^2 k must stay exact in fp64 (2^53)
        raise ValueError(f"int8_linear_matmul: k = {A.shape[-1]} is too long")
    # every partial sum is an integer below 2^53: fp64 products and sums are exact
    result = torch.matmul(A.to(torch.float64), B.to(torch.float64).t()).to(torch.int32)
    if out is not None:
        return out.copy_(result)
    return result


def int8_mm_dequant(
    A: torch.Tensor,
    row_stats: torch.Tensor,
    col_stats: torch.Tensor,
    out: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """fp16 (A * (row_stats * col_stats) / 127^2 + bias) for the int32 product
    A of int8_linear_matmul (q4's LLM.int8 epilogue order)."""
    if not isinstance(A, torch.Tensor) or A.dtype != torch.int32:
        raise ValueError(f"A must be int32, got {getattr(A, 'dtype', type(A).__name__)}")
    a = _int8_rows(A, "int8_mm_dequant")
    for name, t in (("row_stats", row_stats), ("col_stats", col_stats)):
        if not isinstance(t, torch.Tensor) or t.dtype != torch.float32:
            raise ValueError(f"{name} must be float32, got {getattr(t, 'dtype', type(t).__name__)}")
    _check_stats(row_stats, a.shape[0], "int8_mm_dequant", "row_stats", "row of A")
    _check_stats(col_stats, a.shape[1], "int8_mm_dequant", "col_stats", "column of A")
    scale = row_stats.reshape(-1, 1) * col_stats.reshape(1, -1)
    result = a.to(torch.float32) * scale * _INV_127_SQ
    if bias is not None:
        result = result + bias.to(torch.float32)
    result = result.to(torch.float16).reshape(A.shape)
    if out is not None:
        return out.copy_(result)
    return result


def int8_vectorwise_dequant(A: torch.Tensor, stats: torch.Tensor) -> torch.Tensor:
    """fp32 A * stats[row] / 127 (rows of A: all but its last dim)."""
    if not isinstance(A, torch.Tensor) or A.dtype != torch.int8:
        raise TypeError(f"A must be int8, got {getattr(A, 'dtype', type(A).__name__)}")
    rows = _int8_rows(A, "int8_vectorwise_dequant")
    _check_stats(stats, rows.shape[0], "int8_vectorwise_dequant", "stats", "row of A")
    return A.to(torch.float32) * stats.reshape(-1, *([1] * (A.dim() - 1))).reshape(*A.shape[:-1], 1) * _INV_127


def int8_double_quant(A: torch.Tensor, col_stats=None, row_stats=None, out_col=None, out_row=None, threshold=0.0):
    """LLM.int8 quantization row-wise and column-wise: (row-quantized int8,
    column-quantized int8, row_stats, col_stats, outlier column indices or
    None). Outlier columns (any |A| >= threshold) are zero in both."""
    for name, v in (("col_stats", col_stats), ("row_stats", row_stats), ("out_col", out_col), ("out_row", out_row)):
        if v is not None:
            raise ValueError(f"{name} must be None: int8_double_quant does not take pre-allocated outputs")
    rows = _int8_rows(A, "int8_double_quant")
    q_row, s_row, outliers = int8_vectorwise_quant(rows, threshold)
    cols = rows
    if outliers is not None and outliers.numel():
        cols = rows.clone()
        cols[:, outliers] = 0
    q_col_t, s_col, _ = int8_vectorwise_quant(cols.t().contiguous(), 0.0)
    return q_row.reshape(A.shape), q_col_t.t().contiguous().reshape(A.shape), s_row, s_col, outliers
