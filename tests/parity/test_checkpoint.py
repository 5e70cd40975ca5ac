"""q4.checkpoint: safetensors files written and read by q4, safetensors itself,
q4torch and q4jax; validation of truncated or inconsistent files; atomic saves."""

import json
import os

import jax.numpy as jnp
import numpy as np
import pytest
import safetensors.numpy
import torch
from flax import nnx
from q4_reference import inputs

import q4
import q4jax
import q4torch.nn as qnn
from q4.checkpoint import CheckpointError


def _torch_state(rng):
    """A small model's state dict (4-bit nested NF4, 4-bit FP4, 8-bit, dense) as numpy arrays."""
    torch.manual_seed(0)
    model = torch.nn.ModuleDict(
        {
            "a": qnn.Linear4bit(64, 32, quant_type="nf4", compress_statistics=True),
            "b": qnn.Linear4bit(32, 32, quant_type="fp4", compress_statistics=False),
            "c": qnn.Linear8bitLt(32, 16, has_fp16_weights=False, threshold=6.0),
            "head": torch.nn.Linear(16, 8),
        }
    ).to("cpu")
    return {k: v.detach().numpy() for k, v in model.state_dict().items()}


def _bits_equal(a: np.ndarray, b: np.ndarray) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


def test_round_trip_and_safetensors_interop(rng, tmp_path):
    state = _torch_state(rng)
    state["bf16"] = inputs.make(rng, (3, 5), "bfloat16")
    path = tmp_path / "model.safetensors"
    q4.checkpoint.save_file(state, path, metadata={"source": "test"})
    back = q4.checkpoint.load_file(path)
    assert sorted(back) == sorted(state) and all(_bits_equal(back[k], state[k]) for k in state)
    # safetensors reads q4's file, and q4 reads safetensors' file, bit for bit
    theirs = safetensors.numpy.load_file(path)
    assert all(_bits_equal(theirs[k], state[k]) for k in state if k != "bf16")
    other = tmp_path / "theirs.safetensors"
    safetensors.numpy.save_file({k: v for k, v in state.items() if k != "bf16"}, other)
    assert all(_bits_equal(q4.checkpoint.load_file(other)[k], state[k]) for k in state if k != "bf16")
    layers = json.loads(q4.checkpoint.load_metadata(path)["q4.layers"])
    assert layers["a"] == {
        "kind": "Linear4bit",
        "quant_type": "nf4",
        "blocksize": 64,
        "nested": True,
        "compute_dtype": "float32",
        "shape": [32, 64],
    }
    assert layers["b"]["quant_type"] == "fp4" and not layers["b"]["nested"]
    assert layers["c"] == {"kind": "Linear8bitLt", "shape": [16, 32]}
    assert "head" not in layers and q4.checkpoint.load_metadata(path)["source"] == "test"


def test_torch_to_file_to_jax_to_file_to_torch(rng, tmp_path):
    state = _torch_state(rng)
    state = {k: v for k, v in state.items() if not k.startswith(("c.", "head."))}
    q4.checkpoint.save_file(state, tmp_path / "t.safetensors")

    class Model(nnx.Module):
        def __init__(self):
            self.a = q4jax.nn.Linear4bit(64, 32, quant_type="fp4", rngs=nnx.Rngs(1))
            self.b = q4jax.nn.Linear4bit(32, 32, quant_type="nf4", rngs=nnx.Rngs(2))

    model = Model()
    q4jax.load_state_dict(model, q4.checkpoint.load_file(tmp_path / "t.safetensors"))
    q4.checkpoint.save_file(q4jax.state_dict(model), tmp_path / "j.safetensors")
    again = q4.checkpoint.load_file(tmp_path / "j.safetensors")
    assert sorted(again) == sorted(state) and all(_bits_equal(again[k], state[k]) for k in state)
    x = inputs.make(rng, (2, 64), "float32")
    torch_model = torch.nn.ModuleDict({"a": qnn.Linear4bit(64, 32), "b": qnn.Linear4bit(32, 32)})
    torch_model.load_state_dict({k: torch.from_numpy(v) for k, v in again.items()})
    assert np.array_equal(torch_model["a"](torch.from_numpy(x)).detach().numpy(), np.asarray(model.a(jnp.asarray(x))))


def _corrupt(path, data: bytes):
    path.write_bytes(data)
    return path


def test_truncated_and_corrupted_files(rng, tmp_path):
    state = _torch_state(rng)
    good = tmp_path / "good.safetensors"
    q4.checkpoint.save_file(state, good)
    data = good.read_bytes()
    with pytest.raises(CheckpointError, match="too short"):
        q4.checkpoint.load_file(_corrupt(tmp_path / "x1", data[:5]))
    with pytest.raises(CheckpointError, match="does not fit"):
        q4.checkpoint.load_file(_corrupt(tmp_path / "x2", data[:40]))
    with pytest.raises(CheckpointError, match="outside the .* data section"):
        q4.checkpoint.load_file(_corrupt(tmp_path / "x3", data[:-10]))
    n = int.from_bytes(data[:8], "little")
    with pytest.raises(CheckpointError, match="not valid JSON"):
        q4.checkpoint.load_file(_corrupt(tmp_path / "x4", data[:8] + b"{" * n + data[8 + n :]))
    with pytest.raises(CheckpointError, match="cannot read checkpoint"):
        q4.checkpoint.load_file(tmp_path / "missing.safetensors")


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda s: s.update({"a.weight.absmax": s["a.weight.absmax"][:-1]}), r"layer 'a': absmax must be uint8\[32\]"),
        (lambda s: s.update({"a.weight": s["a.weight"][:-2]}), "'a.weight' has 1022 bytes"),
        (lambda s: s.pop("a.weight.quant_map"), "missing checkpoint entry 'quant_map'"),
        (
            lambda s: s.update(
                {"b.weight.quant_state.bitsandbytes__fp4": s["b.weight.quant_state.bitsandbytes__fp4"][:-4]}
            ),
            "not valid UTF-8 JSON",
        ),
        (lambda s: s.update({"c.SCB": s["c.SCB"][:-1]}), r"'c.SCB' must be float32\[16\]"),
        (lambda s: s.update({"c.weight_format": np.array(1, np.uint8)}), "'c.weight_format' must be 0"),
    ],
)
def test_inconsistent_layers_are_named(rng, tmp_path, edit, message):
    state = _torch_state(rng)
    edit(state)
    with pytest.raises(CheckpointError, match=message):
        q4.checkpoint.save_file(state, tmp_path / "bad.safetensors")
    # the same checks run on load (write the file with safetensors, which does not validate)
    path = tmp_path / "bad2.safetensors"
    safetensors.numpy.save_file(state, path)
    with pytest.raises(CheckpointError, match=message):
        q4.checkpoint.load_file(path)


def test_interrupted_save_keeps_the_old_file(rng, tmp_path, monkeypatch):
    path = tmp_path / "model.safetensors"
    state = _torch_state(rng)
    q4.checkpoint.save_file(state, path)
    before = path.read_bytes()

    def interrupted(fd):
        raise KeyboardInterrupt("interrupted after writing, before the rename")

    monkeypatch.setattr(os, "fsync", interrupted)  # (the Writer fsyncs before its rename)
    state["extra"] = np.zeros(4, np.float32)
    with pytest.raises(KeyboardInterrupt):
        q4.checkpoint.save_file(state, path)
    assert path.read_bytes() == before
    assert sorted(os.listdir(tmp_path)) == ["model.safetensors"]  # no temporary file left behind
