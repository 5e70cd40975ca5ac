"""q4jax 4-bit layer beside q4torch on the same kernel, a pure-jax.numpy
dequantize + dot, qwix 0.1.8 (NF4 weight-only PTQ, tile_size=64) and XLA's
dense fp32, 4096x4096, under jit; plus XLA's memory analysis of a 4-layer
remat training step (no dequantized weight kept alive for backward).

    Q4_LIBRARY=build/<dir>/libq4.so PYTHONPATH=. .venv/bin/python benchmarks/run.py jax
    (qwix: .venv/bin/pip install qwix==0.1.8)
"""

from __future__ import annotations

import functools

import numpy as np
from common import interleaved, median_ms, print_header, print_table, write_json

N = K = 4096


def main() -> dict:
    import jax
    import jax.numpy as jnp
    import torch
    from flax import nnx

    import q4jax
    import q4torch
    import q4torch.functional as F

    head = print_header("jax: q4jax 4-bit layer beside q4torch, jnp, qwix and XLA dense, 4096x4096 fp32 (and bf16)")
    rng = np.random.default_rng(0)
    w = (rng.standard_normal((N, K)) * 0.02).astype(np.float32)
    packed, state = q4jax.quantize_4bit(jnp.asarray(w), 64, "nf4", True)
    pt, st = F.quantize_4bit(torch.from_numpy(w), blocksize=64, quant_type="nf4", compress_statistics=True)
    wt = jnp.asarray(w.T.copy())  # [K, N]: XLA's best layout for x @ W^T

    # weights are jit arguments, not closure constants (XLA would fold them into the program)
    fwd_q4 = functools.partial(jax.jit(lambda x, p, s: q4jax.matmul_4bit(x, p, s)), p=packed, s=state)
    fwd_jnp = functools.partial(jax.jit(lambda x, p, s: x @ q4jax.dequantize_4bit(p, s).T), p=packed, s=state)
    fwd_dense = functools.partial(jax.jit(lambda x, w: x @ w), w=wt)
    # value_and_grad: with the loss returned the forward is computed too (XLA drops it from a bare grad)
    step_q4 = functools.partial(
        jax.jit(jax.value_and_grad(lambda x, p, s: q4jax.matmul_4bit(x, p, s).sum())), p=packed, s=state
    )
    try:
        import qwix

        lin = nnx.Linear(K, N, use_bias=False, kernel_init=lambda key, shape, dtype: wt, rngs=nnx.Rngs(0))
        qmodel = qwix.quantize_model(
            lin, qwix.PtqProvider([qwix.QtRule(module_path=".*", weight_qtype="nf4", tile_size=64)]), jnp.ones((1, K))
        )
        graph, qstate = nnx.split(qmodel)
        fwd_qwix = functools.partial(jax.jit(lambda x, st: nnx.merge(graph, st)(x)), st=qstate)
    except ImportError as e:
        qmodel = None
        print(f"qwix not run: {e} (.venv/bin/pip install qwix==0.1.8)")

    fwd_dense_bf16 = functools.partial(jax.jit(lambda x, w: x @ w), w=wt.astype(jnp.bfloat16))
    results = {}
    for m in (1, 8, 32):
        xn = rng.standard_normal((m, K)).astype(np.float32)
        x = jnp.asarray(xn)
        # q4jax and q4torch (and the dense peers) in interleaved rounds: their ratio is the figure to read
        xb, xbt = x.astype(jnp.bfloat16), torch.from_numpy(xn).to(torch.bfloat16)
        xt = torch.from_numpy(xn)
        timed = interleaved(
            {
                "q4jax matmul_4bit": lambda x=x: jax.block_until_ready(fwd_q4(x)),
                "q4torch matmul_4bit": lambda xt=xt: q4torch.matmul_4bit(xt, pt, st),
                "XLA dense fp32": lambda x=x: jax.block_until_ready(fwd_dense(x)),
                "q4jax train step (loss + dX)": lambda x=x: jax.block_until_ready(step_q4(x)),
                # bf16 input: the bf16-compute kernels (README "bf16 compute") in both front ends
                "q4jax matmul_4bit bf16": lambda xb=xb: jax.block_until_ready(fwd_q4(xb)),
                "q4torch matmul_4bit bf16": lambda xbt=xbt: q4torch.matmul_4bit(xbt, pt, st),
                "XLA dense bf16": lambda xb=xb: jax.block_until_ready(fwd_dense_bf16(xb)),
            },
            rounds=15,
            min_sample_s=10e-3,  # ~30 calls per sample at batch 1: the per-call jitter of a VM averages out
        )
        r = {name: t["median_ms"] for name, t in timed.items()}
        r["jnp dequantize + dot"] = median_ms(lambda x=x: jax.block_until_ready(fwd_jnp(x)), repeat=5)
        if qmodel is not None:
            r["qwix 0.1.8 nf4"] = median_ms(lambda x=x: jax.block_until_ready(fwd_qwix(x)), repeat=5)
            r["qwix / q4jax"] = r["qwix 0.1.8 nf4"] / r["q4jax matmul_4bit"]
        r["q4jax / q4torch"] = r["q4jax matmul_4bit"] / r["q4torch matmul_4bit"]
        r["XLA dense / q4jax"] = r["XLA dense fp32"] / r["q4jax matmul_4bit"]
        r["q4jax / q4torch bf16"] = r["q4jax matmul_4bit bf16"] / r["q4torch matmul_4bit bf16"]
        r["XLA dense bf16 / q4jax bf16"] = r["XLA dense bf16"] / r["q4jax matmul_4bit bf16"]
        results[f"batch {m}"] = r

    # memory of a 4-layer remat training step, fused vs jnp dequantize + dot
    layers = 4
    ws = jnp.asarray(rng.standard_normal((layers, 1024, 1024)).astype(np.float32) * 0.03)
    ps, ss = jax.vmap(lambda a: q4jax.quantize_4bit(a, 64, "nf4", True))(ws)

    def loss(x, mm):
        def body(h, layer):
            return jnp.tanh(mm(h, *layer)), None

        h, _ = jax.lax.scan(jax.checkpoint(body), x, (ps, ss))
        return (h**2).sum()

    x = jnp.ones((32, 1024))
    mem = {}
    for name, mm in (
        ("q4jax fused", lambda h, p, s: q4jax.matmul_4bit(h, p, s)),
        ("jnp dequantize + dot", lambda h, p, s: h @ q4jax.dequantize_4bit(p, s).T),
    ):
        analysis = jax.jit(jax.grad(loss), static_argnums=1).lower(x, mm).compile().memory_analysis()
        mem[name] = {"temp MiB": analysis.temp_size_in_bytes / 2**20}
    dequantized_layer_mib = 1024 * 1024 * 4 / 2**20
    for name, r in results.items():
        print_table(f"{name} (median ms)", ["measure", "value"], [[k, v] for k, v in r.items()])
    print_table(
        f"4-layer remat training step, 1024x1024 layers (one dequantized layer = {dequantized_layer_mib:.0f} MiB)",
        ["path", "XLA temp MiB"],
        [[k, v["temp MiB"]] for k, v in mem.items()],
    )
    record = {**head, "results": results, "memory": mem}
    print(f"\nJSON: {write_json('jax_layers', record)}")
    return record


if __name__ == "__main__":
    main()
