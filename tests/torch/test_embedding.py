"""q4torch.nn embeddings (Embedding4bit / NF4 / FP4, Embedding8bit,
StableEmbedding): bitsandbytes' bytes and values, lookups against the numpy
oracle, checkpoints, copying, devices, autograd, replace_linear, bad input."""

import copy
import gc
import logging
import pickle
import weakref

import bitsandbytes as bnb
import numpy as np
import pytest
import torch
from q4_reference import inputs, oracle

import q4torch
import q4torch.functional as q4f
from q4torch.nn import Embedding4bit, Embedding8bit, EmbeddingFP4, EmbeddingNF4, StableEmbedding

logging.getLogger("bitsandbytes").setLevel(logging.ERROR)  # its "not divisible by block size" warning

N = 40
TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def _table(rng, n=N, d=65, dtype="float32", kind="normal") -> torch.Tensor:
    x = inputs.make(rng, (n, d), dtype, kind)
    return torch.from_numpy(x.view(np.uint16)).view(torch.bfloat16) if dtype == "bfloat16" else torch.from_numpy(x)


def _ids(rng, shape=(3, 7), n=N) -> torch.Tensor:
    ids = torch.from_numpy(rng.integers(0, n, size=shape))
    ids.view(-1)[:2] = torch.tensor([0, n - 1])  # the first and the last row, always
    return ids


def _layer(cls, table: torch.Tensor, **kw):
    layer = cls(table.shape[0], table.shape[1], dtype=table.dtype, **kw)
    layer.load_state_dict({"weight": table.clone()})
    return layer.to("cpu")


def oracle_table(packed: torch.Tensor, qs: q4f.QuantState) -> np.ndarray:
    """fp32 [rows, dim] from the numpy oracle (nested absmax decoded by it too)."""
    n = int(np.prod(qs.shape))
    absmax = qs.absmax.numpy()
    if qs.nested:
        code = q4f.create_dynamic_map().numpy()  # the library's table (the oracle's own is within 2 ulp)
        absmax = oracle.dequantize_blockwise(absmax, qs.state2.absmax.numpy(), 256, code, float(qs.offset))
    flat = packed.reshape(-1).view(torch.uint8).numpy()
    return oracle.dequantize_4bit(flat, absmax, n, qs.blocksize, qs.quant_type).reshape(tuple(qs.shape))


def _expected(layer, ids: torch.Tensor) -> np.ndarray:
    qs = layer.weight.quant_state
    rows = oracle_table(layer.weight.data, qs)[ids.numpy()]
    return inputs.to_dtype(inputs.to_dtype(rows, str(qs.dtype).removeprefix("torch.")), "float32")


def _bits(t: torch.Tensor) -> np.ndarray:
    t = t.detach()
    return inputs.bits(t.view(torch.int16).numpy() if t.dtype == torch.bfloat16 else t.numpy())


# ------------------------------------------------------------------ bitsandbytes


@pytest.mark.parametrize("quant_type", ["nf4", "fp4"])
@pytest.mark.parametrize("dim", [64, 65, 96, 384])
@pytest.mark.parametrize("quant_storage", [torch.uint8, torch.float32], ids=["u8", "f32"])
def test_same_bytes_as_bitsandbytes(rng, quant_type, dim, quant_storage):
    table = _table(rng, d=dim) * 0.1
    ours = _layer(Embedding4bit, table, quant_type=quant_type, quant_storage=quant_storage)
    theirs = bnb.nn.Embedding4bit(N, dim, quant_type=quant_type, quant_storage=quant_storage)
    theirs.load_state_dict({"weight": table.clone()})
    theirs.to("cpu")
    assert ours.weight.dtype == theirs.weight.dtype == quant_storage
    assert ours.weight.shape == theirs.weight.shape
    assert torch.equal(ours.weight.data.view(torch.uint8), theirs.weight.data.view(torch.uint8))
    qo, qt = ours.weight.quant_state, theirs.weight.quant_state
    assert not qo.nested and not qt.nested and qo.blocksize == qt.blocksize == 64
    assert torch.equal(qo.absmax, qt.absmax)
    ids = _ids(rng)
    got = ours(ids)
    assert np.array_equal(_bits(got), inputs.bits(_expected(ours, ids)))
    if dim % 64 == 0:  # bitsandbytes gathers whole-block rows; an unaligned table goes through its
        # full CPU dequantize, which mis-decodes blocks straddling rows on AVX-512 (README)
        assert torch.equal(got, theirs(ids))


