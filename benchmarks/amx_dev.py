"""The amx level against the level below it, one process, 4096x4096: the bf16
forward and input gradient (amx.gemm4 / amx.grad4 against avx512_bf16) and
LLM.int8's forward (amx.int8_gemm against avx512_bf16's VNNI kernels), each
beside torch's dense bf16 matmul (oneDNN, on AMX where the CPU has it) or
torch._int_mm. Medians of interleaved repeats, ms; the kernel that ran is
printed beside each figure. A development tool for the AMX kernels
(kernels/NOTES.md, "The AMX kernels"), not part of `make bench`.

    PYTHONPATH=. Q4_LIBRARY=build/exp/libq4.so .venv/bin/python benchmarks/amx_dev.py \\
        [--ops fwd grad int8] [--batches 1 8 32 128 512] [--levels avx512_bf16 amx]
"""

from __future__ import annotations

import argparse
import time

import ml_dtypes
import numpy as np

import q4

N = K = 4096
BF16 = ml_dtypes.bfloat16


def median_ms(fns: dict, reps: int) -> dict:
    """Median ms of each callable, the callables interleaved rep by rep."""
    for f in fns.values():
        f()
        f()
    times: dict = {name: [] for name in fns}
    for _ in range(reps):
        for name, f in fns.items():
            t0 = time.perf_counter()
            f()
            times[name].append(time.perf_counter() - t0)
    return {name: float(np.median(t)) * 1e3 for name, t in times.items()}


def on_level(level: str, f, op: str):
    def run():
        q4.set_cpu_isa(level)
        f()

    def kernel():
        run()
        return q4.cpu_features()["last_kernel"][op]

    return run, kernel


def main() -> None:
    import torch

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ops", nargs="+", default=["fwd", "grad", "int8"], choices=["fwd", "grad", "int8"])
    parser.add_argument("--batches", nargs="+", type=int, default=[1, 8, 32, 128, 512])
    parser.add_argument("--levels", nargs="+", default=["avx512_bf16", "amx"])
    args = parser.parse_args()
    f = q4.cpu_features()
    print(f"q4 {q4.library_path()}: best level {f['best_isa']}, {q4.num_threads()} threads; features {f['features']}")
    order = ["scalar", "avx2", "avx512", "avx512_bf16", "amx"]
    levels = [lv for lv in args.levels if order.index(lv) <= order.index(f["best_isa"])]
    for lv in set(args.levels) - set(levels):
        print(f"not run: level {lv} (the processor's best is {f['best_isa']})")
    rng = np.random.default_rng(0)
    w = (rng.standard_normal((N, K)) * 0.02).astype(np.float32)
    packed, absmax = q4.quantize_4bit(w, 64, "nf4")
    state = q4.QuantState("nf4", 64, (N, K), "float32", absmax)
    wd = torch.from_numpy(q4.dequantize_4bit(packed, absmax, (N, K), 64, "nf4")).to(torch.bfloat16)
    w8 = rng.integers(-127, 128, (N, K)).astype(np.int8)
    scb = (rng.random(N).astype(np.float32) + 0.5).astype(np.float32)
    w8t = torch.from_numpy(w8).t()
    for op in args.ops:
        for m in args.batches:
            fns, kernels = {}, {}
            if op == "fwd":
                x = rng.standard_normal((m, K)).astype(np.float32).astype(BF16)
                xt = torch.from_numpy(x.view(np.uint16)).view(torch.bfloat16)
                for lv in levels:
                    fns[lv], k = on_level(lv, lambda x=x: q4.gemm_4bit(x, packed, state), "gemm_4bit")
                    kernels[lv] = k()
                fns["dense bf16"] = lambda xt=xt: torch.nn.functional.linear(xt, wd)
            elif op == "grad":
                g = rng.standard_normal((m, N)).astype(np.float32).astype(BF16)
                gt = torch.from_numpy(g.view(np.uint16)).view(torch.bfloat16)
                for lv in levels:
                    fns[lv], k = on_level(
                        lv, lambda g=g: q4.gemm_4bit_grad_input(g, packed, state), "gemm_4bit_grad_input"
                    )
                    kernels[lv] = k()
                fns["dense bf16"] = lambda gt=gt: gt @ wd
            else:
                x = rng.standard_normal((m, K)).astype(np.float32)
                for lv in levels:
                    fns[lv], k = on_level(lv, lambda x=x: q4.int8_linear(x, w8, scb), "int8_linear")
                    kernels[lv] = k()
                xq = torch.from_numpy(rng.integers(-127, 128, (max(m, 17), K)).astype(np.int8))
                fns["torch._int_mm"] = lambda xq=xq: torch._int_mm(xq, w8t)
            res = median_ms(fns, max(5, 256 // m))
            cells = [
                f"{name} {ms:.3f}" + (f" ({kernels[name]})" if name in kernels else "") for name, ms in res.items()
            ]
            print(f"{op:5s} batch {m:4d}: " + "  ".join(cells))
    q4.set_cpu_isa(f["best_isa"])


if __name__ == "__main__":
    main()
