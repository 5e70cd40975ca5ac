"""examples/minilm: all-MiniLM-L6-v2 in PyTorch and flax.nnx on the same
weights, against sentence-transformers (fp32) and bitsandbytes (NF4)."""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import numpy as np
import pytest
import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root: `examples` is a namespace package

import q4  # noqa: E402
import q4jax  # noqa: E402
import q4torch  # noqa: E402
from examples.minilm import common, flax_model, torch_model  # noqa: E402

SENTENCES = common.SENTENCES
FRAMEWORKS = {"torch": torch_model, "flax": flax_model}
N_LINEAR = 6 * common.LAYERS + 1  # q, k, v, attention out, intermediate, output per layer; the pooler


@pytest.fixture(scope="module")
def tensors():
    return common.load_tensors()


@pytest.fixture(scope="module")
def reference():
    """sentence-transformers' embeddings of SENTENCES (its BertModel, mean pooling, Normalize)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HF_HUB_OFFLINE", "1")
        import sentence_transformers

        model = sentence_transformers.SentenceTransformer(str(common.model_dir()), device="cpu")
        return model.encode(SENTENCES, batch_size=16, convert_to_numpy=True)


@pytest.fixture(scope="module")
def torch_fp32(tensors):
    return torch_model.load(tensors)


@pytest.fixture(scope="module")
def fp32_embeddings(torch_fp32):
    return torch_model.embed(torch_fp32, SENTENCES)


@pytest.fixture(scope="module")
def q4_nf4(torch_fp32):
    """The fp32 model with every nn.Linear (encoder and pooler) quantized by q4torch: NF4, block 64, nested."""
    return q4torch.replace_linear(
        copy.deepcopy(torch_fp32), "nf4", blocksize=64, compress_statistics=True, compute_dtype=torch.float32
    )


@pytest.fixture(scope="module", params=[False, True], ids=["flat", "nested"])
def nf4_pair(request, torch_fp32, q4_nf4):
    """(q4torch model, bitsandbytes model, nested) quantized from the same fp32 weights."""
    nested = request.param
    ours = q4_nf4 if nested else q4torch.replace_linear(copy.deepcopy(torch_fp32), "nf4", compress_statistics=False)
    return ours, torch_model.with_bitsandbytes(torch_fp32, "nf4", 64, nested), nested


def _numpy_state(model) -> dict[str, np.ndarray]:
    return {k: v.detach().cpu().numpy() for k, v in model.state_dict().items()}


# ------------------------------------------------------------------ fp32


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_fp32_matches_sentence_transformers(framework, tensors, torch_fp32, reference):
    module = FRAMEWORKS[framework]
    model = torch_fp32 if framework == "torch" else module.load(tensors)
    emb = module.embed(model, SENTENCES)
    assert emb.shape == (len(SENTENCES), common.HIDDEN) and emb.dtype == np.float32
    np.testing.assert_allclose(np.linalg.norm(emb, axis=1), 1.0, atol=1e-6)
    # Measured max |diff| on unit vectors: torch 1.5e-8 (the same ops as BertModel; only the
    # padding length differs), flax 1.5e-7 (XLA sums matmuls / LayerNorm / softmax in another
    # order). fp32 rounding (6e-8 per op) over 6 layers stays in the 1e-7s; the bound leaves
    # 13x headroom over flax, while a modelling slip is far larger (measured: tanh-approximate
    # GELU 2.6e-4, LayerNorm eps 1e-5 instead of 1e-12 7.9e-5, unmasked attention 6e-2).
    assert np.abs(emb - reference).max() <= 2e-6


# ------------------------------------------------------------------ NF4 vs bitsandbytes


def test_nf4_bytes_equal_bitsandbytes(nf4_pair):
    q4_model, bnb_model, nested = nf4_pair
    ours, theirs = q4_model.state_dict(), bnb_model.state_dict()
    assert sorted(ours) == sorted(theirs)
    json_keys = [k for k in ours if k.endswith(".weight.quant_state.bitsandbytes__nf4")]
    assert len(json_keys) == N_LINEAR  # every encoder linear and the pooler; the embeddings stay fp32
    # every tensor, nested statistics included: the same bytes as bitsandbytes
    for key in ours:
        a, b = ours[key].numpy(), theirs[key].numpy()
        assert (a.dtype, a.shape) == (b.dtype, b.shape) and a.tobytes() == b.tobytes(), key


def test_nf4_embeddings_match_bitsandbytes(nf4_pair, fp32_embeddings):
    q4_model, bnb_model, nested = nf4_pair
    ours = torch_model.embed(q4_model, SENTENCES)
    theirs = torch_model.embed(bnb_model, SENTENCES)
    cos_q4 = common.cosine(ours, fp32_embeddings).mean()
    cos_bnb = common.cosine(theirs, fp32_embeddings).mean()
    assert 0.95 < cos_q4 < 0.99  # measured 0.9726 flat, 0.9725 nested: NF4 costs ~2.7e-2
    # Same bytes, and q4 dequantizes to bitsandbytes' exact values: only the fp32 summation
    # order differs (q4's fused kernel vs dequantize + matmul), as between the frameworks in
    # fp32. Measured: max |diff| 1.7e-7, mean cosines 1.3e-9 apart.
    assert np.abs(ours - theirs).max() <= 2e-6
    assert abs(cos_q4 - cos_bnb) <= 1e-7


def test_nf4_checkpoint_loads_in_both_frameworks(q4_nf4, fp32_embeddings, tmp_path):
    expected = torch_model.embed(q4_nf4, SENTENCES)
    q4.checkpoint.save_file(_numpy_state(q4_nf4), tmp_path / "nf4.safetensors")
    ckpt = common.load_tensors(tmp_path / "nf4.safetensors")
    assert set(q4.checkpoint.validate(ckpt)) == {
        name for name, m in q4_nf4.named_modules() if isinstance(m, q4torch.nn.Linear4bit)
    }
    # torch: the same bytes through the same kernel, the same computation
    np.testing.assert_array_equal(torch_model.embed(torch_model.load(ckpt), SENTENCES), expected)
    # flax: the same kernel on the same bytes; only the float ops around it (attention,
    # LayerNorm, GELU) differ in summation order, as in fp32 (1.5e-7 there). Measured 1.6e-7.
    emb = flax_model.embed(flax_model.load(ckpt), SENTENCES)
    assert np.abs(emb - expected).max() <= 2e-6
    assert abs(common.cosine(emb, fp32_embeddings).mean() - common.cosine(expected, fp32_embeddings).mean()) <= 1e-6


def test_mixed_checkpoint_loads_in_both_frameworks(torch_fp32, fp32_embeddings):
    """NF4 attention projections, FP4 feed-forward, an int8 pooler, dense attention outputs."""
    model = copy.deepcopy(torch_fp32)
    q4torch.replace_linear(model, "nf4", skip=("dense",))
    q4torch.replace_linear(model, "fp4", skip=("*attention.output.dense", "pooler.dense"))
    q4torch.replace_linear(model, "int8", skip=("*attention.output.dense",))
    expected = torch_model.embed(model, SENTENCES)
    ckpt = _numpy_state(model)
    groups = q4.checkpoint.quantized_groups(ckpt)
    assert {k[0]: len(v) for k, v in groups.items()} == {"nf4": 18, "fp4": 12, "int8": 1}
    np.testing.assert_array_equal(torch_model.embed(torch_model.load(ckpt), SENTENCES), expected)
    flax = flax_model.load(ckpt)
    # As for NF4: the same kernels, only the float ops around them differ (measured 1.5e-7).
    # (int8 stays on the unused pooler: LLM.int8 rounds every activation to 8 bits per row, so
    # 1e-7 of float noise flips a code now and then; on the encoder the two frameworks then
    # agree only to a cosine of 0.9987, which is a property of int8, not of either front end.)
    assert np.abs(flax_model.embed(flax, SENTENCES) - expected).max() <= 2e-6
    assert common.cosine(expected, fp32_embeddings).mean() > 0.95
    # every linear layer, the int8 pooler included, holds the checkpoint's bytes
    saved = q4jax.state_dict(flax)
    assert len(saved) > 0 and set(saved) <= set(ckpt)
    for key, value in saved.items():
        assert value.dtype == ckpt[key].dtype and value.tobytes() == ckpt[key].tobytes(), key


def test_load_rejects_unknown_quantized_layer(tensors, q4_nf4):
    ckpt = _numpy_state(q4_nf4)
    renamed = {k.replace("pooler.dense", "pooler.proj"): v for k, v in ckpt.items()}
    for module in FRAMEWORKS.values():
        with pytest.raises(ValueError, match="pooler.proj"):
            module.load(renamed)


def test_qlora_adapters_train_in_both_frameworks():
    """examples/minilm/qlora.py: a frozen NF4 base with LoRA adapters trains in
    PyTorch and in JAX (the adapters bring the quantized embeddings towards
    the fp32 ones)."""
    from examples.minilm import qlora

    out = qlora.run(steps=2, batch=4, peers=False)
    for name, r in out["results"].items():
        assert 0.9 < r["cos_before"] < 0.995, (name, r)
        assert r["cos_after"] > r["cos_before"] + 5e-3, (name, r)
        assert r["steps_per_s"] > 0


@pytest.mark.parametrize("source", common.CALIBRATION_SOURCES)
def test_calibration_sentences_are_disjoint_from_the_evaluation(source):
    """GPTQ's calibration never reads an evaluation sentence: 128 distinct
    sentences from each source, none of them (or a case / punctuation
    variant of one) in SENTENCES."""
    got = common.calibration_sentences(128, source)
    assert len(got) == 128 and len(set(got)) == 128

    def norm(s):
        return "".join(c for c in s.lower() if c.isalnum())

    assert not {norm(s) for s in got} & {norm(s) for s in SENTENCES}
    with pytest.raises(ValueError, match="asked for 100000"):
        common.calibration_sentences(100000, source)


def test_calibration_source_is_checked():
    with pytest.raises(ValueError, match="source must be one of"):
        common.calibration_sentences(8, "wiki")
