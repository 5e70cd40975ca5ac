"""Two-process FSDP2 checks for Linear4bit (run by test_fsdp.py, or by hand):

    python tests/torch/fsdp_worker.py REPORT.json WORKDIR

Spawns 2 ranks (gloo on CPU, a FileStore in WORKDIR, collective timeout 120 s),
runs every check on both ranks and writes one JSON report: ``checks`` (name ->
{"ok": true only if it held on every rank, "detail": per-rank details}),
``facts`` (measured numbers for the README) and ``warnings`` (every warning
raised in the ranks, recorded instead of printed).

Comparisons of packed bytes are always on integer views, never on floats
(NaN != NaN, and a float comparison would hide a rewritten payload).
"""

from __future__ import annotations

import copy
import json
import os
import sys
import tempfile
import time
import traceback
import warnings
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.tensor import DTensor, Shard

import q4torch
import q4torch.functional as q4f
from q4torch.nn import Linear4bit, Params4bit

WORLD = 2
SEED = 20240
# fp32 gradients summed in a different order (full batch vs per-rank halves):
# max |difference| <= RTOL[dtype] * max |reference| (measured here: 2.8e-7)
RTOL = {torch.float32: 1e-5}


# ---------------------------------------------------------------- helpers


def bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bytes of t (flattened), for bit-exact comparisons."""
    if isinstance(t, DTensor):
        t = t.to_local()
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.numel() == b.numel() and torch.equal(bits(a), bits(b))


def n_changed16(a: torch.Tensor, b: torch.Tensor) -> int:
    """How many 16-bit elements differ between two equally long byte buffers."""
    return int((bits(a).view(torch.int16) != bits(b).view(torch.int16)).sum())


def same_state(a: q4f.QuantState, b: q4f.QuantState) -> bool:
    """Equal states, and bit-identical checkpoint entries (absmax, code books, JSON)."""
    pa, pb = a.as_dict(packed=True), b.as_dict(packed=True)
    return a == b and pa.keys() == pb.keys() and all(same_bits(pa[k], pb[k]) for k in pa)


def shard_rows(rows: int, rank: int) -> tuple[int, int]:
    """The rows of a dim-0 shard as torch.chunk (and FSDP2) cut them."""
    per = -(-rows // WORLD)
    start = min(rank * per, rows)
    return start, min(start + per, rows)


class Report:
    """Per-rank results; merged across ranks at the end."""

    def __init__(self, rank: int):
        self.rank, self.checks, self.facts = rank, {}, {}

    def check(self, name: str, ok: bool, **detail) -> None:
        if name in self.checks:
            raise KeyError(f"check {name!r} recorded twice")
        self.checks[name] = {"ok": bool(ok), "detail": detail}

    def raises(self, name: str, fn, exc_types, must_contain: str) -> None:
        """fn() must raise one of exc_types with must_contain in the message."""
        try:
            fn()
        except exc_types as e:
            msg = str(e)
            self.check(name, must_contain in msg, error=type(e).__name__, message=msg[:500], wanted=must_contain)
            return
        self.check(name, False, message="no error raised", wanted=must_contain)


def rng_tensor(rng, shape, scale=1.0) -> torch.Tensor:
    return torch.from_numpy(rng.standard_normal(shape).astype(np.float32) * scale)


# ---------------------------------------------------------------- models


class LoraBlock(nn.Module):
    """A frozen 4-bit base layer plus a trainable low-rank update (QLoRA's shape)."""

    def __init__(self, k, n, quant_type, nested, storage, r=4):
        super().__init__()
        self.base = Linear4bit(k, n, compress_statistics=nested, quant_type=quant_type, quant_storage=storage)
        self.lora_a = nn.Linear(k, r, bias=False)
        self.lora_b = nn.Linear(r, n, bias=False)

    def forward(self, x):
        return self.base(x) + self.lora_b(self.lora_a(x))


class LoraModel(nn.Module):
    """Block 1: NF4 nested, 37x100 -> 925 bf16 rows (odd: uneven shards).
    Block 2: FP4 plain, 48x37 -> 444 rows (even shards), storage `storage2`."""

    def __init__(self, storage=torch.bfloat16, storage2=torch.bfloat16):
        super().__init__()
        self.block1 = LoraBlock(100, 37, "nf4", True, storage)
        self.block2 = LoraBlock(37, 48, "fp4", False, storage2)
        self.head = nn.Linear(48, 5)

    def forward(self, x):
        return self.head(self.block2(torch.relu(self.block1(x))))


def make_lora_model(seed, storage=torch.bfloat16, storage2=torch.bfloat16) -> LoraModel:
    torch.manual_seed(seed)  # the same float weights on every rank
    model = LoraModel(storage, storage2)
    for block in (model.block1, model.block2):
        block.base.quantize()
        assert block.base.weight.dtype == block.base.quant_storage
    return model


def shard_lora_model(model, **kwargs) -> LoraModel:
    for block in (model.block1, model.block2):
        q4torch.fully_shard(block, **kwargs)
    q4torch.fully_shard(model, **kwargs)
    return model


# Shapes whose packed bytes hold all 65,536 16-bit patterns, with an odd number
# of rows of the storage dtype (uneven shards over 2 ranks).
PATTERN_SHAPES = {
    torch.bfloat16: (509, 516),  # 131,322 bytes = 65,661 bf16 rows
    torch.float16: (509, 516),
    torch.float32: (509, 520),  # 132,340 bytes = 33,085 fp32 rows
}


def pattern_layer(storage: torch.dtype, rng, fresh: bool = False) -> Linear4bit:
    """A Linear4bit whose packed bytes, viewed as 16-bit words, enumerate all
    65,536 patterns (in a seeded random order; the rest random), with a valid
    nested NF4 QuantState from quantizing a random weight of the same shape.

    fresh=True: an ordinary layer of the same shape instead (a constant weight:
    other bytes, and a nested offset of 0.5 whose JSON entry is shorter)."""
    n, k = PATTERN_SHAPES[storage]
    w = torch.full((n, k), 0.5) if fresh else rng_tensor(rng, (n, k), 0.05)
    packed, qs = q4f.quantize_4bit(w, blocksize=64, compress_statistics=True, quant_type="nf4")
    if not fresh:
        words = rng.permutation(65536).astype(np.uint16).view(np.uint8)
        extra = rng.integers(0, 256, packed.numel() - words.size, dtype=np.uint8)
        packed = torch.from_numpy(np.concatenate([words, extra]))
    layer = Linear4bit(k, n, quant_type="nf4", quant_storage=storage)
    data = packed.reshape(-1).view(storage).reshape(-1, 1)
    layer.weight = Params4bit.from_prequantized(data, qs.as_dict(packed=True), device="cpu", module=layer)
    return layer


class PatternBank(nn.Module):
    """One pattern layer per storage dtype, each applied to its own input."""

    def __init__(self, rng, fresh=False):
        super().__init__()
        self.bf16 = pattern_layer(torch.bfloat16, rng, fresh)
        self.fp16 = pattern_layer(torch.float16, rng, fresh)
        self.fp32 = pattern_layer(torch.float32, rng, fresh)

    def layers(self):
        return {"bf16": self.bf16, "fp16": self.fp16, "fp32": self.fp32}

    def forward(self, xs):
        return [layer(xs[name]) for name, layer in self.layers().items()]


# ---------------------------------------------------------------- checks


def check_lora_forward_backward(rep: Report, rank: int) -> None:
    """FSDP2 model vs the same model unsharded: outputs, input grads, parameter grads."""
    rng = np.random.default_rng(SEED)
    model = make_lora_model(SEED)
    ref = copy.deepcopy(model)
    shard_lora_model(model)

    # the QuantState follows the weight: whole (not sharded) on every rank, attached to the DTensor
    for name in ("block1", "block2"):
        layer, ref_layer = getattr(model, name).base, getattr(ref, name).base
        rep.check(
            f"quant_state_after_shard_{name}",
            isinstance(layer.weight, DTensor)
            and layer.weight.quant_state is layer.quant_state
            and same_state(layer.quant_state, ref_layer.quant_state),
        )
        rows = ref_layer.weight.shape[0]
        lo, hi = shard_rows(rows, rank)
        rep.check(
            f"local_shard_bits_{name}",
            same_bits(layer.weight.to_local(), ref_layer.weight.data[lo:hi]),
            rows=rows,
            local_rows=int(layer.weight.to_local().shape[0]),
        )

    # (1) the same batch on both ranks: everything bit-exact (see test_fsdp.py)
    x_all = rng_tensor(rng, (2 * WORLD, 100))
    g_all = rng_tensor(rng, (2 * WORLD, 5))
    x = x_all.clone().requires_grad_(True)
    xr = x_all.clone().requires_grad_(True)
    y, yr = model(x), ref(xr)
    y.backward(g_all)
    yr.backward(g_all)
    rep.check("same_batch_output_bit_exact", same_bits(y, yr))
    rep.check("same_batch_input_grad_bit_exact", same_bits(x.grad, xr.grad))
    grads = {n: p.grad.full_tensor() for n, p in model.named_parameters() if p.requires_grad}
    ref_grads = {n: p.grad for n, p in ref.named_parameters() if p.requires_grad}
    rep.check(
        "same_batch_param_grads_bit_exact",
        grads.keys() == ref_grads.keys() and all(same_bits(grads[n], ref_grads[n]) for n in grads),
        params=sorted(grads),
        mismatched=[n for n in grads if not same_bits(grads[n], ref_grads.get(n, torch.empty(0)))],
    )
    rep.check(
        "frozen_packed_weights_have_no_grad",
        all(getattr(model, b).base.weight.grad is None for b in ("block1", "block2")),
    )

    # (2) data parallel: each rank its own half of the batch
    model.zero_grad(set_to_none=True)
    rows = slice(rank * 2, rank * 2 + 2)
    x = x_all[rows].clone().requires_grad_(True)
    y = model(x)
    y.backward(g_all[rows])
    per_rank = []
    for r in range(WORLD):  # the unsharded model on each rank's half
        ref.zero_grad(set_to_none=True)
        xr = x_all[r * 2 : r * 2 + 2].clone().requires_grad_(True)
        yr = ref(xr)
        yr.backward(g_all[r * 2 : r * 2 + 2])
        per_rank.append(
            (yr.detach(), xr.grad, {n: p.grad.clone() for n, p in ref.named_parameters() if p.requires_grad})
        )
    rep.check("dp_output_bit_exact", same_bits(y, per_rank[rank][0]))
    rep.check("dp_input_grad_bit_exact", same_bits(x.grad, per_rank[rank][1]))
    grads = {n: p.grad.full_tensor() for n, p in model.named_parameters() if p.requires_grad}
    # FSDP2 over gloo: each rank's gradient times 1/2 (exact), then one fp32 addition of the two
    mean_of_halves = {n: per_rank[0][2][n] * 0.5 + per_rank[1][2][n] * 0.5 for n in grads}
    rep.check(
        "dp_param_grads_equal_mean_of_per_rank_grads_bit_exact",
        all(same_bits(grads[n], mean_of_halves[n]) for n in grads),
        mismatched=[n for n in grads if not same_bits(grads[n], mean_of_halves[n])],
    )
    # vs the unsharded model on the whole batch (mean over ranks): fp32 summation order differs
    ref.zero_grad(set_to_none=True)
    ref(x_all).backward(g_all / WORLD)
    worst = {}
    for n, p in ref.named_parameters():
        if p.requires_grad:
            scale = float(p.grad.abs().max())
            worst[n] = float((grads[n] - p.grad).abs().max()) / max(scale, 1e-30)
    rep.check("dp_param_grads_close_to_full_batch", max(worst.values()) <= RTOL[torch.float32], rel=worst)
    rep.facts["dp_full_batch_grad_max_rel_diff"] = max(worst.values())

    # after a forward, FSDP's all-gathered parameter (reused every step) carries the state too (last: in
    # torch 2.13 a no_grad forward of the FSDP root doubles the root's gradients in the next backward)
    seen = {}
    hook = model.block1.base.register_forward_pre_hook(
        lambda m, args: seen.update(dtensor=isinstance(m.weight, DTensor), same=m.weight.quant_state is m.quant_state)
    )
    with torch.no_grad():
        model(x_all)
    hook.remove()
    rep.check("unsharded_param_carries_quant_state", seen == {"dtensor": False, "same": True}, seen=seen)


def check_mixed_precision_allowed(rep: Report, rank: int) -> None:
    """MixedPrecisionPolicy(param_dtype=bf16) with bf16 storage (no cast) and with
    uint8 storage (FSDP never casts integers): packed bytes arrive unchanged and
    the output equals the unsharded model run in bf16."""
    rng = np.random.default_rng(SEED + 1)
    model = make_lora_model(SEED + 1, torch.bfloat16, torch.uint8)
    ref = copy.deepcopy(model)
    for p in ref.parameters():
        if p.dtype == torch.float32:
            p.data = p.data.to(torch.bfloat16)
    shard_lora_model(model, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16))
    seen = {}
    for name in ("block1", "block2"):
        getattr(model, name).base.register_forward_pre_hook(
            lambda m, args, name=name: seen.__setitem__(name, m.weight.detach().clone())
        )
    x = rng_tensor(rng, (3, 100))
    y = model(x)
    yr = ref(x.to(torch.bfloat16))
    rep.check("mp_bf16_output_equals_bf16_unsharded_bit_exact", y.dtype == torch.bfloat16 and same_bits(y, yr))
    for name in ("block1", "block2"):
        rep.check(
            f"mp_bf16_all_gathered_bits_{name}",
            same_bits(seen[name], getattr(ref, name).base.weight.data),
            storage=str(seen[name].dtype),
        )