@pytest.mark.parametrize("cls", [EmbeddingNF4, EmbeddingFP4, Embedding8bit])
@pytest.mark.parametrize("dim", [64, 65])
def test_lossless_tables(rng, cls, dim):
    """bitsandbytes' test: a table of +-1 survives quantization exactly."""
    table = torch.from_numpy((rng.standard_normal((N, dim)) > 0).astype(np.float32) * 2 - 1)
    layer = _layer(cls, table)
    ids = _ids(rng, (4, 5, 3))
    assert torch.equal(layer(ids), table[ids])


@pytest.mark.parametrize("dim", [64, 65, 1])
def test_8bit_same_bytes_and_values_as_bitsandbytes(rng, dim):
    table = _table(rng, d=dim)
    ours = _layer(Embedding8bit, table)
    theirs = bnb.nn.Embedding8bit(N, dim)
    theirs.load_state_dict({"weight": table.clone()})
    theirs.to("cpu")
    assert ours.weight.dtype == torch.int8 and not ours.weight.requires_grad
    assert torch.equal(ours.weight.data, theirs.weight.data) and torch.equal(ours.weight.SCB, theirs.weight.SCB)
    ids = _ids(rng, (2, 3, 4))
    got = ours(ids)
    assert got.dtype == torch.float32 and got.shape == (2, 3, 4, dim)
    assert torch.equal(got, theirs(ids))
    # the definition: CB * (SCB / 127) in fp32
    cb, scb = ours.weight.data.numpy(), ours.weight.SCB.numpy()
    want = cb[ids.numpy()].astype(np.float32) * (scb[ids.numpy()] / np.float32(127))[..., None]
    assert np.array_equal(inputs.bits(got.numpy()), inputs.bits(want))


def test_8bit_output_dtype_follows_the_table(rng):
    for name in ("float16", "bfloat16"):
        table = _table(rng, d=33, dtype=name)
        ours, theirs = _layer(Embedding8bit, table), bnb.nn.Embedding8bit(N, 33, dtype=table.dtype)
        theirs.load_state_dict({"weight": table.clone()})
        theirs.to("cpu")
        ids = _ids(rng)
        assert ours(ids).dtype == table.dtype
        assert torch.equal(ours(ids), theirs(ids))


def test_stable_embedding_equals_bitsandbytes(rng):
    torch.manual_seed(0)
    ours = StableEmbedding(N, 48, padding_idx=3)
    assert torch.all(ours.weight[3] == 0)
    bound = (6 / (N + 48)) ** 0.5  # Xavier uniform
    top = float(ours.weight.detach().abs().max())
    assert 0.5 * bound < top <= bound
    theirs = bnb.nn.StableEmbedding(N, 48, padding_idx=3)
    theirs.load_state_dict(ours.state_dict(), strict=True)
    assert sorted(ours.state_dict()) == ["norm.bias", "norm.weight", "weight"]
    with torch.no_grad():
        ours.norm.weight.copy_(torch.from_numpy(inputs.make(rng, (48,), "float32")))
        ours.norm.bias.copy_(torch.from_numpy(inputs.make(rng, (48,), "float32")))
    theirs.load_state_dict(ours.state_dict())
    ids = _ids(rng)
    y_o, y_t = ours(ids), theirs(ids)
    assert torch.equal(y_o, y_t)
    g = torch.from_numpy(inputs.make(rng, tuple(y_o.shape), "float32"))
    (y_o * g).sum().backward()
    (y_t * g).sum().backward()
    for a, b in zip(ours.parameters(), theirs.parameters(), strict=True):
        assert torch.equal(a.grad, b.grad)
    assert torch.all(ours.weight.grad[3] == 0)  # the padding row gets no gradient
    # the definition: F.embedding, LayerNorm in fp32, back to the table's dtype
    half = StableEmbedding(N, 48, dtype=torch.bfloat16)
    want = torch.nn.functional.layer_norm(half.weight[ids].float(), (48,), half.norm.weight, half.norm.bias)
    assert half(ids).dtype == torch.bfloat16 and torch.equal(half(ids), want.to(torch.bfloat16))


