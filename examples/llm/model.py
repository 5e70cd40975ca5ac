"""The decoder's configurations and its transformers folder, made from a config with
random weights (no download): Llama 3 architecture (GQA, RoPE with llama3 scaling,
SwiGLU, RMSNorm, tied embeddings)."""

from __future__ import annotations

import json
from pathlib import Path

# Llama-3.2-1B's shapes; "tiny" keeps every feature (GQA 2:1, tied head, llama3 RoPE)
SIZES = {
    "tiny": dict(hidden_size=64, intermediate_size=192, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=320, max_position_embeddings=256),
    "1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
               num_key_value_heads=8, vocab_size=128256, max_position_embeddings=131072),
    "7b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
               num_key_value_heads=8, vocab_size=128256, max_position_embeddings=131072),
}  # fmt: skip
ROPE = {
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "factor": 32.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}


def config(size: str):
    """transformers' LlamaConfig for ``size`` (SIZES)."""
    from transformers import LlamaConfig

    if size not in SIZES:
        raise ValueError(f"size must be one of {sorted(SIZES)}, got {size!r}")
    rope = dict(ROPE)
    rope["original_max_position_embeddings"] = min(8192, SIZES[size]["max_position_embeddings"] // 2)
    return LlamaConfig(
        **SIZES[size], rms_norm_eps=1e-5, tie_word_embeddings=size != "7b", rope_parameters=rope, attention_bias=False
    )


def make_folder(path, size: str = "tiny", *, seed: int = 0, dtype: str = "bfloat16") -> Path:
    """Write a transformers folder (config.json + model.safetensors) of a decoder of
    ``size`` with random weights (normal, std 0.02 as the config's initializer says;
    seeded, so the same folder every time). Returns the folder."""
    import torch
    from transformers import LlamaForCausalLM

    path = Path(path)
    torch.manual_seed(seed)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(getattr(torch, dtype))  # a 7B model built in fp32 would not fit in 24 GiB
    try:
        model = LlamaForCausalLM(config(size))
    finally:
        torch.set_default_dtype(previous)
    model.save_pretrained(path)
    return path


def read_config(folder) -> dict:
    return json.loads((Path(folder) / "config.json").read_text())
