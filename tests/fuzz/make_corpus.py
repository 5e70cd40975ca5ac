"""Writes the seed corpus of tests/fuzz/fuzz_checkpoint.py: small valid q4
checkpoints (4-bit plain, 4-bit nested, int8, a sharded checkpoint's two
shards and its index), deterministic (seeded), a few KB each.

    PYTHONPATH=. python tests/fuzz/make_corpus.py   # rewrites tests/fuzz/corpus/checkpoint/

The fuzz target also calls shard_files() to lay out the shards that a mutated
index refers to.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
CORPUS = HERE / "corpus" / "checkpoint"
SHARDS = ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors")
INDEX = "model.safetensors.index.json"


def _weight(rng, rows: int, cols: int) -> np.ndarray:
    return (rng.standard_normal((rows, cols)) * 0.05).astype(np.float32)


def _layer_4bit(rng, name: str, rows: int, cols: int, quant_type: str, blocksize: int, nested: bool) -> dict:
    from q4._src.weights import quantize_weight_4bit

    packed, state = quantize_weight_4bit(_weight(rng, rows, cols), blocksize, quant_type, nested)
    out = {f"{name}.weight": packed, f"{name}.bias": np.zeros(rows, np.float32)}
    out.update({f"{name}.weight.{k}": v for k, v in state.to_dict().items()})
    return out


def _layer_int8(rng, name: str, rows: int, cols: int) -> dict:
    from q4._src.weights import quantize_weight_int8

    cb, scb = quantize_weight_int8(_weight(rng, rows, cols))
    return {f"{name}.weight": cb, f"{name}.SCB": scb, f"{name}.weight_format": np.array(0, np.uint8)}


def checkpoints() -> dict[str, dict[str, np.ndarray]]:
    """File name -> tensors of every safetensors seed."""
    import ml_dtypes

    rng = np.random.default_rng(12)
    return {
        "nf4-plain.safetensors": {
            **_layer_4bit(rng, "fc", 16, 64, "nf4", 64, False),
            "norm.weight": np.ones(64, np.float32),
        },
        "nf4-nested.safetensors": {
            **_layer_4bit(rng, "attn.q", 8, 96, "nf4", 32, True),
            **_layer_4bit(rng, "attn.k", 4, 33, "fp4", 64, False),  # odd size: a partial block, an odd nibble count
        },
        "int8.safetensors": {
            **_layer_int8(rng, "mlp", 12, 40),
            "pos": np.arange(6, dtype=np.int64),
            "emb": _weight(rng, 4, 8).astype(ml_dtypes.bfloat16),
        },
        SHARDS[0]: _layer_4bit(rng, "blocks.0.proj", 8, 64, "fp4", 64, True),
        SHARDS[1]: {**_layer_int8(rng, "blocks.1.proj", 8, 64), "head.weight": _weight(rng, 2, 8)},
    }


def index_text(shards: dict[str, dict[str, np.ndarray]]) -> str:
    weight_map = {k: name for name in SHARDS for k in sorted(shards[name])}
    total = sum(a.nbytes for name in SHARDS for a in shards[name].values())
    return json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2) + "\n"


def shard_files(directory: Path) -> None:
    """Write the sharded seed's two shards (what its index names) into ``directory``."""
    from q4 import checkpoint

    files = checkpoints()
    for name in SHARDS:
        checkpoint.save_file(files[name], directory / name)


def main() -> int:
    from q4 import checkpoint

    CORPUS.mkdir(parents=True, exist_ok=True)
    files = checkpoints()
    for name, tensors in files.items():
        checkpoint.save_file(tensors, CORPUS / name)
    (CORPUS / INDEX).write_text(index_text(files))
    # an empty checkpoint (header only)
    (CORPUS / "empty.safetensors").write_bytes((8).to_bytes(8, "little") + b"{}      ")
    total = sum(p.stat().st_size for p in CORPUS.iterdir())
    print(f"{len(list(CORPUS.iterdir()))} seeds, {total} bytes in {CORPUS}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
