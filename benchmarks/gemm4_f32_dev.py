"""Development benchmark (temporary) for the fp32-compute AVX-512 fused 4-bit
matmuls (kernels/cpu/x86/avx512/gemm4_tiled.cc): q4 with an fp32 input beside
dense fp32 with the dequantized weight in torch (F.linear) and in XLA
(jax.jit of a dot), one process, 4096 x 4096 NF4 blocksize 64 nested absmax.

    Q4_LIBRARY=build/<dir>/libq4.so PYTHONPATH=. .venv/bin/python benchmarks/gemm4_f32_dev.py [--threads 2]

Per batch: best-of-N wall time (ms) of each, interleaved so that all see the
same machine load; the ratios dense / q4 (> 1: q4 is faster); the relative
error of each against an fp64 product with the dequantized weight. Then the
same for the input gradient dX = dY . W (q4's op against torch.mm and XLA's
dot with the dense fp32 weight). q4jax (matmul_4bit under jit) is timed too.
"""

from __future__ import annotations

import argparse
import os
import time


def best_ms(fns, reps: int, burst: int = 3) -> list[float]:
    """Best wall time (ms) of each callable. The callables take turns in bursts
    (all see the same machine load); only the later calls of a burst count, so
    that another runtime's pool still spinning after its turn (Eigen's, OpenMP's)
    is not charged to the next one."""
    best = [float("inf")] * len(fns)
    for f in fns:
        f()
    for _ in range(reps):
        for i, f in enumerate(fns):
            for j in range(burst):
                t = time.perf_counter()
                f()
                if j > 0:
                    best[i] = min(best[i], time.perf_counter() - t)
    return [b * 1e3 for b in best]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=float, default=1.0, help="scale the repetition counts")
    ap.add_argument("--batches", type=int, nargs="*", default=[1, 8, 32, 128, 512])
    ap.add_argument("--isa", default=None, help="q4.set_cpu_isa level (default: the best)")
    args = ap.parse_args()
    os.environ.setdefault("XLA_FLAGS", f"--xla_cpu_multi_thread_eigen=true intra_op_parallelism_threads={args.threads}")

    import jax
    import jax.numpy as jnp
    import numpy as np
    import torch

    import q4
    import q4jax
    import q4torch.functional as F
    from q4torch._src import ops

    torch.set_num_threads(args.threads)
    q4.set_num_threads(args.threads)
    if args.isa:
        q4.set_cpu_isa(args.isa)
    n = k = 4096
    torch.manual_seed(0)
    w = torch.randn(n, k) * 0.02
    packed, state = F.quantize_4bit(w, blocksize=64, compress_statistics=True, quant_type="nf4")
    w32 = F.dequantize_4bit(packed, state).float().contiguous()  # exactly the kernels' fp32 W
    w64 = w32.double()
    wj = jax.device_put(jnp.asarray(w32.numpy()))
    dense_fwd = jax.jit(lambda x, w: jnp.dot(x, w.T, precision=jax.lax.Precision.HIGHEST))
    dense_grad = jax.jit(lambda g, w: jnp.dot(g, w, precision=jax.lax.Precision.HIGHEST))
    qj_packed, qj_state = q4jax.quantize_4bit(
        jnp.asarray(w.numpy()), blocksize=64, quant_type="nf4", compress_statistics=True
    )
    q4jax_fwd = jax.jit(lambda x: q4jax.matmul_4bit(x, qj_packed, qj_state))
    nested = state.nested

    def q4_grad(g):
        return ops.gemm_4bit_grad_input(
            g,
            packed.reshape(-1),
            state.absmax,
            state.state2.absmax if nested else None,
            state.offset if nested else None,
            n,
            k,
            64,
            "nf4",
        )

    def rel(got, want) -> float:
        got = torch.from_numpy(np.array(got, np.float64))
        return float((got - want).norm() / want.norm())

    print(f"q4 library: {q4.library_path()}  isa {q4.cpu_isa()}  threads {args.threads}")
    print(f"kernels: {q4.cpu_features()['kernels']}")
    head = (
        f"{'batch':>5} {'q4 ms':>8} {'q4jax':>8} {'torch':>8} {'xla':>8} {'torch/q4':>8} {'xla/q4':>7} "
        f"{'GF/s':>6} {'q4 err':>8} {'torch err':>9} {'xla err':>8}"
    )
    with torch.inference_mode():
        print("forward y = x . W^T (fp32 x)")
        print(head)
        for m in args.batches:
            x = torch.randn(m, k)
            xj = jax.device_put(jnp.asarray(x.numpy()))
            exact = x.double() @ w64.T
            reps = max(3, int(args.reps * 200 / m))
            y_q4, y_t, y_x, y_qj = F.matmul_4bit(x, packed, state), F_linear(x, w32), dense_fwd(xj, wj), q4jax_fwd(xj)
            t_q4, t_qj, t_t, t_x = best_ms(
                [
                    lambda x=x: F.matmul_4bit(x, packed, state),
                    lambda xj=xj: q4jax_fwd(xj).block_until_ready(),
                    lambda x=x: F_linear(x, w32),
                    lambda xj=xj: dense_fwd(xj, wj).block_until_ready(),
                ],
                reps,
            )
            print(
                f"{m:5d} {t_q4:8.3f} {t_qj:8.3f} {t_t:8.3f} {t_x:8.3f} {t_t / t_q4:8.2f} {t_x / t_q4:7.2f} "
                f"{2 * m * n * k / t_q4 / 1e6:6.0f} {rel(y_q4, exact):8.1e} {rel(y_t, exact):9.1e} "
                f"{rel(y_x, exact):8.1e}   (q4jax err {rel(y_qj, exact):.1e})",
                flush=True,
            )
        print("input gradient dX = dY . W (fp32 dY)")
        print(head.replace("q4jax", "  -  "))
        for m in args.batches:
            g = torch.randn(m, n)
            gj = jax.device_put(jnp.asarray(g.numpy()))
            exact = g.double() @ w64
            reps = max(3, int(args.reps * 200 / m))
            d_q4, d_t, d_x = q4_grad(g), torch.mm(g, w32), dense_grad(gj, wj)
            t_q4, t_t, t_x = best_ms(
                [
                    lambda g=g: q4_grad(g),
                    lambda g=g: torch.mm(g, w32),
                    lambda gj=gj: dense_grad(gj, wj).block_until_ready(),
                ],
                reps,
            )
            print(
                f"{m:5d} {t_q4:8.3f} {'-':>8} {t_t:8.3f} {t_x:8.3f} {t_t / t_q4:8.2f} {t_x / t_q4:7.2f} "
                f"{2 * m * n * k / t_q4 / 1e6:6.0f} {rel(d_q4, exact):8.1e} {rel(d_t, exact):9.1e} "
                f"{rel(d_x, exact):8.1e}",
                flush=True,
            )
    print(f"last kernels: {q4.cpu_features()['last_kernel']}")


def F_linear(x, w):
    import torch

    return torch.nn.functional.linear(x, w)


if __name__ == "__main__":
    main()
