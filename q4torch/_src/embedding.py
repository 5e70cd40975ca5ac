"""Quantized embedding layers with bitsandbytes' names, constructor arguments,
weights and lookups: Embedding4bit, EmbeddingNF4, EmbeddingFP4, Embedding8bit,
and StableEmbedding.

Weights are stored as bitsandbytes 0.50.2 stores them: Embedding4bit holds a
Params4bit (the [num_embeddings, embedding_dim] table flattened row-major and
quantized blockwise, block 64, plain absmax; quantized on the first
``.to(device)``), Embedding8bit an Int8Params (CB int8 [num_embeddings,
embedding_dim], SCB fp32 [num_embeddings], the table rounded to fp16 first).

Lookups equal bitsandbytes' values:

- 4-bit: ``out = dequantize_4bit(W)[input]`` in the state's dtype, then cast to
  the layer's ``dtype``. Only the looked-up rows are decoded: each row's
  elements [r*d, r*d + d) lie in a run of consecutive blocks, which are
  gathered (packed bytes and absmax, or the nested absmax codes in 256-blocks)
  and decoded by the kernels; ``embedding_dim`` need not be a multiple of the
  block size (a block may straddle two rows, as bitsandbytes allows).
- 8-bit: ``out = CB[input] * (SCB[input] / 127)`` in fp32, then cast to ``dtype``.

Checkpoint keys are those of Linear4bit / Linear8bitLt without a bias
(``weight``, ``weight.absmax``, ``weight.quant_map``, [``weight.nested_*``],
``weight.quant_state.bitsandbytes__<type>``; or ``weight``, ``SCB``,
``weight_format``), so ``q4 quantize --embeddings`` files load here and in
q4jax.

Differences from bitsandbytes 0.50.2, all deliberate:
- ``state_dict()`` works (bitsandbytes raises NotImplementedError) and
  ``load_state_dict`` takes a quantized checkpoint (strict or not), before or
  after a forward, without aliasing the caller's tensors;
- a nested (``compress_statistics``) 4-bit state is decoded correctly (the
  bitsandbytes row gather decodes gathered nested codes with the wrong
  second-level scales); bitsandbytes never builds one itself;
- no warning for an ``embedding_dim`` that is not a multiple of the block
  (the row gather is as fast either way) and no AVX-512 mis-decode of blocks
  that straddle rows;
- bad input raises: non-integer or out-of-range indices (IndexError naming the
  index), a forward before quantization (RuntimeError).
"""

from __future__ import annotations

import math
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn

import q4
from q4._src import formats
from q4._src.quant_state import JSON_KEY_PREFIX
from q4torch import functional as qf
from q4torch._src import ops
from q4torch._src.linear4bit import Params4bit, load_all_but_weight, save_4bit_entries
from q4torch._src.linear8bit import Int8Params, apply_keeping_scb, check_weight_format, save_int8_entries
from q4torch._src.quantize import quantized_weight

_INDEX_DTYPES = (torch.int32, torch.int64)


def blocks_per_row(dim: int, blocksize: int) -> int:
    """How many consecutive blocks the elements of one row can touch.

    Row r starts at element r*dim, at offset (r*dim) mod blocksize inside its
    first block; those offsets are multiples of g = gcd(dim, blocksize), at
    most blocksize - g, so a row spans at most
    (blocksize - g + dim - 1) // blocksize + 1 blocks (dim / blocksize when
    blocksize divides dim: rows are then whole blocks)."""
    g = math.gcd(dim, blocksize)
    return (blocksize - g + dim - 1) // blocksize + 1


def check_indices(input: Any, num_embeddings: int, what: str) -> torch.Tensor:
    """`input` as a tensor of indices in [0, num_embeddings): int32 / int64 (as
    torch.nn.functional.embedding takes), else TypeError; an index outside
    the table raises IndexError naming it."""
    if not isinstance(input, torch.Tensor):
        raise TypeError(f"{what} input must be a torch.Tensor of indices, got {type(input).__name__}")
    if input.dtype not in _INDEX_DTYPES:
        raise TypeError(f"{what} input must hold int32 or int64 indices, got {input.dtype}")
    if input.numel() and not torch.compiler.is_compiling():
        lo, hi = int(input.min()), int(input.max())
        if lo < 0 or hi >= num_embeddings:
            bad = lo if lo < 0 else hi
            raise IndexError(f"{what}: index {bad} is out of range for num_embeddings={num_embeddings}")
    return input