# ------------------------------------------------------------------ lookups vs the oracle


LOOKUPS = [
    # (dim, blocksize, nested, dtype, kind)
    (384, 64, False, "float32", "normal"),
    (65, 64, False, "float32", "normal"),  # blocks straddle rows
    (96, 64, True, "float32", "normal"),
    (7, 32, False, "float32", "special"),  # a row inside a block; zeros, denormals, huge values
    (1, 64, True, "float32", "normal"),  # one element per row
    (7, 32, True, "float32", "normal"),
    (33, 4096, True, "float32", "normal"),  # the whole table is one partial block
    (300, 128, True, "bfloat16", "normal"),
    (130, 256, False, "float16", "normal"),
    (64, 32, True, "float32", "zeros"),
]


@pytest.mark.parametrize("quant_type", ["nf4", "fp4"])
@pytest.mark.parametrize(
    "dim, blocksize, nested, dtype, kind",
    LOOKUPS,
    ids=[f"d{d}-bs{b}-{'n' if n else 'p'}-{t}-{k}" for d, b, n, t, k in LOOKUPS],
)
def test_lookup_equals_the_oracle(rng, quant_type, dim, blocksize, nested, dtype, kind):
    """Bit for bit the oracle's dequantized table indexed by the lookup (the
    tail of the table is a partial block whenever N * dim % blocksize != 0)."""
    n = 37  # odd row count: a partial last block for most dims
    table = _table(rng, n, dim, dtype, kind)
    layer = Embedding4bit(n, dim, dtype=table.dtype, quant_type=quant_type)
    layer.weight = q4torch.nn.Params4bit(
        table, blocksize=blocksize, compress_statistics=nested, quant_type=quant_type, module=layer
    )
    layer.to("cpu")
    assert layer.weight.quant_state.nested == nested
    ids = _ids(rng, (5, 11), n)
    got = layer(ids)
    assert got.dtype == table.dtype and got.shape == (5, 11, dim)
    assert np.array_equal(_bits(got.float()), inputs.bits(_expected(layer, ids)))
    # the kernels' full dequantize agrees
    full = q4f.dequantize_4bit(layer.weight.data, layer.weight.quant_state)
    assert np.array_equal(_bits(got), _bits(full[ids]))


@pytest.mark.parametrize("n, dim, blocksize", [(300, 65, 32), (300, 64, 64), (3000, 3, 32)])
def test_nested_lookup_across_256_block_groups(rng, n, dim, blocksize):
    """Tables of several 256-block groups of nested absmax codes: every row,
    including those whose blocks straddle two groups, equals the oracle."""
    layer = EmbeddingNF4(n, dim)
    layer.weight = q4torch.nn.Params4bit(
        _table(rng, n, dim), blocksize=blocksize, compress_statistics=True, quant_type="nf4", module=layer
    )
    layer.to("cpu")
    assert layer.weight.quant_state.state2.absmax.numel() >= 2
    ids = torch.arange(n).reshape(3, -1)
    assert np.array_equal(_bits(layer(ids)), inputs.bits(_expected(layer, ids)))


