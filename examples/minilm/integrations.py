"""all-MiniLM-L6-v2 through the integrations: transformers
``from_pretrained(quantization_config=q4torch.Q4Config(...))``, a folder from
``q4 quantize`` opened by sentence-transformers, and peft LoRA merging.

Prints, for the README: the mean cosine of each route's embeddings to the fp32
model's (common.SENTENCES, mean pooling), the saved model file sizes, and
peft's merge error (relative, embeddings): the merged float model
(dequantized base + adapter delta, fp32) and merge_and_unload (the merged
weight quantized again) against base + adapters.

    .venv/bin/python examples/minilm/integrations.py
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import numpy as np  # noqa: E402
import torch  # noqa: E402
from peft import LoraConfig, get_peft_model  # noqa: E402
from sentence_transformers import SentenceTransformer  # noqa: E402
from transformers import AutoModel  # noqa: E402

import q4torch  # noqa: E402
import q4torch.hf  # noqa: E402
import q4torch.peft  # noqa: E402
from examples.minilm import common  # noqa: E402
from q4.cli import main as q4_main  # noqa: E402


def embed(model, sentences) -> np.ndarray:
    tok = common.tokenizer()
    out = []
    for ids, mask, n in common.batches(sentences, 16):
        with torch.no_grad():
            h = model(input_ids=torch.from_numpy(ids), attention_mask=torch.from_numpy(mask)).last_hidden_state
        out.append(common.mean_pool(h.numpy(), mask)[:n])
    del tok
    return np.concatenate(out)


def rel(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def main() -> int:
    src = common.model_dir()
    s = common.SENTENCES
    ref = embed(AutoModel.from_pretrained(src), s)
    print(
        f"all-MiniLM-L6-v2, {len(s)} sentences, mean cosine to fp32 (fp32 model.safetensors "
        f"{(src / 'model.safetensors').stat().st_size / 1e6:.1f} MB)"
    )
    with tempfile.TemporaryDirectory() as tmp:
        for qt in ("nf4", "fp4", "int8"):
            m = AutoModel.from_pretrained(src, quantization_config=q4torch.hf.Q4Config(qt))
            m.save_pretrained(Path(tmp) / qt)
            size = (Path(tmp) / qt / "model.safetensors").stat().st_size / 1e6
            print(
                f"  from_pretrained(Q4Config({qt!r})): cosine {common.cosine(embed(m, s), ref).mean():.5f}, "
                f"save_pretrained {size:.1f} MB"
            )
        st_ref = SentenceTransformer(str(src), device="cpu").encode(s)
        for qt in ("nf4", "int8"):
            out = Path(tmp) / f"cli-{qt}"
            q4_main(["quantize", str(src), str(out), "--type", qt])
            st = SentenceTransformer(str(out), device="cpu").encode(s)
            print(f"  SentenceTransformer(q4 quantize --type {qt}): cosine {common.cosine(st, st_ref).mean():.5f}")
    # peft: rank-8 adapters on every linear, B set to small random values (as after training)
    base = AutoModel.from_pretrained(src, quantization_config=q4torch.hf.Q4Config("nf4"))
    cfg = q4torch.peft.register(LoraConfig(r=8, lora_alpha=16, target_modules=["query", "key", "value", "dense"]))
    torch.manual_seed(0)  # lora_A's initialisation
    model = get_peft_model(base, cfg)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.copy_(torch.randn(p.shape, generator=g) * 0.02)
    unmerged = embed(model, s)
    import copy

    float_model = q4torch.peft.merge_and_dequantize(copy.deepcopy(model))
    merged = model.merge_and_unload()
    print(
        f"peft LoRA r=8 on every linear (NF4 base): merge error vs base + adapters: merge_and_dequantize (fp32) "
        f"{rel(embed(float_model, s), unmerged):.2e}, merge_and_unload (re-quantized NF4) "
        f"{rel(embed(merged, s), unmerged):.2e}; cosine to base + adapters "
        f"{common.cosine(embed(merged, s), unmerged).mean():.5f}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