def _gather_blocks(flat: torch.Tensor, first: torch.Tensor, count: int, width: int) -> torch.Tensor:
    """[n, count * width]: for each row i the blocks first[i] .. first[i] + count - 1
    of `flat` cut into blocks of `width` elements (the last block may be
    partial). Blocks past the end read as some other block's elements (callers
    discard every position that is not inside the array)."""
    total = flat.numel()
    full, tail = divmod(total, width)
    ids = first[:, None] + torch.arange(count, device=flat.device)
    if full:
        out = flat[: full * width].view(full, width)[ids.clamp(max=full - 1)]
    else:
        out = flat.new_zeros((first.numel(), count, width))
    if tail:
        last = flat.new_zeros(width)
        last[:tail] = flat[full * width :]
        out = torch.where((ids == full)[..., None], last, out)
    return out.reshape(first.numel(), count * width)


def _block_absmax(qs: qf.QuantState, first: torch.Tensor, count: int) -> torch.Tensor:
    """fp32 [n, count]: the absmax of blocks first[i] .. first[i] + count - 1
    (positions past the last block hold another block's value). A nested
    state is decoded by the kernel in whole 256-blocks of codes, only those
    the rows touch: fp32(code[q] * absmax2[block]) + offset."""
    n_blocks = qs.absmax.numel()
    if not qs.nested:
        ids = (first[:, None] + torch.arange(count, device=first.device)).clamp(max=n_blocks - 1)
        return qs.absmax.float()[ids]
    s2 = qs.state2
    bs2 = s2.blocksize
    first2 = first // bs2
    count2 = (count + 2 * bs2 - 2) // bs2  # 256-blocks touched by `count` blocks from any offset
    codes = _gather_blocks(qs.absmax, first2, count2, bs2)
    ids2 = (first2[:, None] + torch.arange(count2, device=first.device)).clamp(max=s2.absmax.numel() - 1)
    scales = s2.absmax[ids2]
    decoded = ops.dequantize_blockwise(
        codes.reshape(-1), scales.reshape(-1).contiguous(), s2.code, bs2, torch.float32, qs.offset
    )
    at = (first - first2 * bs2)[:, None] + torch.arange(count, device=first.device)
    return decoded.view(first.numel(), count2 * bs2).gather(1, at)


