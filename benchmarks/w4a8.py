"""W4A8 (activation_quant='int8') beside bitsandbytes 0.50.2's fused bf16 CPU
path, q4's default arithmetic and dense torch: a 4096x4096 NF4 layer (block
64, nested absmax, bias), forward at batch 1, 32 and 512, fp32 and bf16
inputs, in one process.

    Q4_LIBRARY=build/<dir>/libq4.so PYTHONPATH=. .venv/bin/python benchmarks/run.py w4a8

Every torch layer runs in eval() under torch.inference_mode() (bitsandbytes'
best CPU path: on AVX512-BF16 CPUs a fused kernel computing in bf16, also for
fp32 inputs). q4jax runs the same W4A8 kernel under jax.jit. Errors:
||y - y_ref|| / ||y_ref|| against the fp64 product of the (dtype-rounded)
input with the dequantized NF4 weight (the same bytes for every contestant).
"""

from __future__ import annotations

import numpy as np
from common import interleaved, print_header, print_table, write_json

N = K = 4096
BATCHES = (1, 32, 512)


def main() -> dict:
    import bitsandbytes as bnb
    import jax
    import jax.numpy as jnp
    import torch
    from flax import nnx

    import q4jax
    import q4torch.functional as F
    import q4torch.nn as qnn

    head = print_header("w4a8: Linear4bit nf4 forward with int8 activations (W4A8), 4096x4096")
    torch.manual_seed(0)
    w = torch.randn(N, K) * 0.02
    b = torch.randn(N) * 0.1

    def build(cls, **kw):
        layer = cls(K, N, bias=True, quant_type="nf4", **kw)
        layer.weight.data = w.clone()
        layer.bias.data = b.clone()
        return layer.to("cpu").eval()

    w4a8, default, theirs = (
        build(qnn.Linear4bit, activation_quant="int8"),
        build(qnn.Linear4bit),
        build(bnb.nn.Linear4bit),
    )
    # the same bytes and scales everywhere (bitsandbytes repacks its copy in place on its first forward)
    assert torch.equal(w4a8.weight.data, default.weight.data)
    w64 = F.dequantize_4bit(default.weight.data, default.weight.quant_state).double().numpy().reshape(N, K)
    jl = q4jax.nn.Linear4bit(K, N, quant_type="nf4", activation_quant="int8", rngs=nnx.Rngs(0))
    jl.set_weight(jnp.asarray(w.numpy()))
    jl.bias.set_value(jnp.asarray(b.numpy()))
    jfwd = jax.jit(lambda m, x: m(x))
    dense = torch.nn.Linear(K, N).eval()
    dense.weight.data = torch.from_numpy(w64.astype(np.float32))
    dense.bias.data = b.clone()

    def err(y, x) -> float:
        ref = x.double().numpy() @ w64.T + b.double().numpy()
        got = np.asarray(y.float() if isinstance(y, torch.Tensor) else np.asarray(y, np.float32), np.float64)
        return float(np.linalg.norm(got - ref) / np.linalg.norm(ref))

    results = {}
    for dtype, m in [(d, m) for d in (torch.float32, torch.bfloat16) for m in BATCHES]:
        x = torch.randn(m, K).to(dtype)
        xj = jnp.asarray(x.float().numpy()).astype(jnp.bfloat16 if dtype == torch.bfloat16 else jnp.float32)
        dense.to(torch.bfloat16)
        xd = x.to(torch.bfloat16)
        with torch.inference_mode():
            calls = {
                "q4 W4A8": lambda x=x: w4a8(x),
                "q4jax W4A8": lambda xj=xj: jfwd(jl, xj).block_until_ready(),
                "q4 default": lambda x=x: default(x),
                "bitsandbytes": lambda x=x: theirs(x),
                "dense bf16": lambda xd=xd: dense(xd),
            }
            t = interleaved(calls, rounds=9 if m < 512 else 5)
            e = {
                "err q4 W4A8": err(w4a8(x), x.float()),
                "err q4 default": err(default(x), x.float()),
                "err bitsandbytes": err(theirs(x), x.float()),
            }
        r = {k: v["median_ms"] for k, v in t.items()}
        r["bnb / W4A8"] = r["bitsandbytes"] / r["q4 W4A8"]
        r["default / W4A8"] = r["q4 default"] / r["q4 W4A8"]
        r["dense bf16 / W4A8"] = r["dense bf16"] / r["q4 W4A8"]
        r.update(e)
        results[f"{str(dtype).removeprefix('torch.')}, batch {m}"] = r
        dense.to(torch.float32)
    header = ["input"] + list(next(iter(results.values())))
    print_table(
        "median ms (interleaved rounds); ratios > 1 mean W4A8 is faster; errors vs fp64 with the NF4 weight",
        header,
        [[k, *v.values()] for k, v in results.items()],
    )
    record = {**head, "results": results}
    print(f"\nJSON: {write_json('w4a8', record)}")
    return record


if __name__ == "__main__":
    main()
