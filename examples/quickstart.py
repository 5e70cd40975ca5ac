"""Quantize one weight in PyTorch and in JAX with q4 and show that both give
the same bytes (and the same bytes as bitsandbytes), the error against fp32,
and how long each step takes.

    make demo        # or: .venv/bin/python examples/quickstart.py
"""

from __future__ import annotations

import time

import numpy as np


def median_ms(fn, repeat: int = 7) -> float:
    fn()  # warm up (compilation, first-touch of buffers)
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1e3 * float(np.median(times))


def main() -> None:
    import jax
    import jax.numpy as jnp
    import torch

    import q4
    import q4jax
    import q4torch.functional as F

    rng = np.random.default_rng(0)
    w = (rng.standard_normal((4096, 4096)) * 0.02).astype(np.float32)
    print(f"q4 {q4.__version__}: kernels {q4.library_path().name}, CPU path {q4.cpu_isa()}, {q4.num_threads()} threads")
    print(f"weight: {w.shape} float32, {w.nbytes / 2**20:.0f} MiB; NF4, block 64, nested absmax\n")

    wt, wj = torch.from_numpy(w), jnp.asarray(w)
    packed_t, state_t = F.quantize_4bit(wt, blocksize=64, quant_type="nf4", compress_statistics=True)
    packed_j, state_j = q4jax.quantize_4bit(wj, blocksize=64, quant_type="nf4", compress_statistics=True)
    same = np.array_equal(packed_t.numpy(), np.asarray(packed_j)) and np.array_equal(
        state_t.absmax.numpy(), np.asarray(state_j.absmax)
    )
    print(f"PyTorch and JAX packed bytes + nested absmax identical: {same}")
    try:
        import bitsandbytes.functional as bnbf

        bp, _ = bnbf.quantize_4bit(wt, blocksize=64, quant_type="nf4", compress_statistics=True)
        print(f"identical to bitsandbytes' packed bytes:               {torch.equal(bp, packed_t)}")
    except ImportError:
        print("(bitsandbytes not installed: skipping the comparison with it)")

    deq_t = F.dequantize_4bit(packed_t, state_t)
    deq_j = q4jax.dequantize_4bit(packed_j, state_j)
    err = deq_t.numpy() - w
    print(f"dequantized values identical across frameworks:        {np.array_equal(deq_t.numpy(), np.asarray(deq_j))}")
    print(
        f"error vs fp32: max |e| {np.abs(err).max():.5f}, relative Frobenius {np.linalg.norm(err) / np.linalg.norm(w):.4f}"
    )
    packed_mb = (packed_t.numel() + state_t.absmax.numel() + 4 * state_t.state2.absmax.numel()) / 2**20
    print(
        f"size: {w.nbytes / 2**20:.1f} MiB fp32 -> {packed_mb:.2f} MiB ({8 * packed_mb * 2**20 / w.size:.3f} bits/weight)\n"
    )

    qj = jax.jit(lambda x: q4jax.quantize_4bit(x, 64, "nf4", True))
    dj = jax.jit(q4jax.dequantize_4bit)
    rows = [
        (
            "quantize (PyTorch)",
            median_ms(lambda: F.quantize_4bit(wt, blocksize=64, quant_type="nf4", compress_statistics=True)),
        ),
        ("quantize (JAX, jit)", median_ms(lambda: jax.block_until_ready(qj(wj)))),
        ("dequantize (PyTorch)", median_ms(lambda: F.dequantize_4bit(packed_t, state_t))),
        ("dequantize (JAX, jit)", median_ms(lambda: jax.block_until_ready(dj(packed_j, state_j)))),
    ]
    print(f"{'step':<24}{'median ms':>10}")
    for name, ms in rows:
        print(f"{name:<24}{ms:>10.2f}")
    print("\n(benchmarks/kernels.py compares with bitsandbytes and the memory bandwidth floor)")


if __name__ == "__main__":
    main()