def check_refusals(rep: Report, rank: int) -> None:
    """Bad sharding requests raise errors that name the bad value."""
    fp32_policy = MixedPrecisionPolicy(param_dtype=torch.float32)
    fp16_policy = MixedPrecisionPolicy(param_dtype=torch.float16)
    rep.raises(
        "refuse_param_dtype_fp32_for_bf16_storage",
        lambda: q4torch.fully_shard(make_lora_model(1).block1, mp_policy=fp32_policy),
        ValueError,
        "param_dtype=torch.float32",
    )
    rep.raises(
        "refuse_param_dtype_fp16_for_bf16_storage",
        lambda: q4torch.fully_shard(make_lora_model(1), mp_policy=fp16_policy),
        ValueError,
        "param_dtype=torch.float16",
    )
    rep.raises(
        "refuse_param_dtype_bf16_for_fp32_storage",
        lambda: q4torch.fully_shard(
            make_lora_model(1, storage2=torch.float32).block2,
            mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16),
        ),
        ValueError,
        "quant_storage torch.float32",
    )
    rep.raises(
        "refuse_shard_dim_1",
        lambda: q4torch.fully_shard(make_lora_model(1).block1, shard_placement_fn=lambda p: Shard(1)),
        ValueError,
        "returned Shard(dim=1)",
    )
    unquantized = LoraBlock(16, 8, "nf4", True, torch.bfloat16)
    rep.raises(
        "refuse_unquantized_layer",
        lambda: q4torch.fully_shard(nn.Sequential(unquantized)),
        ValueError,
        "Linear4bit '0.base' is not quantized",
    )
    # nothing was sharded by a refused call
    rep.check("refused_call_left_layer_alone", isinstance(unquantized.base.weight, Params4bit))

    # torch's fully_shard directly (no early check): the forward refuses the cast weight
    model = make_lora_model(2)
    x = torch.zeros(2, 100)
    torch_fully_shard(model.block1, mp_policy=fp32_policy)
    torch_fully_shard(model, mp_policy=fp32_policy)
    rep.raises("forward_refuses_fp32_cast_weight", lambda: model(x), TypeError, "arrived as torch.float32")
    model = make_lora_model(2)
    torch_fully_shard(model)  # root only: a child called on its own sees its DTensor shard
    rep.raises("forward_refuses_dtensor_shard", lambda: model.block1.base(x), RuntimeError, "DTensor shard")


