"""The decoder's configurations and its transformers folder, made from a config with
random weights (no download): Llama 3 architecture (GQA, RoPE with llama3 scaling,
SwiGLU, RMSNorm, tied embeddings)."""

from __future__ import annotations

import json
import math
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


def make_folder(
    path, size: str = "tiny", *, seed: int = 0, dtype: str = "bfloat16", shard_bytes: int = 2 << 30
) -> Path:
    """Write a transformers folder (config.json + safetensors shards of at most
    ``shard_bytes``, with their index when there are several) of a decoder of ``size`` with
    random weights: normal with the config's initializer std (0.02) for every matrix, ones
    for the norms, as transformers initialises the model; seeded, so the same folder every
    time. One shard at a time: the model is built on the meta device for its names and
    shapes only, so a 7B folder is written holding 2 GB, not 16 GB of weights. Returns the
    folder."""
    import torch
    from safetensors.torch import save_file
    from transformers import LlamaForCausalLM

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    cfg = config(size)
    torch_dtype = getattr(torch, dtype)
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}  # a tied head is no parameter of its own
    groups: list[list[str]] = [[]]
    used = 0
    for name, shape in shapes.items():
        nbytes = math.prod(shape) * torch_dtype.itemsize
        if groups[-1] and used + nbytes > shard_bytes:
            groups.append([])
            used = 0
        groups[-1].append(name)
        used += nbytes
    files = (["model.safetensors"] if len(groups) == 1
             else [f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors" for i in range(len(groups))])  # fmt: skip
    gen = torch.Generator().manual_seed(seed)
    for names, file in zip(groups, files, strict=True):
        shard = {}
        for name in names:
            if name.endswith("norm.weight"):
                shard[name] = torch.ones(shapes[name], dtype=torch_dtype)
            else:
                shard[name] = (torch.randn(shapes[name], generator=gen) * cfg.initializer_range).to(torch_dtype)
        save_file(shard, str(path / file), metadata={"format": "pt"})
        del shard
    if len(groups) > 1:
        total = sum(math.prod(s) for s in shapes.values()) * torch_dtype.itemsize
        weight_map = {name: file for names, file in zip(groups, files, strict=True) for name in names}
        (path / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2)
        )
    cfg.dtype = dtype
    cfg.save_pretrained(path)
    return path


def read_config(folder) -> dict:
    return json.loads((Path(folder) / "config.json").read_text())
