"""Quantized embeddings across the front ends: the same checkpoint gives the
same lookup bits in q4torch and q4jax; checkpoints hop bitsandbytes -> q4jax
-> q4torch -> q4jax byte for byte; `q4 quantize --embeddings` files,
replace_linear / quantize_model(embeddings=True) and load_quantized agree."""

from __future__ import annotations

import json
import logging

import bitsandbytes as bnb
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx
from q4_reference import inputs
from q4_reference.matmul import rel_err

import q4
import q4jax
import q4torch
from q4._src.convert import Options, quantize_checkpoint
from q4jax import nn as qnn
from q4torch import nn as tnn

logging.getLogger("bitsandbytes").setLevel(logging.ERROR)

N = 45


def _np(sd) -> dict[str, np.ndarray]:
    return {
        k: (
            v.view(torch.int16).numpy().view(inputs.NP_DTYPES["bfloat16"])
            if v.dtype == torch.bfloat16
            else v.detach().numpy()
        ).copy()
        for k, v in sd.items()
    }


def _torch(sd) -> dict[str, torch.Tensor]:
    out = {}
    for k, v in sd.items():
        a = np.asarray(v)
        out[k] = (
            torch.from_numpy(a.view(np.int16).copy()).view(torch.bfloat16)
            if a.dtype.name == "bfloat16"
            else torch.from_numpy(a.copy())
        )
    return out


def _same(a: dict, b: dict) -> bool:
    return sorted(a) == sorted(b) and all(
        np.asarray(a[k]).dtype == np.asarray(b[k]).dtype and np.asarray(a[k]).tobytes() == np.asarray(b[k]).tobytes()
        for k in a
    )


def _bits(x) -> bytes:
    if isinstance(x, torch.Tensor):
        x = x.float().numpy()
    return np.asarray(x, np.float32).tobytes()


CASES = [
    # (quant_type, dim, blocksize, nested, dtype)
    ("nf4", 384, 64, False, "float32"),
    ("nf4", 65, 64, True, "float32"),
    ("fp4", 96, 32, True, "float32"),
    ("fp4", 7, 128, False, "float32"),
    ("nf4", 130, 256, True, "bfloat16"),
    ("fp4", 33, 64, False, "float16"),
    ("nf4", 1, 4096, True, "float32"),
]


@pytest.mark.parametrize(
    "quant_type, dim, blocksize, nested, dtype",
    CASES,
    ids=[f"{q}-d{d}-bs{b}-{'n' if n else 'p'}-{t}" for q, d, b, n, t in CASES],
)
def test_same_bytes_and_lookup_bits(rng, quant_type, dim, blocksize, nested, dtype):
    table = inputs.make(rng, (N, dim), dtype)
    # quantized in JAX ...
    jlayer = qnn.Embedding4bit(
        N,
        dim,
        param_dtype=table.dtype,
        embedding_init=lambda *_: jnp.asarray(table),
        quant_type=quant_type,
        blocksize=blocksize,
        compress_statistics=nested,
        rngs=nnx.Rngs(0),
    )
    # ... and in PyTorch, from the same table
    t_table = _torch({"w": table})["w"]
    tlayer = tnn.Embedding4bit(N, dim, dtype=t_table.dtype, quant_type=quant_type)
    tlayer.weight = tnn.Params4bit(
        t_table, blocksize=blocksize, compress_statistics=nested, quant_type=quant_type, module=tlayer
    )
    tlayer.to("cpu")
    assert _same(qnn.state_dict(jlayer), _np(tlayer.state_dict()))
    ids = rng.integers(0, N, size=(4, 13))
    ids[0, :2] = [0, N - 1]
    want = _bits(tlayer(torch.from_numpy(ids)))
    assert _bits(jlayer(ids)) == want
    assert _bits(nnx.jit(lambda m, i: m(i))(jlayer, jnp.asarray(ids, jnp.int32))) == want
    # each loads the other's checkpoint and gives the same bits
    other_t = tnn.EmbeddingFP4(N, dim, dtype=t_table.dtype)
    other_t.load_state_dict(_torch(qnn.state_dict(jlayer)), strict=True)
    assert _bits(other_t(torch.from_numpy(ids))) == want
    other_j = qnn.EmbeddingNF4(N, dim, param_dtype=table.dtype, rngs=nnx.Rngs(1))
    qnn.load_state_dict(other_j, _np(tlayer.state_dict()))
    assert _bits(other_j(ids)) == want


