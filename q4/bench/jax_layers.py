"""q4jax 4-bit layer beside q4torch on the same kernel, a pure-jax.numpy
dequantize + dot, qwix 0.1.8 (NF4 weight-only PTQ, tile_size=64) and XLA's
dense fp32, 4096x4096, under jit; plus XLA's memory analysis of a 4-layer
remat training step (no dequantized weight kept alive for backward).

    .venv/bin/python -m q4.bench.jax_layers      (qwix: pip install qwix==0.1.8)
"""

from __future__ import annotations

import numpy as np

from q4.bench._common import machine, median_ms, print_table, write_json

N = K = 4096


def main() -> dict:
    import jax
    import jax.numpy as jnp
    import torch
    from flax import nnx

    import q4jax
    import q4torch
    import q4torch.functional as F

    rng = np.random.default_rng(0)
    w = (rng.standard_normal((N, K)) * 0.02).astype(np.float32)
    packed, state = q4jax.quantize_4bit(jnp.asarray(w), 64, "nf4", True)
    pt, st = F.quantize_4bit(torch.from_numpy(w), blocksize=64, quant_type="nf4", compress_statistics=True)
    wt = jnp.asarray(w.T.copy())  # [K, N]: XLA's best layout for x @ W^T

    fwd_q4 = jax.jit(lambda x: q4jax.matmul_4bit(x, packed, state))
    fwd_jnp = jax.jit(lambda x: x @ q4jax.dequantize_4bit(packed, state).T)
    fwd_dense = jax.jit(lambda x: x @ wt)
    step_q4 = jax.jit(jax.grad(lambda x: q4jax.matmul_4bit(x, packed, state).sum()))
    try:
        import qwix

        lin = nnx.Linear(K, N, use_bias=False, rngs=nnx.Rngs(0))
        lin.kernel.value = wt
        qmodel = qwix.quantize_model(
            lin, qwix.PtqProvider([qwix.QtRule(module_path=".*", weight_qtype="nf4", tile_size=64)]), jnp.ones((1, K))
        )
        fwd_qwix = nnx.jit(lambda m, x: m(x))
    except ImportError:
        qmodel = None

    results = {}
    for m in (1, 32):
        xn = rng.standard_normal((m, K)).astype(np.float32)
        x = jnp.asarray(xn)
        r = {
            "q4jax matmul_4bit": median_ms(lambda x=x: jax.block_until_ready(fwd_q4(x))),
            "q4torch matmul_4bit": median_ms(lambda xn=xn: q4torch.matmul_4bit(torch.from_numpy(xn), pt, st)),
            "jnp dequantize + dot": median_ms(lambda x=x: jax.block_until_ready(fwd_jnp(x)), repeat=5),
            "XLA dense fp32": median_ms(lambda x=x: jax.block_until_ready(fwd_dense(x))),
            "q4jax train step (dX)": median_ms(lambda x=x: jax.block_until_ready(step_q4(x))),
        }
        if qmodel is not None:
            r["qwix 0.1.8 nf4"] = median_ms(lambda x=x: jax.block_until_ready(fwd_qwix(qmodel, x)), repeat=5)
            r["qwix / q4jax"] = r["qwix 0.1.8 nf4"] / r["q4jax matmul_4bit"]
        r["q4jax / q4torch"] = r["q4jax matmul_4bit"] / r["q4torch matmul_4bit"]
        r["XLA dense / q4jax"] = r["XLA dense fp32"] / r["q4jax matmul_4bit"]
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
    info = machine()
    print(f"machine: {info['cpu']}, {info['cores']} cores; q4 path {info['q4_isa']}, {info['q4_threads']} threads")
    for name, r in results.items():
        print_table(f"{name} (median ms)", ["measure", "value"], [[k, v] for k, v in r.items()])
    print_table(
        f"4-layer remat training step, 1024x1024 layers (one dequantized layer = {dequantized_layer_mib:.0f} MiB)",
        ["path", "XLA temp MiB"],
        [[k, v["temp MiB"]] for k, v in mem.items()],
    )
    record = {"machine": info, "results": results, "memory": mem}
    print(f"\nJSON: {write_json('jax_layers', record)}")
    return record


if __name__ == "__main__":
    main()
