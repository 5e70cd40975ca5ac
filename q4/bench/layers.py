"""Quantized layers beside bitsandbytes 0.50.2 and dense torch, 4096x4096:
forward at batch 1 and 32 and a training step (forward + backward to the
input), in one process.

    .venv/bin/python -m q4.bench.layers
"""

from __future__ import annotations

from q4.bench._common import machine, median_ms, print_table, write_json

N = K = 4096


def main() -> dict:
    import bitsandbytes as bnb
    import torch

    import q4torch.nn as qnn

    torch.manual_seed(0)
    w = torch.randn(N, K) * 0.02

    def build(cls, **kw):
        layer = cls(K, N, bias=True, **kw)
        layer.weight.data = w.clone()
        layer.bias.data.zero_()
        return layer.to("cpu")

    layers = {
        "Linear4bit nf4": (
            build(qnn.Linear4bit, quant_type="nf4", compute_dtype=torch.float32),
            build(bnb.nn.Linear4bit, quant_type="nf4", compute_dtype=torch.float32),
        ),
        "Linear8bitLt t=6": (
            build(qnn.Linear8bitLt, has_fp16_weights=False, threshold=6.0),
            build(bnb.nn.Linear8bitLt, has_fp16_weights=False, threshold=6.0),
        ),
    }
    dense = torch.nn.Linear(K, N)
    dense.weight.data = w.clone()
    dense.weight.requires_grad_(False)  # a frozen base, like the quantized ones: train step = dX and dbias
    results = {}
    for name, (ours, theirs) in layers.items():
        for m in (1, 32):
            x = torch.randn(m, K)
            xg = x.clone().requires_grad_()

            def train(layer, xg=xg):
                xg.grad = None
                layer(xg).sum().backward()

            r = {
                "q4 forward": median_ms(lambda ours=ours, x=x: ours(x)),
                "bitsandbytes forward": median_ms(lambda theirs=theirs, x=x: theirs(x), repeat=5),
                "dense fp32 forward": median_ms(lambda x=x: dense(x)),
                "q4 train step": median_ms(lambda ours=ours: train(ours)),
                "bitsandbytes train step": median_ms(lambda theirs=theirs: train(theirs), repeat=5),
                "dense fp32 train step": median_ms(lambda: train(dense)),
            }
            r["bnb / q4 forward"] = r["bitsandbytes forward"] / r["q4 forward"]
            r["dense / q4 forward"] = r["dense fp32 forward"] / r["q4 forward"]
            r["bnb / q4 train"] = r["bitsandbytes train step"] / r["q4 train step"]
            r["dense / q4 train"] = r["dense fp32 train step"] / r["q4 train step"]
            results[f"{name}, batch {m}"] = r
    info = machine()
    print(f"machine: {info['cpu']}, {info['cores']} cores; q4 path {info['q4_isa']}, {info['q4_threads']} threads")
    header = ["layer"] + list(next(iter(results.values())))
    print_table("median ms; ratios > 1 mean q4 is faster", header, [[k, *v.values()] for k, v in results.items()])
    print(f"\nJSON: {write_json('layers', {'machine': info, 'results': results})}")
    return results


if __name__ == "__main__":
    main()
