"""all-MiniLM-L6-v2 with q4's error-minimising 4-bit quantizers, same bytes
format: per block size, the plain quantizer (absmax, bitsandbytes'), 'mse'
(per-block scale search) and 'gptq' with 128 calibration sentences disjoint
from the evaluation sentences: everyday English ('general',
calibration.txt) at GPTQ's damping 0.01, and Python's documentation
('pydoc', technical text) at 0.01 and at --damp. NF4, nested absmax.

Prints the mean cosine of the embeddings to the fp32 model's on
common.SENTENCES, the mean relative weight error ||W - Q(W)|| / ||W|| over the
quantized layers, the quantization time of the whole model (gptq: with its
calibration pass), and the smallest cosine between q4's embeddings and
bitsandbytes' from the same bytes (bitsandbytes' own loader and kernels).

    .venv/bin/python examples/minilm/quantizers.py [--blocksizes 32 64 128]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import numpy as np  # noqa: E402
import torch  # noqa: E402

import q4torch  # noqa: E402
from examples.minilm import common, torch_model  # noqa: E402
from q4._src.weights import dequantize_weight_4bit  # noqa: E402


def calibration_batches(n: int, source: str = "general") -> list[tuple[torch.Tensor, torch.Tensor]]:
    tok = common.tokenizer()
    out = []
    for s in common.calibration_sentences(n, source):
        e = tok.encode(s)
        k = int(sum(e.attention_mask))  # one sentence per batch: no padding tokens
        out.append((torch.tensor([e.ids[:k]]), torch.tensor([e.attention_mask[:k]])))
    return out


def weight_error(model, dense: dict[str, np.ndarray]) -> float:
    errs = []
    for name, m in model.named_modules():
        if isinstance(m, q4torch.nn.Linear4bit):
            w = dense[f"{name}.weight"].astype(np.float64)
            q = dequantize_weight_4bit(m.weight.data.numpy(), m.weight.quant_state.to_numpy())
            errs.append(np.linalg.norm(w - q) / np.linalg.norm(w))
    return float(np.mean(errs))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--blocksizes", type=int, nargs="+", default=[32, 64, 128])
    p.add_argument("--calibration", type=int, default=128, help="calibration sentences (default 128)")
    p.add_argument("--damp", type=float, default=0.3, help="the second gptq row's damping (default 0.3)")
    args = p.parse_args(argv)
    dense_t = common.load_tensors()
    dense = torch_model.load(dense_t)
    ref = torch_model.embed(dense, common.SENTENCES)
    cal = {source: calibration_batches(args.calibration, source) for source in common.CALIBRATION_SOURCES}
    q4torch.replace_linear(torch_model.load(dense_t), "nf4")  # warm-up (library and thread start-up not timed)
    print(
        f"all-MiniLM-L6-v2, NF4 nested, {len(common.SENTENCES)} evaluation sentences, "
        f"{args.calibration} calibration sentences (disjoint); torch threads {torch.get_num_threads()}"
    )
    print(
        f"{'block':>5}  {'method':>18}  {'cosine':>7}  {'1-cos':>7}  {'weight err':>10}  {'time s':>7}  {'bnb vs q4':>9}"
    )
    for bs in args.blocksizes:
        rows = (("absmax", 0.01, None), ("mse", 0.01, None), ("gptq", 0.01, "general"), ("gptq", 0.01, "pydoc"))
        for method, damp, source in (*rows, ("gptq", args.damp, "pydoc")):
            model = torch_model.load(dense_t)
            t0 = time.perf_counter()
            q4torch.replace_linear(
                model, "nf4", blocksize=bs, method=method, calibration=cal[source] if source else None,
                skip=("pooler.*",),  # unused by sentence embeddings (and never reached by calibration)
                gptq_damp=damp,
            )  # fmt: skip
            dt = time.perf_counter() - t0
            emb = torch_model.embed(model, common.SENTENCES)
            cos = common.cosine(emb, ref).mean()
            sd = {k: v.numpy() for k, v in model.state_dict().items()}
            bnb_emb = torch_model.embed(torch_model.load_into_bitsandbytes(dense, sd), common.SENTENCES)
            agree = common.cosine(bnb_emb, emb).min()
            werr = weight_error(model, dense_t)
            label = method if method != "gptq" else f"gptq {source} {damp:g}"
            print(
                f"{bs:>5}  {label:>18}  {cos:>7.5f}  {1 - cos:>7.5f}  {werr:>10.4f}  {dt:>7.2f}  {agree:>9.6f}",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
