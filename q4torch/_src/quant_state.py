"""The PyTorch QuantState (bitsandbytes' class: torch tensors, bitsandbytes'
field names) and its one check, check_quant_state.

Its checkpoint entries go through the framework-neutral state of
q4/_src/quant_state.py both ways: the JSON entry is written by that state's
json_dict / pack_json and read (and validated) by its from_dict, so the two
front ends share one JSON writer and one reader. Public as
``q4torch.functional.QuantState``.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch

import q4
from q4._src import formats
from q4._src.quant_state import JSON_KEY_PREFIX, pack_json
from q4._src.quant_state import QuantState as _NpQuantState

TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
DTYPE_NAMES = {v: k for k, v in TORCH_DTYPES.items()}
# read from the kernel library once: check_quant_state runs inside torch.compile
# graphs, where a ctypes call cannot be traced
_MIN_BLOCKSIZE, _MAX_BLOCKSIZE = formats.min_blocksize(), formats.max_blocksize()
_NESTED_BLOCKSIZE = formats.nested_blocksize()
_QUANT_TYPES = tuple(formats.quant_type_codes())
_NO_ARRAY = np.empty(0, np.float32)  # (QuantState._json_fields)


def code_table(which: str, device=None) -> torch.Tensor:
    """q4's code book 'nf4', 'fp4' (16 values) or 'dynamic' (256), read from the kernel library."""
    return torch.from_numpy(formats.code_table(which).copy()).to(device or "cpu")


class QuantState:
    """Quantization state of a 4-bit (or 8-bit blockwise) tensor, as in bitsandbytes.

    For nested 4-bit states ``absmax`` holds the uint8 codes of
    (absmax - offset), ``offset`` the fp32 mean and ``state2`` the 8-bit state
    (its absmax and the dynamic map).
    """

    valid_quant_types = _QUANT_TYPES  # (bitsandbytes' attribute; the library's list of formats)
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
            dtype=DTYPE_NAMES[self.dtype],
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
                code=code_table("dynamic", device),
                dtype=torch.float32,
            )
        return cls(
            absmax=torch.from_numpy(np.array(st.absmax)).to(device),
            shape=torch.Size(st.shape),
            code=code_table(st.quant_type, device),
            blocksize=st.blocksize,
            quant_type=st.quant_type,
            dtype=TORCH_DTYPES[st.dtype],
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
                    f"quant_type must be {' or '.join(map(repr, cls.valid_quant_types))}, "
                    f"got {formats.short_repr(meta.get('quant_type'))}"
                )
            try:
                packed_meta = pack_json(meta)
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
        if d["dtype"] not in TORCH_DTYPES:
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
                dtype=TORCH_DTYPES[d.get("nested_dtype", "float32")],
            )
        shape = d.get("shape")
        return cls(
            absmax=absmax.to(device),
            shape=torch.Size(shape) if shape is not None else None,
            code=code.to(device),
            blocksize=blocksize,
            dtype=TORCH_DTYPES[d["dtype"]],
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
            "dtype": DTYPE_NAMES.get(self.dtype, str(self.dtype).removeprefix("torch.")),
            "shape": tuple(self.shape) if self.shape is not None else None,
        }
        if self.nested:
            qs.update(
                nested_absmax=self.state2.absmax,
                nested_blocksize=self.state2.blocksize,
                nested_quant_map=self.state2.code.clone(),
                nested_dtype=DTYPE_NAMES.get(self.state2.dtype, str(self.state2.dtype).removeprefix("torch.")),
                nested_offset=float(self.offset),
            )
        if not packed or self.quant_type is None:
            return qs
        out = {k: v for k, v in qs.items() if isinstance(v, torch.Tensor)}
        out[JSON_KEY_PREFIX + self.quant_type] = torch.from_numpy(pack_json(self._json_fields()))
        return out

    def _json_fields(self) -> dict[str, Any]:
        """The JSON entry's fields, written by the framework-neutral state's
        json_dict (the one writer of that entry, for both front ends). It reads
        the scalar fields only, so the arrays are left empty here rather than
        copied off the device."""
        nested = self.nested
        return _NpQuantState(
            quant_type=self.quant_type,
            blocksize=self.blocksize,
            shape=tuple(self.shape),
            dtype=DTYPE_NAMES.get(self.dtype, str(self.dtype).removeprefix("torch.")),
            absmax=_NO_ARRAY,
            nested_absmax=_NO_ARRAY if nested else None,
            nested_offset=float(self.offset) if nested else None,
            nested_blocksize=self.state2.blocksize if nested else _NESTED_BLOCKSIZE,
        ).json_dict()

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
    if qs.quant_type not in _QUANT_TYPES:
        formats.check_quant_type(qs.quant_type)  # raises, naming the value
    bs = qs.blocksize
    if isinstance(bs, bool) or not isinstance(bs, int) or not (_MIN_BLOCKSIZE <= bs <= _MAX_BLOCKSIZE) or bs & (bs - 1):
        raise ValueError(f"{what}.blocksize must be a power of two in [{_MIN_BLOCKSIZE}, {_MAX_BLOCKSIZE}], got {bs!r}")
    if qs.dtype not in DTYPE_NAMES:
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


# its public home: pickles of a layer name the class there, as they did before it moved here
QuantState.__module__ = "q4torch.functional"