def lookup_4bit(packed: torch.Tensor, qs: qf.QuantState, rows: torch.Tensor, dim: int) -> torch.Tensor:
    """Rows `rows` (int64 [n], in range) of the [*, dim] table packed in
    `packed` / `qs`: [n, dim] in qs.dtype, bit for bit
    ``dequantize_4bit(packed, qs)[rows]``, decoding only the blocks those rows touch."""
    n, bs = rows.numel(), qs.blocksize
    if n == 0:
        return torch.empty((0, dim), dtype=qs.dtype, device=packed.device)
    count = blocks_per_row(dim, bs)
    start = rows.to(torch.int64) * dim
    first = start // bs
    absmax = _block_absmax(qs, first, count)
    data = _gather_blocks(packed.reshape(-1).view(torch.uint8), first, count, bs // 2)
    decoded = ops.dequantize_4bit(
        data.reshape(-1), absmax.reshape(-1).contiguous(), bs, qs.quant_type, [n, count * bs], qs.dtype
    )
    if count * bs == dim:  # rows are whole blocks
        return decoded
    at = (start - first * bs)[:, None] + torch.arange(dim, device=packed.device)
    return decoded.gather(1, at)


class Embedding4bit(nn.Embedding):
    """An embedding table quantized to 4 bits (NF4 or FP4, blockwise), as
    bitsandbytes.nn.Embedding4bit: quantized on the first move to a device
    (``.to("cpu")``) or with :meth:`quantize`; the weight is frozen.

    ``forward(input)`` returns ``dequantize_4bit(W)[input]`` cast to
    ``self.dtype`` (the table's dtype at construction), decoding only the
    looked-up rows' blocks.
    """

    quant_state: qf.QuantState | None

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        dtype: torch.dtype | None = None,
        quant_type: str = "fp4",
        quant_storage: torch.dtype = torch.uint8,
        device=None,
    ):
        super().__init__(num_embeddings, embedding_dim, device=device, dtype=dtype)
        self.dtype = self.weight.data.dtype
        self.weight = Params4bit(
            self.weight.data,
            requires_grad=False,
            compress_statistics=False,
            quant_type=quant_type,
            quant_storage=quant_storage,
            module=cast(Any, self),
        )
        self.quant_state = None
        self.quant_storage = quant_storage

    def quantize(self) -> Embedding4bit:
        """Quantize the table now, on its current device (no-op if quantized)."""
        if not isinstance(self.weight, Params4bit):
            raise TypeError(f"weight must be a Params4bit, got {type(self.weight).__name__}")
        self.weight.module = cast(Any, self)
        self.weight.quantize()
        self.quant_state = self.weight.quant_state
        self.quant_storage = self.weight.dtype
        return self

    def packed_weight(self) -> tuple[torch.Tensor, qf.QuantState]:
        """The packed table and its QuantState (RuntimeError before quantization)."""
        weight = self.weight
        if not isinstance(weight, Params4bit):
            raise TypeError(f"{type(self).__name__} weight must be a Params4bit, got {type(weight).__name__}")
        qs = weight.quant_state or self.quant_state
        if not weight.bnb_quantized or qs is None:
            raise RuntimeError(
                f"{type(self).__name__} weight is not quantized yet: call .to(device) or .quantize() before the forward"
            )
        if tuple(qs.shape) != (self.num_embeddings, self.embedding_dim):
            raise ValueError(
                f"{type(self).__name__} quant_state shape {tuple(qs.shape)} does not match the table "
                f"({self.num_embeddings}, {self.embedding_dim})"
            )
        return weight, qs

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        weight, qs = self.packed_weight()
        input = check_indices(input, self.num_embeddings, type(self).__name__)
        out = lookup_4bit(weight.data, qs, input.reshape(-1), self.embedding_dim)
        return out.reshape(*input.shape, self.embedding_dim).to(self.dtype)

    # -- checkpoints

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        super()._save_to_state_dict(destination, prefix, keep_vars)
        weight = self.weight
        qs = getattr(weight, "quant_state", None) or self.quant_state
        if qs is not None and getattr(weight, "bnb_quantized", False):
            save_4bit_entries(destination, prefix, qs, keep_vars)

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
        shape = (self.num_embeddings, self.embedding_dim)
        try:
            if not isinstance(data, torch.Tensor):
                raise TypeError(f"'{weight_key}' must be a tensor, got {type(data).__name__}")
            device = self.weight.device
            if any(k.startswith(JSON_KEY_PREFIX) for k in stats):
                new = Params4bit.from_prequantized(data, stats, device=device, module=cast(Any, self))
                if tuple(new.quant_state.shape) != shape:
                    raise q4.QuantStateError(
                        f"'{weight_key}' quant_state shape {tuple(new.quant_state.shape)} does not match "
                        f"this table's {shape}"
                    )
                self.weight = new
                self.quant_state = new.quant_state
            elif stats:
                raise q4.QuantStateError(
                    f"'{weight_key}' has quantization entries {sorted(weight_key + '.' + k for k in stats)} but no "
                    f"'{weight_key}.{JSON_KEY_PREFIX}<nf4|fp4>' entry"
                )
            else:
                if tuple(data.shape) != shape or not data.is_floating_point():
                    raise ValueError(
                        f"'{weight_key}' must be packed 4-bit entries or a float table of shape {shape}, "
                        f"got {data.dtype} {tuple(data.shape)}"
                    )
                w = self.weight
                if not isinstance(w, Params4bit):
                    raise TypeError(f"weight must be a Params4bit, got {type(w).__name__}")
                was_quantized = w.bnb_quantized
                self.weight = w.with_data(
                    data.detach().to(device, copy=True),
                    requires_grad=False,
                    quant_state=None,
                    module=cast(Any, self),
                    bnb_quantized=False,
                )
                self.quant_state = None
                if was_quantized:  # a float table into a quantized layer: quantize it the same way
                    self.quantize()
        except (ValueError, TypeError) as e:
            errs.append(f"while loading '{weight_key}': {e}")


class _FixedQuantType(Embedding4bit):
    """Embedding4bit with its quant_type fixed by the subclass (bitsandbytes'
    EmbeddingFP4 / EmbeddingNF4 signatures)."""

    QUANT_TYPE = ""

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        dtype: torch.dtype | None = None,
        quant_storage: torch.dtype = torch.uint8,
        device=None,
    ):
        super().__init__(
            num_embeddings,
            embedding_dim,
            dtype=dtype,
            quant_type=self.QUANT_TYPE,
            quant_storage=quant_storage,
            device=device,
        )