def test_8bit_same_bytes_and_lookup_bits(rng):
    for dim, dtype in ((65, "float32"), (384, "bfloat16"), (1, "float16")):
        table = inputs.make(rng, (N, dim), dtype) * 3
        jlayer = qnn.Embedding8bit(
            N, dim, param_dtype=table.dtype, embedding_init=lambda *_, t=table: jnp.asarray(t), rngs=nnx.Rngs(0)
        )
        t_table = _torch({"w": table})["w"]
        tlayer = tnn.Embedding8bit(N, dim, dtype=t_table.dtype)
        tlayer.load_state_dict({"weight": t_table})
        tlayer.to("cpu")
        assert _same(qnn.state_dict(jlayer), _np(tlayer.state_dict()))
        ids = rng.integers(0, N, size=(3, 17))
        want = _bits(tlayer(torch.from_numpy(ids)))
        assert _bits(jlayer(ids)) == want
        assert _bits(nnx.jit(lambda m, i: m(i))(jlayer, jnp.asarray(ids, jnp.int32))) == want


@pytest.mark.parametrize("quant_type", ["nf4", "fp4"])
@pytest.mark.parametrize("dim", [64, 65])
def test_bitsandbytes_bytes_hop_through_both(rng, quant_type, dim):
    """bitsandbytes' Embedding4bit bytes (it cannot save a state dict: its
    Params4bit and QuantState give the entries) -> q4jax -> q4torch -> q4jax."""
    table = torch.from_numpy(inputs.make(rng, (N, dim), "float32"))
    theirs = bnb.nn.Embedding4bit(N, dim, quant_type=quant_type)
    theirs.load_state_dict({"weight": table})
    theirs.to("cpu")
    entries = {"weight": theirs.weight.data}
    entries.update({"weight." + k: v for k, v in theirs.weight.quant_state.as_dict(packed=True).items()})
    entries = _np(entries)
    j1 = qnn.Embedding4bit(N, dim, rngs=nnx.Rngs(0))
    qnn.load_state_dict(j1, entries)
    t = tnn.Embedding4bit(N, dim)
    t.load_state_dict(_torch(qnn.state_dict(j1)), strict=True)
    j2 = qnn.Embedding4bit(N, dim, rngs=nnx.Rngs(1))
    qnn.load_state_dict(j2, _np(t.state_dict()))
    assert (
        _same(qnn.state_dict(j1), entries)
        and _same(_np(t.state_dict()), entries)
        and _same(qnn.state_dict(j2), entries)
    )
    ids = rng.integers(0, N, size=(5, 5))
    got = _bits(t(torch.from_numpy(ids)))
    assert _bits(j1(ids)) == got == _bits(j2(ids))
    if dim % 64 == 0:  # (unaligned rows go through bitsandbytes' AVX-512 straddle mis-decode)
        assert _bits(theirs(torch.from_numpy(ids))) == got


def test_stable_embedding_agrees_within_layernorm_rounding(rng):
    t = tnn.StableEmbedding(N, 48)
    with torch.no_grad():
        t.norm.weight.copy_(torch.from_numpy(inputs.make(rng, (48,), "float32")))
        t.norm.bias.copy_(torch.from_numpy(inputs.make(rng, (48,), "float32")))
    j = qnn.StableEmbedding(N, 48, rngs=nnx.Rngs(0))
    qnn.load_state_dict(j, _np(t.state_dict()))
    assert _same(qnn.state_dict(j), _np(t.state_dict()))
    ids = rng.integers(0, N, size=(6, 7))
    a = t(torch.from_numpy(ids)).detach().numpy()
    b = np.asarray(j(ids))
    # the two LayerNorms sum in different orders: a few fp32 ulp apart
    assert rel_err(b, a) < 1e-6 and np.abs(a - b).max() < 1e-5


# ------------------------------------------------------------------ whole models