def check_cast_damage(rep: Report, rank: int) -> None:
    """What a param_dtype cast does to packed bytes (facts for the README): the
    65,536-pattern bf16 layer sharded by torch's fully_shard with param_dtype
    fp32 / fp16, all-gathered, then viewed back as bf16."""
    for dtype in (torch.float32, torch.float16):
        rng = np.random.default_rng(SEED + 2)
        layer = pattern_layer(torch.bfloat16, rng)
        original = layer.weight.data.clone()
        torch_fully_shard(layer, mp_policy=MixedPrecisionPolicy(param_dtype=dtype))
        layer.unshard()
        gathered = layer.weight.detach()
        name = str(dtype).removeprefix("torch.")
        back = gathered.to(torch.bfloat16)
        rep.facts[f"param_dtype_{name}_all_gathered_dtype"] = str(gathered.dtype)
        rep.facts[f"param_dtype_{name}_patterns_changed_after_cast_back"] = n_changed16(back, original)
        if dtype == torch.float32:
            # bf16 -> fp32 widens exactly (payloads kept); the damage is any cast back (or a uint8 view of fp32)
            widened = (gathered.contiguous().view(torch.int32) >> 16).to(torch.int16)
            rep.facts["param_dtype_float32_widening_exact"] = bool(torch.equal(widened, original.view(torch.int16)))
        layer.reshard()
    rep.check("cast_damage_measured", True)