class EmbeddingFP4(_FixedQuantType):
    """Embedding4bit with FP4 codes."""

    QUANT_TYPE = "fp4"


class EmbeddingNF4(_FixedQuantType):
    """Embedding4bit with NF4 codes."""

    QUANT_TYPE = "nf4"


class Embedding8bit(nn.Embedding):
    """An embedding table quantized to int8 with one absmax per row (LLM.int8's
    row format), as bitsandbytes.nn.Embedding8bit: quantized on the first move
    to a device (the table rounded to fp16 first); the weight is frozen.

    ``forward(input)`` returns ``CB[input] * (SCB[input] / 127)`` (fp32) cast
    to ``self.dtype`` (the table's dtype at construction).
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, device=None, dtype: torch.dtype | None = None):
        super().__init__(num_embeddings, embedding_dim, device=device, dtype=dtype)
        self.dtype = self.weight.data.dtype
        self.weight = Int8Params(self.weight.data, has_fp16_weights=False, requires_grad=False)

    def quantize(self) -> Embedding8bit:
        """Quantize the table now, on its current device (no-op if quantized)."""
        w = self.weight
        if not isinstance(w, Int8Params):
            raise TypeError(f"weight must be an Int8Params, got {type(w).__name__}")
        if w.dtype != torch.int8:
            w._quantize(w.device)
        return self

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        w = self.weight
        scb = getattr(w, "SCB", None)
        if w.dtype != torch.int8 or scb is None:
            raise RuntimeError(
                "Embedding8bit weight is not quantized yet: call .to(device) or .quantize() before the forward"
                if w.dtype != torch.int8
                else "Embedding8bit weight is int8 but has no SCB (row scales); load a checkpoint with an 'SCB' entry"
            )
        input = check_indices(input, self.num_embeddings, "Embedding8bit")
        rows = w.detach()[input]
        stats = scb[input].unsqueeze(-1)
        return (rows * (stats / 127.0)).to(self.dtype)

    def _apply(self, fn, recurse=True):
        return apply_keeping_scb(self, super()._apply, fn, recurse)

    # -- checkpoints

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        super()._save_to_state_dict(destination, prefix, keep_vars)
        w = self.weight
        if w.dtype == torch.int8:
            scb = getattr(w, "SCB", None)
            if scb is None:
                raise RuntimeError(f"cannot save {prefix}weight: it is int8 but has no SCB (row scales)")
            save_int8_entries(destination, prefix, scb, keep_vars)

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, errs):
        """Validates everything first and changes nothing on error; loaded
        tensors are copied onto the layer's device."""
        for hook in self._load_state_dict_pre_hooks.values():
            hook(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, errs)
        k_w, k_scb, k_fmt = prefix + "weight", prefix + "SCB", prefix + "weight_format"
        n_errs = len(errs)
        shape = (self.num_embeddings, self.embedding_dim)
        w = self.weight
        check_weight_format(state_dict, k_fmt, errs)
        new_w = new_scb = None
        w_in, scb_in = state_dict.get(k_w), state_dict.get(k_scb)
        device = w.device
        if w_in is not None and not isinstance(w_in, torch.Tensor):
            errs.append(f"{k_w}: expected a tensor, got {type(w_in).__name__}")
        elif w_in is not None and tuple(w_in.shape) != shape:
            errs.append(f"size mismatch for {k_w}: checkpoint has {tuple(w_in.shape)}, the table is {shape}")
        elif w_in is not None and w_in.dtype == torch.int8:
            if scb_in is None:
                errs.append(f"{k_scb} is missing: an int8 {k_w} needs its row scales")
            elif not isinstance(scb_in, torch.Tensor) or not scb_in.is_floating_point() or scb_in.dim() != 1:
                what = f"{scb_in.dtype} {tuple(scb_in.shape)}" if isinstance(scb_in, torch.Tensor) else type(scb_in)
                errs.append(f"{k_scb} must be a 1-D float tensor, got {what}")
            elif scb_in.shape[0] != self.num_embeddings:
                errs.append(f"{k_scb} has {scb_in.shape[0]} values, the table has {self.num_embeddings} rows")
            elif not isinstance(w, Int8Params):
                errs.append(f"{k_w}: this layer's weight is a {type(w).__name__}, not an Int8Params")
            else:
                new_w = w_in.detach().to(device, copy=True)
                new_scb = scb_in.detach().to(device, torch.float32, copy=True)
        elif w_in is not None and w_in.is_floating_point():
            if scb_in is not None:
                errs.append(f"{k_scb} given with a float (unquantized) {k_w} ({w_in.dtype})")
            elif w.dtype == torch.int8:
                errs.append(
                    f"{k_w} is a float ({w_in.dtype}) table but this layer is already quantized; "
                    "load it before the layer's first .to(device), or into a fresh layer"
                )
            else:
                new_w = w_in.detach().to(device, w.dtype, copy=True)
        elif w_in is not None:
            errs.append(f"{k_w} must be int8 (quantized) or float, got {w_in.dtype}")
        elif scb_in is not None:
            errs.append(f"{k_scb} given without {k_w}")
        if len(errs) > n_errs:
            return
        if new_w is not None:
            with torch.no_grad():
                w.data = new_w
            if isinstance(w, Int8Params):
                w.CB, w.SCB = (new_w, new_scb) if new_scb is not None else (None, None)
        if strict:
            if w_in is None:
                missing_keys.append(k_w)
            known = {"weight", "SCB", "weight_format"}
            unexpected_keys.extend(k for k in state_dict if k.startswith(prefix) and k[len(prefix) :] not in known)


