"""all-MiniLM-L6-v2 with its word embeddings quantized too: file size and
sentence-embedding quality in PyTorch and in Flax, and whether the two
frameworks' quantized embedding layers agree bit for bit.

    .venv/bin/python examples/minilm/embeddings.py [--blocksize N]

Rows: the fp32 model; every linear layer NF4 (nested absmax, the `make demo`
file); the same with the 30522x384 word embedding table NF4 as well (written
by `q4 quantize --embeddings`, nested like the linears); and with it int8
(one absmax per row, written by q4torch.replace_linear(..., embeddings=True)).
The position (512x384) and token-type (2x384) tables stay fp32: the example
models read them as tensors, not through lookups.

Per row: the file's bytes, the mean (and min) cosine similarity of the
sentence embeddings to the fp32 PyTorch model's, and the largest difference
between the two frameworks' unit-norm sentence embeddings (their dense
attention / LayerNorm arithmetic differs in the last bits, as between the fp32
models). "lookup bits" compares the quantized word-embedding layer of the two
frameworks on every one of the 30522 rows, bit for bit, and the saved
checkpoint entries byte for byte.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402

import q4  # noqa: E402
import q4jax  # noqa: E402
import q4torch  # noqa: E402
from examples.minilm import common, flax_model, torch_model  # noqa: E402
from q4._src.convert import Options, quantize_checkpoint  # noqa: E402

WORD = "embeddings.word_embeddings"
KEEP = ("*position_embeddings", "*token_type_embeddings")


def _int8_embeddings_file(src: Path, dst: Path, blocksize: int) -> None:
    """Linears NF4, word embeddings int8: quantized in PyTorch, saved as numpy."""
    model = torch_model.MiniLM()
    model.load_state_dict({k: torch.from_numpy(v) for k, v in common.load_tensors(src).items()})
    q4torch.replace_linear(model, "nf4", blocksize=blocksize)
    q4torch.replace_linear(model, "int8", embeddings=True, skip=KEEP)  # the linears are quantized already
    q4.checkpoint.save_file({k: v.detach().numpy() for k, v in model.state_dict().items()}, dst)


def _lookup_bits(tensors: dict, t_model, f_model) -> str:
    """'identical' if the two frameworks' word-embedding layers return the same
    bits for every row and save the same checkpoint entries."""
    t_layer, f_layer = t_model.embeddings.word_embeddings, f_model.embeddings.word_embeddings
    if type(t_layer) is torch.nn.Embedding:
        return "- (fp32)"
    ids = np.arange(common.VOCAB).reshape(-1, 6)
    with torch.inference_mode():
        a = t_layer(torch.from_numpy(ids)).numpy()
    b = np.asarray(f_layer(jnp.asarray(ids)))
    saved_t = {k: v.numpy() for k, v in t_layer.state_dict().items()}
    saved_f = q4jax.state_dict(f_layer)
    same_entries = sorted(saved_t) == sorted(saved_f) and all(
        saved_t[k].dtype == saved_f[k].dtype and saved_t[k].tobytes() == saved_f[k].tobytes() for k in saved_t
    )
    same_file = all(tensors[f"{WORD}.{k}"].tobytes() == v.tobytes() for k, v in saved_t.items())
    if a.tobytes() == b.tobytes() and same_entries and same_file:
        return "identical"
    return f"DIFFER (max {np.nanmax(np.abs(a - b)):.3g}, entries {same_entries}, file {same_file})"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--blocksize", type=int, default=64)
    args = p.parse_args(argv)
    src = common.model_dir() / "model.safetensors"
    sentences = common.SENTENCES
    ref = torch_model.embed(torch_model.load(common.load_tensors(src)), sentences)
    header = ["model", "file bytes", "cos PyTorch", "(min)", "cos Flax", "(min)", "PyTorch-Flax", "lookup bits"]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        files = {
            "fp32": src,
            "linears nf4, embeddings fp32": Path(tmp) / "linears.safetensors",
            "linears nf4, word embeddings nf4": Path(tmp) / "emb-nf4.safetensors",
            "linears nf4, word embeddings int8": Path(tmp) / "emb-int8.safetensors",
        }
        quantize_checkpoint(src, files["linears nf4, embeddings fp32"], Options("nf4", args.blocksize))
        quantize_checkpoint(
            src,
            files["linears nf4, word embeddings nf4"],
            Options("nf4", args.blocksize, embeddings=True, skip=KEEP),
        )
        _int8_embeddings_file(src, files["linears nf4, word embeddings int8"], args.blocksize)
        for name, path in files.items():
            tensors = common.load_tensors(path)
            t_model, f_model = torch_model.load(tensors), flax_model.load(tensors)
            emb_t = torch_model.embed(t_model, sentences)
            emb_f = flax_model.embed(f_model, sentences)
            cos_t, cos_f = common.cosine(emb_t, ref), common.cosine(emb_f, ref)
            rows.append(
                [
                    name,
                    f"{os.path.getsize(path):,}",
                    f"{cos_t.mean():.5f}",
                    f"{cos_t.min():.5f}",
                    f"{cos_f.mean():.5f}",
                    f"{cos_f.min():.5f}",
                    f"{np.abs(emb_t - emb_f).max():.2e}",
                    _lookup_bits(tensors, t_model, f_model),
                ]
            )
            print(f"  {name}: done", file=sys.stderr, flush=True)
    print(f"all-MiniLM-L6-v2, {len(sentences)} sentences; NF4 block {args.blocksize}, nested absmax")
    from q4.cli import table

    table(header, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
