"""The Llama-family decoder example (examples/llm, tiny config, fp32): the Flax decoder
equals transformers' on float weights; from one NF4 folder (transformers + Q4Config,
save_pretrained) both frameworks hold the same bytes, give the same logits within the
fp32 bound and the same greedy tokens; decoding through the KV cache equals the
no-cache forward; torch.compile(fullgraph=True) runs a q4 decoder layer.

Bounds: both frameworks evaluate the same fp32 graph in different orders; a logit is
a sum over the hidden size of terms each bounded by |h| |w|, so two evaluations differ
by a few fp32 ulps of the largest logit per layer; 1e-5 of the logits' scale covers
two layers of 64-wide sums (measured: 3e-7)."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import jax.numpy as jnp  # noqa: E402

import q4jax  # noqa: E402
import q4torch.hf  # noqa: E402
from examples.llm import flax_llama as FL  # noqa: E402
from examples.llm import model as M  # noqa: E402

PROMPT = np.random.default_rng(0).integers(0, M.SIZES["tiny"]["vocab_size"], (2, 9))


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """(float folder, NF4 folder written by transformers + q4torch)."""
    float_dir = M.make_folder(tmp_path_factory.mktemp("llm") / "float", "tiny", dtype="float32")
    q = transformers.AutoModelForCausalLM.from_pretrained(
        float_dir, dtype=torch.float32, quantization_config=q4torch.hf.Q4Config("nf4")
    )
    nf4_dir = tmp_path_factory.mktemp("llm") / "nf4"
    q.save_pretrained(nf4_dir)
    return float_dir, nf4_dir


def _torch_model(folder):
    return transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def _close(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    np.testing.assert_allclose(a, b, rtol=0, atol=1e-5 * float(np.abs(b).max()))


def test_flax_decoder_equals_transformers_on_float_weights(folders):
    float_dir, _ = folders
    with torch.no_grad():
        want = _torch_model(float_dir)(torch.from_numpy(PROMPT)).logits.numpy()
    model = FL.load(float_dir)
    got, _ = model(jnp.asarray(PROMPT), model.init_cache(2, 16), jnp.int32(0))
    _close(got, want)


def test_both_frameworks_decode_the_same_tokens_from_the_same_bytes(folders):
    _, nf4_dir = folders
    tm = _torch_model(nf4_dir)
    fm = FL.load(nf4_dir)
    assert isinstance(fm.model.layers[0].self_attn.q_proj, q4jax.nn.Linear4bit)
    # the same bytes: every quantized entry of the folder is what the Flax model holds
    jax_sd = q4jax.state_dict(fm)
    torch_sd = {k: v.numpy() for k, v in tm.state_dict().items() if k in jax_sd}
    assert set(torch_sd) == set(jax_sd) and len(jax_sd) > 0
    for k, v in jax_sd.items():
        assert v.tobytes() == torch_sd[k].tobytes(), k
    with torch.no_grad():
        want = tm(torch.from_numpy(PROMPT)).logits.numpy()
    got, _ = fm(jnp.asarray(PROMPT), fm.init_cache(2, 16), jnp.int32(0))
    _close(got, want)
    tokens_t = tm.generate(
        torch.from_numpy(PROMPT), attention_mask=torch.ones_like(torch.from_numpy(PROMPT)), max_new_tokens=6,
        do_sample=False, pad_token_id=0,
    ).numpy()  # fmt: skip
    tokens_f = FL.generate(fm, PROMPT, 6)
    np.testing.assert_array_equal(tokens_f, tokens_t)


def test_kv_cache_decoding_equals_the_full_forward(folders):
    """Each cached step's logits equal the last position of a forward over the whole
    sequence so far (Flax), and transformers' cached generate equals its uncached one."""
    _, nf4_dir = folders
    fm = FL.load(nf4_dir)
    tokens = FL.generate(fm, PROMPT, 5)
    step = FL.decode_step(fm)
    caches = fm.init_cache(2, 16)
    logits, caches = step(jnp.asarray(PROMPT, jnp.int32), caches, jnp.int32(0))
    for i in range(5):
        full, _ = fm(jnp.asarray(tokens[:, : 9 + i]), fm.init_cache(2, 16), jnp.int32(0))
        _close(logits, full[:, -1])
        assert np.array_equal(np.argmax(np.asarray(logits), -1), tokens[:, 9 + i])
        logits, caches = step(jnp.asarray(tokens[:, 9 + i : 10 + i], jnp.int32), caches, jnp.int32(9 + i))
    tm = _torch_model(nf4_dir)
    kw = dict(attention_mask=torch.ones(2, 9, dtype=torch.long), max_new_tokens=5, do_sample=False, pad_token_id=0)
    cached = tm.generate(torch.from_numpy(PROMPT), use_cache=True, **kw)
    uncached = tm.generate(torch.from_numpy(PROMPT), use_cache=False, **kw)
    assert torch.equal(cached, uncached)


def test_torch_compile_fullgraph_runs_a_q4_decoder_layer(folders):
    _, nf4_dir = folders
    tm = _torch_model(nf4_dir)
    layer = tm.model.layers[0]
    assert type(layer.mlp.up_proj).__name__ == "Linear4bit"
    x = torch.randn(2, 9, 64)
    pos = torch.arange(9)[None].expand(2, 9)
    emb = tm.model.rotary_emb(x, pos)
    with torch.no_grad():
        want = layer(x, position_embeddings=emb)
        got = torch.compile(layer, fullgraph=True)(x, position_embeddings=emb)
    want = want[0] if isinstance(want, tuple) else want
    got = got[0] if isinstance(got, tuple) else got
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