class StableEmbedding(nn.Embedding):
    """bitsandbytes.nn.StableEmbedding: an nn.Embedding initialised with
    Xavier uniform (padding row zeroed) whose lookups go through a LayerNorm
    computed in the default dtype, returned in the table's dtype. As in
    bitsandbytes, the weight is registered with the optimizer manager
    (q4torch.optim.GlobalOptimManager) for 32-bit optimizer state.

    ``device`` and ``dtype`` are passed to nn.Embedding by keyword: bitsandbytes
    passes them by position, after ``_weight``, where nn.Embedding takes
    ``_freeze`` and ``device``, so there ``dtype=torch.bfloat16`` fails and
    ``device="cpu"`` freezes the table.
    """

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        padding_idx: int | None = None,
        max_norm: float | None = None,
        norm_type: float = 2.0,
        scale_grad_by_freq: bool = False,
        sparse: bool = False,
        _weight: torch.Tensor | None = None,
        device=None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__(
            num_embeddings,
            embedding_dim,
            padding_idx,
            max_norm,
            norm_type,
            scale_grad_by_freq,
            sparse,
            _weight,
            device=device,
            dtype=dtype,
        )
        self.norm = nn.LayerNorm(embedding_dim, device=device)
        from q4torch._src.optim import GlobalOptimManager

        GlobalOptimManager.get_instance().register_module_override(self, "weight", {"optim_bits": 32})

    def reset_parameters(self) -> None:
        nn.init.xavier_uniform_(self.weight)
        self._fill_padding_idx_with_zero()

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        emb = F.embedding(
            input, self.weight, self.padding_idx, self.max_norm, self.norm_type, self.scale_grad_by_freq, self.sparse
        )
        # the layer norm always runs in full precision
        emb = emb.to(torch.get_default_dtype())
        return self.norm(emb).to(self.weight.dtype)


def quantized_embedding(emb: nn.Embedding, quant_type: str, blocksize: int, compress_statistics: bool) -> nn.Module:
    """An Embedding4bit ('nf4' / 'fp4') or Embedding8bit ('int8') holding `emb`'s
    table, quantized on its device (used by replace_linear and load_quantized).
    An nn.Embedding with max_norm (which renormalises rows in place on every
    lookup) cannot be frozen into a quantized table: ValueError."""
    formats.check_layer_type(quant_type)
    if emb.max_norm is not None:
        raise ValueError(
            f"an nn.Embedding with max_norm={emb.max_norm} renormalises its table on every lookup and cannot be "
            "quantized; skip it"
        )
    w = emb.weight.detach()
    device = w.device
    new: Embedding4bit | Embedding8bit
    if quant_type == "int8":
        new = Embedding8bit(emb.num_embeddings, emb.embedding_dim, device="meta", dtype=w.dtype)
    else:
        new = Embedding4bit(emb.num_embeddings, emb.embedding_dim, dtype=w.dtype, quant_type=quant_type, device="meta")
    new.weight = quantized_weight(new, w, blocksize, compress_statistics, quant_type)
    return new.to(device)