class TorchLM(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed_tokens = torch.nn.Embedding(N, 64)
        self.embed_positions = torch.nn.Embedding(8, 64)
        self.proj = torch.nn.Linear(64, 32)

    def forward(self, ids):
        return self.proj(self.embed_tokens(ids) + self.embed_positions(torch.arange(ids.shape[-1])))


class NnxLM(nnx.Module):
    def __init__(self):
        rngs = nnx.Rngs(0)
        self.embed_tokens = nnx.Embed(N, 64, rngs=rngs)
        self.embed_positions = nnx.Embed(8, 64, rngs=rngs)
        self.proj = nnx.Linear(64, 32, rngs=rngs)

    def __call__(self, ids):
        return self.proj(self.embed_tokens(ids) + self.embed_positions(jnp.arange(ids.shape[-1])))


def _float_checkpoint(rng) -> dict[str, np.ndarray]:
    return {
        "embed_tokens.weight": inputs.make(rng, (N, 64), "float32"),
        "embed_positions.weight": inputs.make(rng, (8, 64), "float32"),
        "proj.weight": inputs.make(rng, (32, 64), "float32") * 0.1,
        "proj.bias": inputs.make(rng, (32,), "float32"),
    }


@pytest.mark.parametrize(
    "opts",
    [
        Options("nf4", 64, True, embeddings=True),
        Options("fp4", 32, False, embeddings=True),
        Options("int8", embeddings=True),
    ],
    ids=["nf4-nested", "fp4-plain", "int8"],
)
def test_quantized_embeddings_file_loads_in_both(rng, tmp_path, opts):
    src, dst = tmp_path / "float.safetensors", tmp_path / "q.safetensors"
    q4.checkpoint.save_file(_float_checkpoint(rng), src)
    res = quantize_checkpoint(src, dst, opts)
    assert {r.name for r in res.layers} == {"embed_tokens", "embed_positions", "proj"}
    tensors = q4.checkpoint.load_file(dst)
    tm = q4torch.load_quantized(TorchLM(), tensors)
    want4 = tnn.Embedding8bit if opts.quant_type == "int8" else tnn.Embedding4bit
    assert type(tm.embed_tokens) is want4 and type(tm.embed_positions) is want4
    rest = q4jax.load_quantized(NnxLM(), tensors)
    assert rest == {}
    jm = NnxLM()
    assert q4jax.load_quantized(jm, tensors) == {}
    wantj = qnn.Embedding8bit if opts.quant_type == "int8" else qnn.Embedding4bit
    assert type(jm.embed_tokens) is wantj and type(jm.embed_positions) is wantj
    for name in ("embed_tokens", "embed_positions"):  # both hold exactly the file's bytes
        file_entries = {k[len(name) + 1 :]: v for k, v in tensors.items() if k.startswith(name + ".")}
        assert _same(_np(getattr(tm, name).state_dict()), file_entries)
        assert _same(qnn.state_dict(getattr(jm, name)), file_entries)
    ids = rng.integers(0, N, size=(3, 8))
    with torch.no_grad():
        e_t = tm.embed_tokens(torch.from_numpy(ids))
        y_t = tm(torch.from_numpy(ids)).numpy()
    assert _bits(jm.embed_tokens(ids)) == _bits(e_t)
    assert rel_err(np.asarray(jm(ids)), y_t) < 1e-6  # the linear layers' sums are ordered differently


@pytest.mark.parametrize("quant_type", ["nf4", "int8"])
def test_replace_linear_and_quantize_model_give_the_same_bytes(rng, quant_type):
    ckpt = _float_checkpoint(rng)
    tm = TorchLM()
    tm.load_state_dict(_torch(ckpt))
    q4torch.replace_linear(tm, quant_type, embeddings=True, blocksize=32)
    jm = NnxLM()
    q4jax.load_state_dict(jm, {k: v for k, v in ckpt.items() if k.startswith("proj")})
    for name in ("embed_tokens", "embed_positions"):
        getattr(jm, name).embedding.set_value(jnp.asarray(ckpt[name + ".weight"]))
    q4jax.quantize_model(jm, quant_type, embeddings=True, blocksize=32)
    assert _same(q4jax.state_dict(jm), _np(tm.state_dict()))
    ids = rng.integers(0, N, size=(2, 8))
    assert _bits(jm.embed_tokens(ids)) == _bits(tm.embed_tokens(torch.from_numpy(ids)))


def test_the_command_quantizes_embeddings_only_when_asked(rng, tmp_path):
    from q4 import cli

    ckpt = _float_checkpoint(rng)
    ckpt["lm_head.weight"] = inputs.make(rng, (N, 32), "float32")
    src = tmp_path / "float.safetensors"
    q4.checkpoint.save_file(ckpt, src)
    for flag, quantized in (
        ([], {"proj"}),
        (["--embeddings"], {"proj", "embed_tokens", "embed_positions"}),
        (["--embeddings", "--skip", "embed_positions"], {"proj", "embed_tokens"}),
    ):
        dst = tmp_path / f"q{len(flag)}.safetensors"
        assert cli.main(["quantize", str(src), str(dst), *flag]) == 0
        layers = json.loads(q4.checkpoint.load_metadata(dst)["q4.layers"])
        assert set(layers) == quantized  # lm_head is kept either way
        assert set(q4.checkpoint.quantized_groups(q4.checkpoint.load_file(dst))[("nf4", 64, True)]) == quantized


def test_unknown_quantized_embedding_is_rejected(rng, tmp_path):
    src, dst = tmp_path / "float.safetensors", tmp_path / "q.safetensors"
    q4.checkpoint.save_file(_float_checkpoint(rng), src)
    quantize_checkpoint(src, dst, Options("nf4", embeddings=True))
    tensors = {k.replace("embed_positions", "embed_pos"): v for k, v in q4.checkpoint.load_file(dst).items()}
    with pytest.raises(ValueError, match="embed_pos"):
        q4torch.load_quantized(TorchLM(), tensors)
    with pytest.raises(ValueError, match="embed_pos"):
        q4jax.load_quantized(NnxLM(), tensors)