def check_patterns(rep: Report, rank: int, workdir: str) -> None:
    """All 65,536 16-bit patterns (bf16, fp16; and the same bytes as fp32) through
    shard -> all-gather -> DCP save -> DCP load into a fresh sharded model."""
    rng = np.random.default_rng(SEED + 3)
    bank = PatternBank(rng)
    ref = copy.deepcopy(bank)
    original = {n: layer.weight.data.clone() for n, layer in ref.layers().items()}
    states = {n: layer.quant_state for n, layer in ref.layers().items()}
    xs = {n: rng_tensor(rng, (3, layer.in_features)) for n, layer in ref.layers().items()}
    want = ref(xs)
    for n, w in original.items():
        words = bits(w).view(torch.int16)
        rep.facts[f"pattern_{n}_distinct_16bit_words"] = int(torch.unique(words).numel())
        rep.facts[f"pattern_{n}_nan_elements"] = int(torch.isnan(w).sum())
        rep.facts[f"pattern_{n}_rows"] = int(w.shape[0])

    for layer in bank.layers().values():
        q4torch.fully_shard(layer)
    q4torch.fully_shard(bank)

    def check_all(stage: str, model: PatternBank) -> None:
        for n, layer in model.layers().items():
            w = layer.weight
            lo, hi = shard_rows(original[n].shape[0], rank)
            rep.check(
                f"{stage}_{n}_local_shard_bits",
                isinstance(w, DTensor) and same_bits(w.to_local(), original[n][lo:hi]),
                local_rows=int(w.to_local().shape[0]),
            )
            rep.check(f"{stage}_{n}_full_tensor_bits", same_bits(w.full_tensor(), original[n]))
            layer.unshard()
            gathered = layer.weight
            rep.check(
                f"{stage}_{n}_unsharded_param_bits",
                not isinstance(gathered, DTensor) and same_bits(gathered, original[n]),
                changed_words=n_changed16(gathered, original[n]) if gathered.numel() == original[n].numel() else None,
            )
            layer.reshard()
            rep.check(
                f"{stage}_{n}_quant_state",
                same_state(layer.quant_state, states[n]) and layer.weight.quant_state is layer.quant_state,
            )
        seen = {}
        hooks = [
            layer.register_forward_pre_hook(lambda m, a, n=n: seen.__setitem__(n, m.weight.detach().clone()))
            for n, layer in model.layers().items()
        ]
        got = model(xs)
        for hook in hooks:
            hook.remove()
        for i, n in enumerate(model.layers()):
            rep.check(f"{stage}_{n}_forward_sees_original_bits", same_bits(seen[n], original[n]))
            rep.check(f"{stage}_{n}_output_bit_exact", same_bits(got[i], want[i]))

    check_all("sharded", bank)

    ckpt = os.path.join(workdir, "dcp_patterns")
    t0 = time.perf_counter()
    dcp.save({"model": bank.state_dict()}, checkpoint_id=ckpt)
    rep.facts["dcp_save_s"] = round(time.perf_counter() - t0, 3)
    keys = sorted(bank.state_dict())
    rep.check(
        "state_dict_has_quant_state_entries",
        all(
            f"{n}.weight.{k}" in keys
            for n in ("bf16", "fp16", "fp32")
            for k in ("absmax", "quant_map", "nested_absmax", "quant_state.bitsandbytes__nf4")
        ),
        keys=keys,
    )

    # a fresh model with other bytes and another nested offset (a JSON entry of another length)
    fresh = PatternBank(np.random.default_rng(SEED + 4), fresh=True)
    json_key = "bf16.weight.quant_state.bitsandbytes__nf4"
    len_saved = int(bank.state_dict()[json_key].numel())
    len_fresh = int(fresh.state_dict()[json_key].numel())
    rep.facts["json_entry_length_saved_vs_fresh"] = [len_saved, len_fresh]
    for layer in fresh.layers().values():
        q4torch.fully_shard(layer)
    q4torch.fully_shard(fresh)
    rep.check(
        "fresh_model_differs_before_load",
        all(not same_bits(layer.weight.full_tensor(), original[n]) for n, layer in fresh.layers().items()),
    )
    if len_saved != len_fresh:  # DCP's default planner cannot load a JSON entry of another length in place
        try:
            dcp.load({"model": fresh.state_dict()}, checkpoint_id=ckpt)
            rep.check("default_planner_refuses_other_json_length", False, message="loaded")
        except CheckpointException as e:
            rep.check("default_planner_refuses_other_json_length", "Size mismatch" in str(e), message=str(e)[-300:])
    state = {"model": fresh.state_dict()}
    t0 = time.perf_counter()
    dcp.load(state, checkpoint_id=ckpt, planner=q4torch.QuantStateLoadPlanner())
    result = fresh.load_state_dict(state["model"])
    rep.facts["dcp_load_s"] = round(time.perf_counter() - t0, 3)
    rep.check("load_state_dict_clean", not result.missing_keys and not result.unexpected_keys, result=str(result))
    check_all("reloaded", fresh)

    # the whole (unsharded) checkpoint into a sharded model, distributed by torch's state-dict API
    plain = ref.state_dict()
    other = PatternBank(np.random.default_rng(SEED + 5), fresh=True)
    for layer in other.layers().values():
        q4torch.fully_shard(layer)
    q4torch.fully_shard(other)
    result = set_model_state_dict(other, plain, options=StateDictOptions(full_state_dict=True))
    rep.check(
        "whole_checkpoint_into_sharded_model",
        not result.missing_keys
        and not result.unexpected_keys
        and all(
            same_bits(layer.weight.full_tensor(), original[n]) and same_state(layer.quant_state, states[n])
            for n, layer in other.layers().items()
        ),
    )
    rep.raises(
        "refuse_float_checkpoint_into_sharded_layer",
        lambda: other.bf16.load_state_dict({"weight": torch.zeros(509, 516), "bias": other.bf16.bias.detach()}),
        RuntimeError,
        "a sharded weight cannot be quantized",
    )
    packed = {k[len("bf16.") :]: v for k, v in ref.state_dict().items() if k.startswith("bf16.")}  # plain tensors
    rep.raises(
        "refuse_plain_tensor_into_sharded_layer",
        lambda: other.bf16.load_state_dict({**packed, "bias": other.bf16.bias.detach()}),
        RuntimeError,
        "is a plain torch.bfloat16 tensor",
    )

    if rank == 0:  # for the test process: the DCP checkpoint as one torch.save file, and the unsharded original
        dcp_to_torch_save(ckpt, os.path.join(workdir, "patterns_converted.pt"))
        torch.save(ref.state_dict(), os.path.join(workdir, "patterns_original.pt"))

    # torch.distributed.checkpoint.state_dict resolves "weight.absmax" etc. by getattr on the DTensor
    sd = get_model_state_dict(fresh)
    rep.check(
        "get_model_state_dict_resolves_quant_entries",
        sorted(sd) == keys and same_bits(sd["bf16.weight"].full_tensor(), original["bf16"]),
    )


