"""Fused 4-bit matmul on a 4096x4096 NF4 weight (block 64, nested absmax):
q4 (raw kernel, PyTorch op, JAX op) beside bitsandbytes 0.50.2's Linear4bit,
dense fp32 PyTorch and XLA, and dequantize + dense matmul, in one process.

    .venv/bin/python -m q4.bench.matmul

Reports medians in ms, ratios, and the batch-1 effective bandwidth (packed
weight + scales bytes / time) against the machine's read bandwidth measured
in the same run.
"""

from __future__ import annotations

from q4.bench._common import machine, median_ms, print_table, write_json

N = K = 4096


def read_bandwidth_gbs(torch) -> float:
    """Bytes per second of a multithreaded reduction over 256 MiB (read only)."""
    a = torch.ones(64 << 20, dtype=torch.float32)
    ms = median_ms(lambda: a.sum(), repeat=10)
    return a.numel() * 4 / (ms * 1e-3) / 1e9


def main() -> dict:
    import bitsandbytes as bnb
    import jax
    import jax.numpy as jnp
    import torch

    import q4
    import q4jax
    import q4torch
    import q4torch.functional as F
    from q4torch._src import ops

    torch.manual_seed(0)
    w = torch.randn(N, K) * 0.02
    packed, state = F.quantize_4bit(w, blocksize=64, quant_type="nf4", compress_statistics=True)
    weight_bytes = packed.numel() + state.absmax.numel() + 4 * state.state2.absmax.numel()
    np_state = state.to_numpy()
    np_packed = packed.numpy()
    pj, sj = q4jax.quantize_4bit(jnp.asarray(w.numpy()), 64, "nf4", True)
    w_deq = F.dequantize_4bit(packed, state)
    bnb_layer = bnb.nn.Linear4bit(K, N, bias=False, compute_dtype=torch.float32, quant_type="nf4").to("cpu")
    bw = read_bandwidth_gbs(torch)

    jit_q4 = jax.jit(lambda x: q4jax.matmul_4bit(x, pj, sj))
    jit_dense = jax.jit(lambda x, wt: x @ wt)  # W^T laid out [K, N]: XLA's best layout for x @ W^T
    wj_t = jnp.asarray(w.numpy().T.copy())
    jit_jnp_dequant = jax.jit(lambda x: x @ q4jax.dequantize_4bit(pj, sj).T)
    jit_grad = jax.jit(jax.grad(lambda x: q4jax.matmul_4bit(x, pj, sj).sum()))

    results = {}
    for m in (1, 32):
        x = torch.randn(m, K)
        xn, xj = x.numpy(), jnp.asarray(x.numpy())
        r = {
            "q4 raw kernel": median_ms(lambda: q4.gemm_4bit(xn, np_packed, np_state)),
            "q4 PyTorch": median_ms(lambda: q4torch.matmul_4bit(x, packed, state)),
            "q4 JAX (jit)": median_ms(lambda: jax.block_until_ready(jit_q4(xj))),
            "bitsandbytes Linear4bit": median_ms(lambda: bnb_layer(x), repeat=5),
            "dense fp32 torch F.linear": median_ms(lambda: torch.nn.functional.linear(x, w)),
            "dense fp32 XLA": median_ms(lambda: jax.block_until_ready(jit_dense(xj, wj_t))),
            "jnp dequantize + dot": median_ms(lambda: jax.block_until_ready(jit_jnp_dequant(xj)), repeat=5),
        }
        r["bnb / q4"] = r["bitsandbytes Linear4bit"] / r["q4 PyTorch"]
        r["dense torch / q4"] = r["dense fp32 torch F.linear"] / r["q4 PyTorch"]
        r["dense XLA / q4 JAX"] = r["dense fp32 XLA"] / r["q4 JAX (jit)"]
        r["JAX / PyTorch"] = r["q4 JAX (jit)"] / r["q4 PyTorch"]
        if m == 1:
            r["effective GB/s"] = weight_bytes / (r["q4 raw kernel"] * 1e-3) / 1e9
            r["fraction of read bandwidth"] = r["effective GB/s"] / bw
        results[f"forward, batch {m}"] = r

    g = torch.randn(32, N)
    gj = jnp.asarray(torch.randn(32, K).numpy())
    r = {
        "q4 PyTorch grad input": median_ms(
            lambda: ops.gemm_4bit_grad_input(
                g, packed.reshape(-1), state.absmax, state.state2.absmax, state.offset, N, K, 64, "nf4"
            )
        ),
        "q4 JAX grad input (jit)": median_ms(lambda: jax.block_until_ready(jit_grad(gj))),
        "dequantize + dense matmul": median_ms(lambda: g @ F.dequantize_4bit(packed, state)),
        "dense fp32 g @ W": median_ms(lambda: g @ w_deq),
    }
    r["(dequant + dense) / q4"] = r["dequantize + dense matmul"] / r["q4 PyTorch grad input"]
    results["backward dX, batch 32"] = r

    # LLM.int8 (Linear8bitLt-style, threshold 6.0), batch 32
    layer8 = bnb.nn.Linear8bitLt(K, N, bias=False, has_fp16_weights=False, threshold=6.0)
    layer8.weight.data = w.clone()
    layer8 = layer8.to("cpu")
    x = torch.randn(32, K)
    layer8(x)
    sd8 = layer8.state_dict()  # bitsandbytes int8 weight (CB) and row scales (SCB)
    cb, scb = sd8["weight"], sd8["SCB"]
    cbj, scbj = jnp.asarray(cb.numpy()), jnp.asarray(scb.numpy())
    jit_8 = jax.jit(lambda a: q4jax.matmul_8bit(a, cbj, scbj, threshold=6.0))
    xj = jnp.asarray(x.numpy())
    exact = x.double() @ w.double().t()
    r = {
        "q4 PyTorch int8_linear": median_ms(lambda: F.int8_linear(x, cb, scb, 6.0)),
        "q4 JAX matmul_8bit (jit)": median_ms(lambda: jax.block_until_ready(jit_8(xj))),
        "bitsandbytes Linear8bitLt": median_ms(lambda: layer8(x), repeat=5),
        "dense fp32 torch F.linear": median_ms(lambda: torch.nn.functional.linear(x, w)),
        "q4 rel. error vs fp64": float((F.int8_linear(x, cb, scb, 6.0).double() - exact).norm() / exact.norm()),
        "bnb rel. error vs fp64": float((layer8(x).double() - exact).norm() / exact.norm()),
    }
    r["bnb / q4"] = r["bitsandbytes Linear8bitLt"] / r["q4 PyTorch int8_linear"]
    r["JAX / PyTorch"] = r["q4 JAX matmul_8bit (jit)"] / r["q4 PyTorch int8_linear"]
    results["LLM.int8 forward, batch 32"] = r

    m_info = machine()
    print(
        f"machine: {m_info['cpu']}, {m_info['cores']} cores; q4 path {m_info['q4_isa']}, {m_info['q4_threads']} threads; "
        f"read bandwidth {bw:.1f} GB/s; packed weight + scales {weight_bytes / 2**20:.2f} MiB"
    )
    for name, r in results.items():
        print_table(
            f"{name} (median ms; ratios: > 1 means q4 is faster)", ["measure", "value"], [[k, v] for k, v in r.items()]
        )
    record = {"machine": m_info, "read_bandwidth_gbs": bw, "weight_bytes": weight_bytes, "results": results}
    print(f"\nJSON: {write_json('matmul', record)}")
    return record


if __name__ == "__main__":
    main()
