"""`make demo`: all-MiniLM-L6-v2 quantized once with `q4 quantize`, then run
in PyTorch and in Flax from the same file.

    .venv/bin/python examples/minilm/demo.py [--type nf4|fp4|int8] [--blocksize N]

Prints the model's bytes in fp32 and quantized, the cosine similarity of each
framework's quantized embeddings to the fp32 embeddings, how far the two
frameworks' quantized embeddings are apart, and sentences per second.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import q4  # noqa: E402
from examples.minilm import common, flax_model, torch_model  # noqa: E402


def _q4_command() -> list[str]:
    script = Path(sys.executable).with_name("q4")
    return [str(script)] if script.exists() else [sys.executable, "-m", "q4.cli"]


def _throughput(embed, sentences: list[str], repeat: int = 5) -> float:
    embed(sentences)  # warm-up (JAX compiles here)
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        embed(sentences)
        times.append(time.perf_counter() - t0)
    return len(sentences) / statistics.median(times)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--type", default="nf4", choices=["nf4", "fp4", "int8"])
    p.add_argument("--blocksize", type=int, default=64)
    p.add_argument("--out", type=Path, default=ROOT / "build" / "demo")
    args = p.parse_args(argv)

    src = common.model_dir() / "model.safetensors"
    args.out.mkdir(parents=True, exist_ok=True)
    dst = args.out / f"minilm-{args.type}.safetensors"
    cmd = [*_q4_command(), "quantize", str(src), str(dst), "--type", args.type, "--blocksize", str(args.blocksize)]
    print("$ q4 " + " ".join(cmd[cmd.index("quantize") :]).replace(str(ROOT) + "/", ""), flush=True)
    subprocess.run(cmd, check=True)

    sentences = common.SENTENCES
    dense, quant = common.load_tensors(src), common.load_tensors(dst)
    models = {
        ("PyTorch", "fp32"): (torch_model, torch_model.load(dense)),
        ("PyTorch", args.type): (torch_model, torch_model.load(quant)),
        ("Flax", "fp32"): (flax_model, flax_model.load(dense)),
        ("Flax", args.type): (flax_model, flax_model.load(quant)),
    }
    emb = {key: mod.embed(model, sentences) for key, (mod, model) in models.items()}
    speed_set = sentences * 4
    speed = {
        key: _throughput(lambda s, m=mod, o=model: m.embed(o, s), speed_set) for key, (mod, model) in models.items()
    }

    layers = list(q4.checkpoint.validate(quant))
    lin_fp32 = sum(dense[f"{name}.weight"].nbytes for name in layers)
    lin_q = sum(
        v.nbytes
        for k, v in quant.items()
        for name in layers
        if k in (f"{name}.weight", f"{name}.SCB", f"{name}.weight_format") or k.startswith(f"{name}.weight.")
    )
    print(f"\nall-MiniLM-L6-v2, {len(sentences)} sentences; {len(layers)} linear layers quantized to {args.type}")
    print(
        f"model bytes: {src.stat().st_size / 1e6:.1f} MB fp32 -> {dst.stat().st_size / 1e6:.1f} MB "
        f"(linear layers {lin_fp32 / 1e6:.1f} MB -> {lin_q / 1e6:.1f} MB; embeddings kept in fp32)\n"
    )
    rows = []
    for fw in ("PyTorch", "Flax"):
        cos = common.cosine(emb[(fw, args.type)], emb[(fw, "fp32")])
        rows.append(
            [fw, f"{cos.mean():.4f}", f"{cos.min():.4f}", f"{speed[(fw, 'fp32')]:.0f}", f"{speed[(fw, args.type)]:.0f}"]
        )
    header = [
        "framework",
        f"cosine {args.type} vs fp32 (mean)",
        "(min)",
        "sentences/s fp32",
        f"sentences/s {args.type}",
    ]
    _table(header, rows)
    diff = abs(emb[("PyTorch", args.type)] - emb[("Flax", args.type)]).max()
    dense_diff = abs(emb[("PyTorch", "fp32")] - emb[("Flax", "fp32")]).max()
    print(f"\nPyTorch vs Flax, {args.type} embeddings: max |difference| {diff:.2e} (fp32 models: {dense_diff:.2e})")
    print(
        f"check every layer in both frameworks: q4 parity {dst.relative_to(ROOT) if dst.is_relative_to(ROOT) else dst}"
    )
    return 0


def _table(header, rows) -> None:
    cells = [header] + rows
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    for j, r in enumerate(cells):
        print("  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths, strict=True))))
        if j == 0:
            print("  ".join("-" * w for w in widths))


if __name__ == "__main__":
    sys.exit(main())