def run_rank(rank: int, workdir: str, out_dir: str) -> None:
    torch.set_num_threads(1)
    rep = Report(rank)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        store = dist.FileStore(os.path.join(workdir, "store"), WORLD)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=WORLD, timeout=timedelta(seconds=120))
        timings = {}
        try:
            for name, fn in (
                ("lora_forward_backward", lambda: check_lora_forward_backward(rep, rank)),
                ("mixed_precision_allowed", lambda: check_mixed_precision_allowed(rep, rank)),
                ("refusals", lambda: check_refusals(rep, rank)),
                ("cast_damage", lambda: check_cast_damage(rep, rank)),
                ("patterns", lambda: check_patterns(rep, rank, workdir)),
            ):
                t0 = time.perf_counter()
                try:
                    fn()
                except (Exception, CheckpointException):  # recorded; the test reports it as a failed check
                    rep.check(f"{name}_ran", False, traceback=traceback.format_exc()[-3000:])
                else:
                    rep.check(f"{name}_ran", True)
                timings[name] = round(time.perf_counter() - t0, 3)
                dist.barrier()
        finally:
            dist.destroy_process_group()
    rep.facts["seconds"] = timings
    rep_warnings = [f"{w.category.__name__}: {w.message} ({os.path.basename(w.filename)}:{w.lineno})" for w in caught]
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump({"checks": rep.checks, "facts": rep.facts, "warnings": rep_warnings}, f, default=str)


def merge(out_dir: str) -> dict:
    ranks = []
    for r in range(WORLD):
        with open(os.path.join(out_dir, f"rank{r}.json")) as f:
            ranks.append(json.load(f))
    names = sorted(set().union(*(rep["checks"] for rep in ranks)))
    checks = {}
    for name in names:
        per = [rep["checks"].get(name, {"ok": False, "detail": {"missing": True}}) for rep in ranks]
        checks[name] = {"ok": all(c["ok"] for c in per), "detail": [c["detail"] for c in per]}
    return {
        "checks": checks,
        "facts": [rep["facts"] for rep in ranks],
        "warnings": sorted({w for rep in ranks for w in rep["warnings"]}),
    }


def main() -> None:
    report_path, workdir = sys.argv[1], sys.argv[2]
    t0 = time.perf_counter()
    out_dir = tempfile.mkdtemp(dir=workdir)
    torch.multiprocessing.start_processes(
        run_rank, args=(workdir, out_dir), nprocs=WORLD, join=True, start_method="spawn"
    )
    report = merge(out_dir)
    report["wall_s"] = round(time.perf_counter() - t0, 2)
    with open(report_path, "w") as f:
        json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
