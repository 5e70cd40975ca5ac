"""The llama.cpp side of benchmarks/llm.py: a GGUF file of a transformers Llama folder,
written with the `gguf` package as llama.cpp's convert_hf_to_gguf.py lays it out
(tensor names, Q / K rows permuted for llama.cpp's RoPE, llama3 rope factors, a
placeholder vocabulary: the weights are random, the tokens only ids), quantized by
llama.cpp's own quantizer (llama_model_quantize) to Q4_0 / Q4_K_M; and llama-cpp-python,
built from PyPI once into a wheel cache outside the repository (10-25 minutes on 2
cores) and installed into the running environment on first use. Benchmarks only:
no test needs llama.cpp.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np

CACHE = Path(os.environ.get("Q4_BENCH_CACHE", Path.home() / ".cache" / "q4-bench"))
LLAMA_CPP_VERSION = "0.3.36"
FTYPES = {"f16": 1, "q4_0": 2, "q4_k_m": 15}  # llama.cpp's LLAMA_FTYPE_MOSTLY_*
# Built for x86-64 with AVX-512 (VNNI, BF16, VBMI) and without ggml's AMX backend: built
# -march=native on a Xeon with AMX, llama.cpp 0.3.36 crashed (SIGSEGV in
# ggml_backend_amx_mul_mat) on every batch of more than one token of a Q4_0 model
# (2026-12-07); GGML_NATIVE=ON ignores the AMX switches, so the ISA is named explicitly.
# Its repacked AVX-512 kernels (the "extra buffer types") serve instead.
CMAKE_ARGS_AMX = (
    "-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON "
    "-DGGML_AVX512=ON -DGGML_AVX512_VBMI=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON -DGGML_AVX_VNNI=ON "
    "-DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF"
)


def permute_rows(w: np.ndarray, heads: int) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute: each head's rows from transformers'
    rotate-half order to llama.cpp's interleaved pairs."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def unpermute_rows(w: np.ndarray, heads: int) -> np.ndarray:
    return w.reshape(heads, w.shape[0] // heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def rope_factors(cfg: dict) -> np.ndarray | None:
    """llama3 RoPE scaling as llama.cpp takes it: one factor per frequency (rope_freqs)."""
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    if rope.get("rope_type") != "llama3":
        return None
    dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    base = rope.get("rope_theta", cfg.get("rope_theta", 10000.0))
    factor, lo, hi = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
    old = rope["original_max_position_embeddings"]
    out = []
    for freq in 1.0 / base ** (np.arange(0, dim, 2, dtype=np.float32) / dim):
        wavelen = 2 * math.pi / freq
        if wavelen < old / hi:
            out.append(1.0)
        elif wavelen > old / lo:
            out.append(factor)
        else:
            smooth = (old / wavelen - lo) / (hi - lo)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, np.float32)


def gguf_tensors(folder: Path) -> dict[str, np.ndarray]:
    """The GGUF tensors (float32 / float16) of a float transformers Llama folder."""
    import q4

    cfg = json.loads((folder / "config.json").read_text())
    heads, kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    src = q4.checkpoint.load_checkpoint(folder)
    names = {
        "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
        "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
        "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
    }  # fmt: skip
    out: dict[str, np.ndarray] = {}
    for name, value in src.items():
        v = np.asarray(value).astype(np.float32)
        if name == "model.embed_tokens.weight":
            out["token_embd.weight"] = v
        elif name == "model.norm.weight":
            out["output_norm.weight"] = v
        elif name == "lm_head.weight":
            if not cfg.get("tie_word_embeddings"):
                out["output.weight"] = v
        else:
            _, _, i, *rest = name.split(".")
            key = ".".join(rest[:-1])
            if key == "self_attn.q_proj":
                v = permute_rows(v, heads)
            elif key == "self_attn.k_proj":
                v = permute_rows(v, kv)
            out[f"blk.{i}.{names[key]}.weight"] = v
    factors = rope_factors(cfg)
    if factors is not None:
        out["rope_freqs.weight"] = factors
    return out


def write_gguf(folder: Path, path: Path) -> Path:
    """An F16 GGUF (norms and rope factors F32) of the float folder."""
    import gguf

    cfg = json.loads((folder / "config.json").read_text())
    w = gguf.GGUFWriter(str(path), "llama")
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    w.add_name(folder.name)
    w.add_context_length(min(cfg["max_position_embeddings"], 8192))
    w.add_embedding_length(cfg["hidden_size"])
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_rope_dimension_count(head_dim)
    rope = cfg.get("rope_parameters") or {}
    w.add_rope_freq_base(rope.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    w.add_layer_norm_rms_eps(cfg.get("rms_norm_eps", 1e-5))
    w.add_vocab_size(cfg["vocab_size"])
    w.add_file_type(FTYPES["f16"])
    # a placeholder SentencePiece-style vocabulary: random weights have no text
    n = cfg["vocab_size"]
    w.add_tokenizer_model("llama")
    w.add_token_list([b"<unk>", b"<s>", b"</s>"] + [f"<t{i}>".encode() for i in range(3, n)])
    w.add_token_scores([0.0] * n)
    w.add_token_types([2, 3, 3] + [1] * (n - 3))
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    for name, v in gguf_tensors(folder).items():
        w.add_tensor(name, v if v.ndim == 1 else v.astype(np.float16))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def load_llama_cpp():
    """llama_cpp, installed on first use from a wheel built once into the cache."""
    try:
        import llama_cpp

        return llama_cpp
    except ImportError:
        pass
    wheels = CACHE / "wheels"
    found = sorted(wheels.glob(f"llama_cpp_python-{LLAMA_CPP_VERSION}-*.whl"))
    if not found:
        print(f"building llama-cpp-python {LLAMA_CPP_VERSION} from source into {wheels} (once; 10-25 minutes) ...",
              file=sys.stderr, flush=True)  # fmt: skip
        import q4

        default = CMAKE_ARGS_AMX if q4.cpu_has_amx() else "-DGGML_NATIVE=ON"
        env = dict(os.environ, CMAKE_ARGS=os.environ.get("CMAKE_ARGS", default))
        subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-w", str(wheels),
                        f"llama-cpp-python=={LLAMA_CPP_VERSION}"], check=True, env=env)  # fmt: skip
        found = sorted(wheels.glob(f"llama_cpp_python-{LLAMA_CPP_VERSION}-*.whl"))
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", str(found[-1]), "diskcache", "jinja2"], check=True)
    import llama_cpp

    return llama_cpp


def gguf_file(folder: Path, qtype: str) -> Path:
    """The GGUF of ``folder`` at ``qtype`` ('f16', 'q4_0', 'q4_k_m'), cached beside it."""
    f16 = folder / "model-f16.gguf"
    if not f16.exists():
        write_gguf(folder, f16)
    if qtype == "f16":
        return f16
    out = folder / f"model-{qtype}.gguf"
    if not out.exists():
        llama_cpp = load_llama_cpp()
        params = llama_cpp.llama_model_quantize_default_params()
        params.ftype = FTYPES[qtype]
        params.nthread = os.cpu_count() or 1
        rc = llama_cpp.llama_model_quantize(str(f16).encode(), str(out).encode(), params)
        if rc != 0:
            raise RuntimeError(f"llama_model_quantize({qtype}) failed with {rc}")
    return out