def test_lookup_reads_only_the_rows_it_returns(rng):
    """Poison every block (packed bytes and absmax) no looked-up row touches:
    the result does not change."""
    dim, bs = 65, 64
    layer = _layer(EmbeddingNF4, _table(rng, d=dim))
    ids = torch.tensor([[5, 6], [20, 5]])
    want = layer(ids)
    qs = layer.weight.quant_state
    touched = set()
    for r in ids.unique().tolist():
        touched.update(range(r * dim // bs, ((r + 1) * dim - 1) // bs + 1))
    other = torch.tensor(sorted(set(range(qs.absmax.numel())) - touched))
    packed = layer.weight.data.view(-1)
    with torch.no_grad():
        qs.absmax[other] = float("nan")
        blocks = packed[: packed.numel() // (bs // 2) * (bs // 2)].view(-1, bs // 2)
        blocks[other[other < blocks.shape[0]]] = 0xFF
    assert torch.equal(layer(ids), want)


@pytest.mark.parametrize("shape", [(), (0,), (10,), (2, 5, 3)], ids=str)
def test_input_shapes(rng, shape):
    for cls in (EmbeddingNF4, Embedding8bit):
        layer = _layer(cls, _table(rng, d=65))
        ids = torch.from_numpy(rng.integers(0, N, size=shape))
        for idx in (ids, ids.to(torch.int32)):
            out = layer(idx)
            assert out.shape == (*shape, 65) and out.dtype == torch.float32
            if ids.numel():
                assert torch.equal(out, layer(ids.reshape(-1)).reshape(*shape, 65))


# ------------------------------------------------------------------ checkpoints


def _state(layer) -> dict:
    return {k: v.clone() for k, v in layer.state_dict().items()}


@pytest.mark.parametrize("nested", [False, True])
def test_4bit_checkpoint_round_trip(rng, nested):
    table = _table(rng, d=65)
    src = Embedding4bit(N, 65, quant_type="nf4")
    src.weight = q4torch.nn.Params4bit(table, blocksize=32, compress_statistics=nested, quant_type="nf4")
    src.to("cpu")
    sd = src.state_dict()
    want_keys = {"weight", "weight.absmax", "weight.quant_map", "weight.quant_state.bitsandbytes__nf4"}
    if nested:
        want_keys |= {"weight.nested_absmax", "weight.nested_quant_map"}
    assert set(sd) == want_keys
    # the entries are Linear4bit's for the same matrix
    lin = q4torch.nn.Linear4bit(65, N, bias=False, compress_statistics=nested, quant_type="nf4")
    lin.weight = q4torch.nn.Params4bit(table, blocksize=32, compress_statistics=nested, quant_type="nf4")
    lin_sd = lin.to("cpu").state_dict()
    assert lin_sd.keys() == sd.keys() and all(torch.equal(lin_sd[k], v) for k, v in sd.items())

    snapshot = _state(src)
    ids = _ids(rng)
    fresh = EmbeddingFP4(N, 65)  # settings overwritten by the checkpoint; loaded before its first .to()
    fresh.load_state_dict(sd, strict=True)
    assert fresh.weight.quant_type == "nf4" and fresh.weight.blocksize == 32
    assert fresh.weight.quant_state.nested == nested
    assert torch.equal(fresh(ids), src(ids))
    fresh.to("cpu")  # a move after loading keeps the loaded bytes
    assert torch.equal(fresh(ids), src(ids))
    assert all(torch.equal(snapshot[k], v) for k, v in sd.items())  # the caller's tensors unchanged
    fresh.weight.data.view(torch.uint8).zero_()
    assert all(torch.equal(snapshot[k], v) for k, v in src.state_dict().items())  # never aliased
    resaved = EmbeddingNF4(N, 65).to("cpu")
    resaved(ids)  # after a forward
    resaved.load_state_dict(sd)
    assert all(torch.equal(resaved.state_dict()[k], v) for k, v in snapshot.items())


def test_4bit_switching_and_float_checkpoints(rng):
    a, b = _table(rng, d=64), _table(rng, d=64)
    layer_a, layer_b = _layer(EmbeddingNF4, a), _layer(EmbeddingNF4, b)
    ids = _ids(rng)
    layer = _layer(EmbeddingNF4, a)
    for src in (layer_b, layer_a, layer_b):
        layer.load_state_dict(src.state_dict())
        assert torch.equal(layer(ids), src(ids))
    layer.load_state_dict({"weight": a})  # float into a quantized layer: quantized with its settings
    assert torch.equal(layer.weight.data, layer_a.weight.data) and torch.equal(layer(ids), layer_a(ids))
    unquantized = EmbeddingNF4(N, 64)
    unquantized.load_state_dict({"weight": a})
    assert unquantized.state_dict().keys() == {"weight"} and unquantized.weight.dtype == torch.float32


def test_8bit_checkpoint_round_trip(rng):
    src = _layer(Embedding8bit, _table(rng, d=65))
    sd = src.state_dict()
    assert set(sd) == {"weight", "SCB", "weight_format"}
    assert sd["weight"].dtype == torch.int8 and sd["SCB"].dtype == torch.float32
    assert sd["weight_format"].dtype == torch.uint8 and int(sd["weight_format"]) == 0
    snapshot = _state(src)
    ids = _ids(rng)
    for fresh in (Embedding8bit(N, 65), Embedding8bit(N, 65).to("cpu")):  # before and after quantization
        fresh.load_state_dict(sd, strict=True)
        assert torch.equal(fresh(ids), src(ids))
        fresh.to("cpu")
        assert torch.equal(fresh(ids), src(ids))
        fresh.weight.data.zero_()
    assert all(torch.equal(snapshot[k], v) for k, v in src.state_dict().items())
    with pytest.raises(RuntimeError, match="already quantized"):
        Embedding8bit(N, 65).to("cpu").load_state_dict({"weight": _table(rng, d=65)})


@pytest.mark.parametrize(
    "corrupt, match",
    [
        (lambda sd: sd.pop("weight.quant_state.bitsandbytes__nf4"), "no 'weight.quant_state"),
        (lambda sd: sd.update({"weight.absmax": sd["weight.absmax"][:-1]}), "absmax"),
        (lambda sd: sd.update({"weight": sd["weight"][:-1]}), "bytes"),
        (
            lambda sd: sd.update({"weight.quant_state.bitsandbytes__nf4": torch.tensor([1, 2, 3], dtype=torch.uint8)}),
            "quant_state",
        ),
        (lambda sd: sd.pop("weight"), "'weight' is missing"),
    ],
    ids=["no-json", "absmax", "truncated", "bad-json", "no-weight"],
)
def test_corrupted_4bit_checkpoints_raise(rng, corrupt, match):
    sd = dict(_layer(EmbeddingNF4, _table(rng, d=65)).state_dict())
    corrupt(sd)
    layer = _layer(EmbeddingNF4, _table(rng, d=65))
    before = _state(layer)
    with pytest.raises(RuntimeError, match=match):
        layer.load_state_dict(sd, strict=True)
    assert all(torch.equal(before[k], v) for k, v in layer.state_dict().items())


@pytest.mark.parametrize("cls", [EmbeddingNF4, Embedding8bit])
def test_strict_loading_reports_unexpected_and_missing_keys(rng, cls):
    sd = dict(_layer(cls, _table(rng, d=65)).state_dict())
    with pytest.raises(RuntimeError, match=r"Unexpected key\(s\) in state_dict: \"extra\""):
        cls(N, 65).load_state_dict({**sd, "extra": torch.zeros(1)}, strict=True)
    cls(N, 65).load_state_dict({**sd, "extra": torch.zeros(1)}, strict=False)
    with pytest.raises(RuntimeError, match=r"Missing key\(s\) in state_dict: \"weight\""):
        cls(N, 65).load_state_dict({}, strict=True)


def test_4bit_checkpoint_of_another_shape_raises(rng):
    sd = _layer(EmbeddingNF4, _table(rng, d=64)).state_dict()
    with pytest.raises(RuntimeError, match=r"does not match this table's \(40, 65\)"):
        EmbeddingNF4(N, 65).load_state_dict(sd)
    with pytest.raises(RuntimeError, match="float table of shape"):
        EmbeddingNF4(N, 65).load_state_dict({"weight": torch.zeros(N, 64)})


@pytest.mark.parametrize(
    "corrupt, match",
    [
        (lambda sd: sd.pop("SCB"), "SCB is missing"),
        (lambda sd: sd.update({"SCB": sd["SCB"][:-1]}), "39 values"),
        (lambda sd: sd.update({"SCB": sd["SCB"].to(torch.int32)}), "1-D float"),
        (lambda sd: sd.update({"weight_format": torch.tensor(2, dtype=torch.uint8)}), "row-major"),
        (lambda sd: sd.update({"weight_format": torch.tensor(9, dtype=torch.uint8)}), "unknown"),
        (lambda sd: sd.update({"weight": sd["weight"][:, :-1]}), "size mismatch"),
        (lambda sd: sd.update({"weight": sd["weight"].to(torch.int32)}), "int8 .quantized. or float"),
    ],
    ids=["no-scb", "short-scb", "int-scb", "col-format", "bad-format", "shape", "int32"],
)
def test_corrupted_8bit_checkpoints_raise(rng, corrupt, match):
    sd = dict(_layer(Embedding8bit, _table(rng, d=65)).state_dict())
    corrupt(sd)
    layer = _layer(Embedding8bit, _table(rng, d=65))
    before = _state(layer)
    with pytest.raises(RuntimeError, match=match):
        layer.load_state_dict(sd, strict=True)
    assert all(torch.equal(before[k], v) for k, v in layer.state_dict().items())


# ------------------------------------------------------------------ copying, devices, autograd


@pytest.mark.parametrize("cls", [EmbeddingNF4, Embedding8bit])
def test_deepcopy_is_independent(rng, cls):
    layer = _layer(cls, _table(rng, d=65))
    ids = _ids(rng)
    want = layer(ids)
    twin = copy.deepcopy(layer)
    assert torch.equal(twin(ids), want)
    assert twin.weight.untyped_storage().data_ptr() != layer.weight.untyped_storage().data_ptr()
    if cls is EmbeddingNF4:
        assert twin.weight.module is twin and twin.weight.quant_state is twin.quant_state
        assert twin.weight.quant_state is not layer.weight.quant_state
    else:
        assert twin.weight.SCB.data_ptr() != layer.weight.SCB.data_ptr()
    twin.weight.data.view(torch.uint8).zero_()
    assert torch.equal(layer(ids), want)
    ref = weakref.ref(layer)
    del layer
    gc.collect()
    assert ref() is None  # nothing in the copy points back at the original
    restored = pickle.loads(pickle.dumps(twin))
    assert torch.equal(restored(ids), twin(ids))


def test_deepcopy_before_quantization(rng):
    layer = EmbeddingNF4(N, 65)
    layer.load_state_dict({"weight": _table(rng, d=65)})
    twin = copy.deepcopy(layer).to("cpu")
    assert layer.weight.dtype == torch.float32 and not layer.weight.bnb_quantized and layer.quant_state is None
    assert twin.weight.module is twin and twin.quant_state is twin.weight.quant_state
    ids = _ids(rng)
    assert torch.equal(twin(ids), layer.to("cpu")(ids))


def test_to_quantizes_once_and_keeps_bytes(rng):
    layer = EmbeddingNF4(N, 65)
    layer.load_state_dict({"weight": _table(rng, d=65)})
    with pytest.raises(RuntimeError, match="not quantized yet"):
        layer(_ids(rng))
    layer.to("cpu")
    packed = layer.weight.data.clone()
    ids = _ids(rng)
    want = layer(ids)
    layer.to("cpu").to(torch.float16)  # a dtype move leaves the packed bytes and the output dtype alone
    assert torch.equal(layer.weight.data, packed) and torch.equal(layer(ids), want)
    layer8 = Embedding8bit(N, 65)
    with pytest.raises(RuntimeError, match="not quantized yet"):
        layer8(_ids(rng))
    assert layer8.quantize().weight.dtype == torch.int8


def test_frozen_weights_and_autograd_downstream(rng):
    emb = _layer(EmbeddingNF4, _table(rng, d=64))
    emb8 = _layer(Embedding8bit, _table(rng, d=64))
    head = torch.nn.Linear(64, 3)
    ids = _ids(rng)
    for layer in (emb, emb8):
        out = layer(ids)
        assert not out.requires_grad and not layer.weight.requires_grad
        head(out).sum().backward()
        assert layer.weight.grad is None and head.weight.grad is not None
        assert [p for p in layer.parameters() if p.requires_grad] == []


# ------------------------------------------------------------------ replace_linear


class _Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.tok = torch.nn.Embedding(50, 64)
        self.pos = torch.nn.Embedding(16, 64)
        self.proj = torch.nn.Linear(64, 32)
        self.lm_head = torch.nn.Linear(32, 50)
        self.lm_head.weight = self.tok.weight  # tied: stays a dense linear with the float table


@pytest.mark.parametrize("quant_type", ["nf4", "int8"])
def test_replace_linear_embeddings(rng, quant_type):
    model = _Model()
    table = model.tok.weight.detach().clone()
    assert type(q4torch.replace_linear(copy.deepcopy(model), quant_type).tok) is torch.nn.Embedding  # off by default
    q4torch.replace_linear(model, quant_type, embeddings=True, skip=("pos", "lm_head"), blocksize=32)
    want = Embedding8bit if quant_type == "int8" else Embedding4bit
    assert type(model.tok) is want and type(model.pos) is torch.nn.Embedding
    assert type(model.lm_head) is torch.nn.Linear
    ids = _ids(rng, n=50)
    if quant_type == "nf4":
        assert model.tok.weight.blocksize == 32 and model.tok.weight.quant_state.nested  # the call's settings
        packed, qs = q4f.quantize_4bit(table, blocksize=32, compress_statistics=True, quant_type="nf4")
        assert torch.equal(model.tok.weight.data, packed)
        assert torch.equal(model.tok(ids), q4f.dequantize_4bit(packed, qs)[ids])
    else:
        cb, scb, _ = q4f.int8_vectorwise_quant(table.half())
        assert torch.equal(model.tok.weight.data, cb) and torch.equal(model.tok.weight.SCB, scb)


def test_replace_linear_refuses_max_norm():
    model = torch.nn.Sequential(torch.nn.Embedding(10, 8, max_norm=1.0))
    with pytest.raises(ValueError, match="0: an nn.Embedding with max_norm=1.0"):
        q4torch.replace_linear(model, "nf4", embeddings=True)


# ------------------------------------------------------------------ bad input


def test_bad_input_raises(rng):
    for layer in (_layer(EmbeddingNF4, _table(rng, d=65)), _layer(Embedding8bit, _table(rng, d=65))):
        name = type(layer).__name__
        with pytest.raises(TypeError, match="int32 or int64 indices, got torch.float32"):
            layer(torch.zeros(3))
        with pytest.raises(TypeError, match="got torch.uint8"):
            layer(torch.zeros(3, dtype=torch.uint8))
        with pytest.raises(TypeError, match="torch.Tensor of indices, got list"):
            layer([1, 2])
        with pytest.raises(IndexError, match=f"{name}: index 40 is out of range for num_embeddings=40"):
            layer(torch.tensor([[1, 40]]))
        with pytest.raises(IndexError, match="index -1 is out of range"):
            layer(torch.tensor([-1, 3]))
    with pytest.raises(ValueError, match="quant_type"):
        Embedding4bit(4, 8, quant_type="nf5")
    with pytest.raises(RuntimeError, match=r"float table of shape \(40, 65\), got torch.int32"):
        EmbeddingNF4(N, 65).load_state_dict({"weight": torch.zeros(N, 65, dtype=torch.int32)})


def test_quant_state_of_another_shape_is_refused(rng):
    layer = _layer(EmbeddingNF4, _table(rng, d=64))
    layer.weight.quant_state.shape = torch.Size((N * 2, 32))
    with pytest.raises(ValueError, match=r"quant_state shape \(80, 32\) does not match the table \(40, 64\)"):
        layer(_ids(rng))
