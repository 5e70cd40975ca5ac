"""Quantized layers beside bitsandbytes 0.50.2 and dense torch, 4096x4096 with
bias, fp32 and bf16 inputs: forward at batch 1, 32 and 512 and a training step
(forward + backward to the input, frozen weight), in one process; and the
forward of Linear4bit at all-MiniLM-L6-v2's shapes (384x384, 384x1536,
1536x384) at batch 1, where the per-call cost of each library's Python and C
path is most of the call, and at 256 rows (16 sentences of 16 tokens), where
small weights split into few tiles per thread.

    Q4_LIBRARY=build/<dir>/libq4.so PYTHONPATH=. .venv/bin/python benchmarks/run.py layers

Forward: every layer in eval() under torch.inference_mode() (a user's
inference; bitsandbytes' Linear4bit then takes its fused AVX512-BF16 kernel
where the CPU has one, computing in bf16). Training step: train() mode, the
input requires grad. bitsandbytes repacks a Linear4bit's weight in place on
its first eval forward, after which a train-mode forward fails, so its
training step runs on a second layer that never ran in eval.
"""

from __future__ import annotations

import logging

from common import interleaved, print_header, print_table, write_json

N = K = 4096
BATCHES = (1, 32, 512)
SMALL = ((384, 384), (384, 1536), (1536, 384))  # (in, out) of all-MiniLM-L6-v2's linear layers
SMALL_BATCHES = (1, 256)


def main() -> dict:
    import bitsandbytes as bnb
    import torch

    import q4torch.nn as qnn

    # bitsandbytes logs on every fp32 Linear8bitLt call that it rounds the input to fp16 (said once below)
    logging.getLogger("bitsandbytes.autograd._functions").setLevel(logging.ERROR)
    head = print_header("layers: Linear4bit / Linear8bitLt forward and training step, 4096x4096, fp32 / bf16 input")
    torch.manual_seed(0)
    w = torch.randn(N, K) * 0.02
    b = torch.randn(N) * 0.1

    def build(cls, weight=w, bias=b, **kw):
        layer = cls(weight.shape[1], weight.shape[0], bias=True, **kw)
        layer.weight.data = weight.clone()
        layer.bias.data = bias.clone()
        return layer.to("cpu")

    kinds = {
        "Linear4bit nf4": (qnn.Linear4bit, bnb.nn.Linear4bit, {"quant_type": "nf4"}),  # computes in x's dtype
        "Linear8bitLt t=0": (qnn.Linear8bitLt, bnb.nn.Linear8bitLt, {"has_fp16_weights": False, "threshold": 0.0}),
        "Linear8bitLt t=6": (qnn.Linear8bitLt, bnb.nn.Linear8bitLt, {"has_fp16_weights": False, "threshold": 6.0}),
    }
    dense = build(torch.nn.Linear)
    dense.weight.requires_grad_(False)  # a frozen base, like the quantized ones: train step = dX and dbias

    def forward(layer, x):
        return lambda: layer(x)

    def train_step(layer, x):
        xg = x.clone().requires_grad_()
        return lambda: torch.autograd.grad(layer(xg).sum(), xg)[0]

    results = {}
    for name, (ours_cls, theirs_cls, kw) in kinds.items():
        ours = build(ours_cls, **kw)
        theirs_eval, theirs_train = build(theirs_cls, **kw).eval(), build(theirs_cls, **kw).train()
        for dtype, m in [(d, m) for d in (torch.float32, torch.bfloat16) for m in BATCHES]:
            x = torch.randn(m, K).to(dtype)
            dense.to(dtype)
            ours.eval()
            dense.eval()
            with torch.inference_mode():
                fwd = interleaved(
                    {
                        "q4 forward": forward(ours, x),
                        "bitsandbytes forward": forward(theirs_eval, x),
                        "dense forward": forward(dense, x),
                    }
                )
            ours.train()
            dense.train()
            step = interleaved(
                {
                    "q4 train step": train_step(ours, x),
                    "bitsandbytes train step": train_step(theirs_train, x),
                    "dense train step": train_step(dense, x),
                },
                rounds=7 if m < 512 else 3,
            )
            r = {k: v["median_ms"] for k, v in {**fwd, **step}.items()}
            r["bnb / q4 forward"] = r["bitsandbytes forward"] / r["q4 forward"]
            r["dense / q4 forward"] = r["dense forward"] / r["q4 forward"]
            r["bnb / q4 train"] = r["bitsandbytes train step"] / r["q4 train step"]
            r["dense / q4 train"] = r["dense train step"] / r["q4 train step"]
            results[f"{name}, {str(dtype).removeprefix('torch.')}, batch {m}"] = r
        dense.to(torch.float32)
    small = {}
    for k_in, n_out in SMALL:
        ws, bs = torch.randn(n_out, k_in) * 0.05, torch.randn(n_out) * 0.1
        for dtype in (torch.float32, torch.bfloat16):
            layers = {
                "q4": build(qnn.Linear4bit, ws, bs, quant_type="nf4", compute_dtype=dtype).eval(),
                "bitsandbytes": build(bnb.nn.Linear4bit, ws, bs, quant_type="nf4", compute_dtype=dtype).eval(),
                "dense": build(torch.nn.Linear, ws, bs).to(dtype).eval(),
            }
            for m in SMALL_BATCHES:
                x = torch.randn(m, k_in).to(dtype)
                with torch.inference_mode():
                    res = interleaved({f"{lib} forward": forward(layer, x) for lib, layer in layers.items()})
                r = {k: 1e3 * v["median_ms"] for k, v in res.items()}  # microseconds
                r["bnb / q4"] = r["bitsandbytes forward"] / r["q4 forward"]
                r["dense / q4"] = r["dense forward"] / r["q4 forward"]
                small[f"Linear4bit nf4 {k_in}x{n_out}, {str(dtype).removeprefix('torch.')}, batch {m}"] = r
    print("note: bitsandbytes' Linear8bitLt rounds fp32 inputs to fp16 before its int8 quantization (its warning)")
    header = ["layer"] + list(next(iter(results.values())))
    print_table(
        "median ms (interleaved rounds); ratios > 1 mean q4 is faster",
        header,
        [[k, *v.values()] for k, v in results.items()],
    )
    print_table(
        "small layers (all-MiniLM-L6-v2 shapes), forward: median µs per call; ratios > 1 mean q4 is faster",
        ["layer", "q4 µs", "bitsandbytes µs", "dense µs", "bnb / q4", "dense / q4"],
        [[k, *v.values()] for k, v in small.items()],
    )
    record = {**head, "results": results, "small_layers_us": small}
    print(f"\nJSON: {write_json('layers', record)}")
    return record


if __name__ == "__main__":
    main()
