"""Development benchmark (temporary) for the bf16-compute fused 4-bit matmul
(kernels/cpu/x86/avx512_bf16/gemm4.cc): q4torch beside bitsandbytes 0.50.2's
Linear4bit at its best CPU path (eval + torch.inference_mode, bf16 input),
one process, 4096 x 4096 NF4 blocksize 64 nested absmax.

    Q4_LIBRARY=build/<dir>/libq4.so PYTHONPATH=. .venv/bin/python benchmarks/gemm4_bf16_dev.py [--threads 2]

Prints per batch the best-of-N wall time of each (the two are interleaved, so
both see the same machine load), the ratio bitsandbytes / q4 (> 1: q4 is
faster), the relative error of each against an fp64 product of the bf16 input
with the dequantized weight, and q4's input gradient time. Batch 1 is also
timed with layers cycled (weights streamed from DRAM instead of L3; as many
as common.dram_layers says: 16 on a 32 MiB L3).

On a loaded machine, PyTorch's OpenMP workers sleep between ops and a woken
worker can wait for a scheduler tick (~4-8 ms per call, seen here with the
8-layer loop); --omp-active sets OMP_WAIT_POLICY=active (both libraries run
on PyTorch's OpenMP team), which keeps them spinning.
"""

from __future__ import annotations

import argparse
import os
import time
import warnings

from common import dram_layers, nested_4bit_bytes

N = K = 4096
BATCHES = (1, 8, 32, 128, 512)


def best_ms(fns, reps: int) -> list[float]:
    """Best wall time (ms) of each callable, the callables interleaved."""
    best = [float("inf")] * len(fns)
    for f in fns:
        f()
    for _ in range(reps):
        for i, f in enumerate(fns):
            t = time.perf_counter()
            f()
            best[i] = min(best[i], time.perf_counter() - t)
    return [b * 1e3 for b in best]


def rel_err(got, want) -> float:
    return float((got.double() - want).norm() / want.norm())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=float, default=1.0, help="scale the repetition counts")
    ap.add_argument("--batches", type=int, nargs="*", default=list(BATCHES))
    ap.add_argument("--omp-active", action="store_true", help="OMP_WAIT_POLICY=active (must precede torch's init)")
    args = ap.parse_args()
    if args.omp_active:
        os.environ["OMP_WAIT_POLICY"] = "active"
    import torch

    torch.set_num_threads(args.threads)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import bitsandbytes as bnb

    import q4
    import q4torch
    import q4torch.functional as F

    torch.manual_seed(0)
    w = torch.randn(N, K) * 0.02

    def q4_layer(weight):
        layer = q4torch.nn.Linear4bit(K, N, bias=False, compress_statistics=True, quant_type="nf4")
        layer.weight = q4torch.nn.Params4bit(
            weight.clone(), requires_grad=False, compress_statistics=True, quant_type="nf4", blocksize=64
        )
        return layer.to("cpu").eval()

    def bnb_layer(weight):
        layer = bnb.nn.Linear4bit(
            K, N, bias=False, compute_dtype=torch.bfloat16, compress_statistics=True, quant_type="nf4"
        )
        layer.weight = bnb.nn.Params4bit(
            weight.clone(), requires_grad=False, compress_statistics=True, quant_type="nf4", blocksize=64
        )
        return layer.to("cpu").eval()

    ours, theirs = q4_layer(w), bnb_layer(w)
    packed, state = ours.packed_weight()
    w_deq = F.dequantize_4bit(packed, state).double()  # fp32 decode of the packed weight, exact in fp64

    print(f"q4 library: {q4.library_path()}  isa {q4.cpu_isa()}  torch threads {torch.get_num_threads()}")
    print(f"{'batch':>5} {'q4 ms':>8} {'bnb ms':>8} {'bnb/q4':>7} {'q4 err':>9} {'bnb err':>9} {'q4 grad ms':>10}")
    with torch.inference_mode():
        for m in args.batches:
            x = torch.randn(m, K).to(torch.bfloat16)
            exact = x.double() @ w_deq.T
            reps = max(5, int(args.reps * 400 / m))
            y_q4, y_bnb = ours(x), theirs(x)
            t_q4, t_bnb = best_ms([lambda x=x: ours(x), lambda x=x: theirs(x)], reps)
            g = torch.randn(m, N).to(torch.bfloat16)
            (t_grad,) = best_ms([lambda g=g: q4torch_grad(g, packed, state)], reps)
            print(
                f"{m:5d} {t_q4:8.3f} {t_bnb:8.3f} {t_bnb / t_q4:7.2f} {rel_err(y_q4, exact):9.2e} "
                f"{rel_err(y_bnb, exact):9.2e} {t_grad:10.3f}",
                flush=True,
            )
        # batch 1 with the weights streamed from DRAM: layers together >= 4x the L3, cycled
        n_layers = dram_layers(nested_4bit_bytes(N, K, 64), 12 * nested_4bit_bytes(N, K, 64))
        ws = [torch.randn(N, K) * 0.02 for _ in range(n_layers)]
        ours8, theirs8 = [q4_layer(v) for v in ws], [bnb_layer(v) for v in ws]
        x = torch.randn(1, K).to(torch.bfloat16)
        for layer in theirs8:
            layer(x)  # bitsandbytes repacks on the first eval forward
        deadline = time.perf_counter() + 2.0  # first touches of the weights (pages) out of the timing
        while time.perf_counter() < deadline:
            for a, b in zip(ours8, theirs8, strict=True):
                a(x)
                b(x)
        t_q4, t_bnb = best_ms(
            [lambda: [layer(x) for layer in ours8], lambda: [layer(x) for layer in theirs8]],
            max(5, int(args.reps * 50)),
        )
        print(
            f"batch 1, {n_layers} layers cycled from DRAM (ms per layer): q4 {t_q4 / n_layers:.3f}  "
            f"bnb {t_bnb / n_layers:.3f}  "
            f"bnb/q4 {t_bnb / t_q4:.2f}"
        )


def q4torch_grad(g, packed, state):
    """dX = g . W through the q4torch op (what matmul_4bit's backward calls)."""
    from q4torch._src import ops

    nested = state.nested
    n, k = (int(s) for s in state.shape)
    return ops.gemm_4bit_grad_input(
        g,
        packed.reshape(-1),
        state.absmax,
        state.state2.absmax if nested else None,
        state.offset if nested else None,
        n,
        k,
        int(state.blocksize),
        state.quant_type,
    )


if __name__ == "__main__":
    main()
