"""all-MiniLM-L6-v2 embedding quality per 4-bit block size: the mean cosine
similarity to the fp32 embeddings of q4 in PyTorch, q4 in Flax, and
bitsandbytes 0.50.2, on the same weights (nested absmax, fp32 compute).

    .venv/bin/python examples/minilm/blocksizes.py [--type nf4|fp4]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from examples.minilm import common, flax_model, torch_model  # noqa: E402
from q4._src.convert import Options, quantize_checkpoint  # noqa: E402

BLOCKSIZES = (32, 64, 128, 256, 512, 1024, 4096)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--type", default="nf4", choices=["nf4", "fp4"])
    args = p.parse_args(argv)
    src = common.model_dir() / "model.safetensors"
    sentences = common.SENTENCES
    dense = torch_model.load(common.load_tensors(src))
    ref = torch_model.embed(dense, sentences)
    print(f"{args.type}, nested absmax, {len(sentences)} sentences: mean cosine to fp32")
    print(f"{'block':>6}  {'q4 PyTorch':>10}  {'q4 Flax':>10}  {'bitsandbytes':>12}  {'bytes (linear)':>14}")
    with tempfile.TemporaryDirectory() as tmp:
        for bs in BLOCKSIZES:
            out = Path(tmp) / f"{bs}.safetensors"
            res = quantize_checkpoint(src, out, Options(args.type, bs))
            quant = common.load_tensors(out)
            cos_t = common.cosine(torch_model.embed(torch_model.load(quant), sentences), ref).mean()
            cos_f = common.cosine(flax_model.embed(flax_model.load(quant), sentences), ref).mean()
            bnb = torch_model.with_bitsandbytes(dense, args.type, bs, True)
            cos_b = common.cosine(torch_model.embed(bnb, sentences), ref).mean()
            nbytes = sum(r.bytes_after for r in res.layers)
            print(f"{bs:>6}  {cos_t:>10.5f}  {cos_f:>10.5f}  {cos_b:>12.5f}  {nbytes:>14,}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
