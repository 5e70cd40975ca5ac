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

import q4  # noqa: E402
import q4jax  # noqa: E402
import q4torch.hf  # noqa: E402
from examples.llm import flax_llama as FL  # noqa: E402
from examples.llm import model as M  # noqa: E402

PROMPT = np.random.default_rng(0).integers(0, M.SIZES["tiny"]["vocab_size"], (2, 9))


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """(float folder, in shards of 64 KiB, NF4 folder written by transformers + q4torch)."""
    float_dir = M.make_folder(tmp_path_factory.mktemp("llm") / "float", "tiny", dtype="float32", shard_bytes=64 << 10)
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


def test_folder_shards_hold_the_same_weights(folders, tmp_path):
    """make_folder writes one tensor stream, whatever the shard size: a sharded folder and a
    one-file folder of the same seed hold the same tensors, all listed in the index."""
    float_dir, _ = folders
    assert len(list(float_dir.glob("model-*-of-*.safetensors"))) > 1
    one = M.make_folder(tmp_path / "one", "tiny", dtype="float32")
    assert (one / "model.safetensors").exists() and not (one / "model.safetensors.index.json").exists()
    a, b = q4.checkpoint.load_checkpoint(float_dir), q4.checkpoint.load_checkpoint(one)
    assert sorted(a) == sorted(b)
    for k in a:
        np.testing.assert_array_equal(a[k], b[k])
    assert float(np.std(b["model.layers.0.mlp.up_proj.weight"])) == pytest.approx(0.02, rel=0.05)


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


def test_gguf_writer_round_trips_the_weights(folders, tmp_path):
    """benchmarks/llm_gguf.py (llama.cpp's contestant): every tensor read back from the
    GGUF is the folder's, rounded once to fp16 (norms fp32), Q / K rows in llama.cpp's
    RoPE order (undone here with the inverse permutation), the layout metadata set."""
    gguf = pytest.importorskip("gguf")
    import importlib.util
    from pathlib import Path

    spec = importlib.util.spec_from_file_location(
        "q4_llm_gguf", Path(__file__).parents[2] / "benchmarks" / "llm_gguf.py"
    )
    llm_gguf = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(llm_gguf)
    float_dir, _ = folders
    reader = gguf.GGUFReader(str(llm_gguf.write_gguf(float_dir, tmp_path / "m.gguf")))
    cfg = M.read_config(float_dir)
    src = q4.checkpoint.load_checkpoint(float_dir)
    got = {t.name: np.asarray(t.data) for t in reader.tensors}
    assert int(reader.fields["llama.attention.head_count_kv"].parts[-1][0]) == cfg["num_key_value_heads"]
    assert got["token_embd.weight"].tobytes() == src["model.embed_tokens.weight"].astype(np.float16).tobytes()
    assert "output.weight" not in got  # tied: llama.cpp uses token_embd as the head
    for i in range(cfg["num_hidden_layers"]):
        q = llm_gguf.unpermute_rows(got[f"blk.{i}.attn_q.weight"], cfg["num_attention_heads"])
        k = llm_gguf.unpermute_rows(got[f"blk.{i}.attn_k.weight"], cfg["num_key_value_heads"])
        pre = f"model.layers.{i}."
        assert q.tobytes() == src[pre + "self_attn.q_proj.weight"].astype(np.float16).tobytes()
        assert k.tobytes() == src[pre + "self_attn.k_proj.weight"].astype(np.float16).tobytes()
        assert (
            got[f"blk.{i}.ffn_down.weight"].tobytes() == src[pre + "mlp.down_proj.weight"].astype(np.float16).tobytes()
        )
        assert np.array_equal(got[f"blk.{i}.attn_norm.weight"], src[pre + "input_layernorm.weight"])
    # llama3 factors: 1 at high frequencies, `factor` at low ones, as transformers scales them
    factors = got["rope_freqs.weight"]
    inv = 1.0 / 500000.0 ** (np.arange(0, 16, 2) / 16)
    np.testing.assert_allclose(inv / factors, FL.rope_frequencies(cfg), rtol=1e-6)


def test_quantize_head_unties_and_quantizes_the_tied_head(folders, tmp_path):
    """Q4Config(quantize_head=True): the tied head becomes a Linear4bit holding the
    quantization of the embedding's table (the embedding stays float for lookups);
    the saved folder stores it untied and reloads as it was, in both frameworks."""
    import q4torch.functional as F

    float_dir, _ = folders
    q = transformers.AutoModelForCausalLM.from_pretrained(
        float_dir, dtype=torch.float32, quantization_config=q4torch.hf.Q4Config("nf4", quantize_head=True)
    ).eval()
    assert type(q.lm_head).__name__ == "Linear4bit" and type(q.model.embed_tokens) is torch.nn.Embedding
    assert not q.config.tie_word_embeddings
    packed, _ = F.quantize_4bit(q.model.embed_tokens.weight.detach(), blocksize=64, quant_type="nf4")
    assert torch.equal(q.lm_head.weight.data.view(torch.uint8), packed)
    with torch.no_grad():
        want = q(torch.from_numpy(PROMPT)).logits
    q.save_pretrained(tmp_path)
    again = _torch_model(tmp_path)
    assert type(again.lm_head).__name__ == "Linear4bit"
    with torch.no_grad():
        assert torch.equal(again(torch.from_numpy(PROMPT)).logits, want)
    fm = FL.load(tmp_path)
    assert isinstance(fm.lm_head, q4jax.nn.Linear4bit)
    got, _ = fm(jnp.asarray(PROMPT), fm.init_cache(2, 16), jnp.int32(0))
    _close(got, want.numpy())
