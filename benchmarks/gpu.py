"""GPU benchmark of the CUDA kernels (run by scripts/gpu_check.sh on a lent GPU).

    Q4_LIBRARY=build/gpu-sm90/libq4.so PYTHONPATH=. python3 benchmarks/gpu.py --out gpu_bench.json

Measured in the same run: the device memory bandwidth (a large
device-to-device copy, bytes read + written) and cuBLAS dense bf16 matmul.
Then, NF4 blocksize 64 with nested absmax, CUDA events, medians:
- dequantize (4096^2 and 16384^2 -> fp32) against the bandwidth: bytes =
  packed + scales read + output written;
- the fused matmul at batch 1 (16384^2 weight: bytes = packed weight + scales,
  the gemv's floor), 32 and 512 (4096^2 and 16384^2) against cuBLAS dense bf16
  with the dequantized weight;
- bitsandbytes' CUDA kernels beside each, where `import bitsandbytes` works.
Every result is checked first: CUDA dequantize bytes equal the CPU kernel's,
the fused matmul within 3x the error of a dense bf16 product with the same
weight (both against an fp64 product). Prints a table; writes JSON to --out.

`--device cpu --small` runs the same code on the CPU with small sizes (a
check of this script where there is no GPU; the timings mean nothing).
"""

# ruff: noqa: B023 (every lambda is timed before its loop variables change)
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="gpu_bench.json")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--small", action="store_true", help="small sizes (a check of the script, e.g. on the CPU)")
    args = ap.parse_args(argv)

    import torch

    import q4
    import q4torch.functional as F

    dev = torch.device(args.device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        print("gpu.py: no GPU: torch.cuda.is_available() is False", file=sys.stderr)
        return 2
    if dev.type == "cuda" and not (q4.has_cuda() and q4.cuda_device_count() > 0):
        print(f"gpu.py: no GPU for q4: {q4.library_path()} has_cuda={q4.has_cuda()}", file=sys.stderr)
        return 2
    try:
        import bitsandbytes as bnb
        import bitsandbytes.functional as bnbF
    except Exception as e:  # optional peer
        bnb, bnbF = None, None
        print(f"bitsandbytes not available ({type(e).__name__}: {e}); q4 alone")

    def sync():
        if dev.type == "cuda":
            torch.cuda.synchronize()

    def median_ms(fn, reps: int = 20) -> float:
        for _ in range(3):
            fn()
        sync()
        times = []
        for _ in range(reps):
            if dev.type == "cuda":
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                fn()
                b.record()
                b.synchronize()
                times.append(a.elapsed_time(b))
            else:
                t = time.perf_counter()
                fn()
                times.append((time.perf_counter() - t) * 1e3)
        return statistics.median(times)

    record: dict = {"device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu", "results": {}}
    res = record["results"]
    print(f"device: {record['device']}; torch {torch.__version__}; q4 library {q4.library_path()}")

    # device memory bandwidth: a copy, bytes read + written
    nbytes = (64 << 20) if args.small else (4 << 30)
    src = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)
    copy_ms = median_ms(lambda: dst.copy_(src), reps=10)
    bw = 2 * nbytes / copy_ms / 1e6  # GB/s
    res["copy_GBps"] = bw
    src = dst = torch.empty(0)  # free the buffers
    # dense bf16 matmul rate
    s = 1024 if args.small else 8192
    a = torch.randn(s, s, device=dev, dtype=torch.bfloat16)
    b = torch.randn(s, s, device=dev, dtype=torch.bfloat16)
    mm_ms = median_ms(lambda: a @ b, reps=10)
    res["dense_bf16_TFLOPs"] = 2 * s**3 / mm_ms / 1e9
    a = b = torch.empty(0)
    print(f"measured now: copy {bw:.0f} GB/s, dense bf16 {res['dense_bf16_TFLOPs']:.0f} TFLOP/s")

    rows = []

    def rel(got, want) -> float:
        return float((got.double() - want).norm() / want.norm())

    sizes = (512, 1024) if args.small else (4096, 16384)
    for n in sizes:
        k = n
        torch.manual_seed(0)
        w = torch.randn(n, k, device=dev) * 0.02
        packed, state = F.quantize_4bit(w, blocksize=64, quant_type="nf4", compress_statistics=True)
        # correctness first: CUDA bytes = CPU kernel bytes
        packed_cpu, state_cpu = F.quantize_4bit(w.cpu(), blocksize=64, quant_type="nf4", compress_statistics=True)
        assert torch.equal(packed.cpu(), packed_cpu), "CUDA quantize_4bit bytes differ from the CPU kernel's"
        wd = F.dequantize_4bit(packed, state).to(torch.bfloat16)
        wd_cpu = F.dequantize_4bit(packed_cpu, state_cpu)
        assert torch.equal(F.dequantize_4bit(packed, state).cpu(), wd_cpu), "CUDA dequantize differs from the CPU"
        scale_bytes = state.absmax.numel() * state.absmax.element_size() + (
            state.state2.absmax.numel() * 4 if state.nested else 0
        )
        deq_ms = median_ms(lambda: F.dequantize_4bit(packed, state))
        deq_bytes = packed.numel() + scale_bytes + n * k * 4
        row = {
            "op": f"dequantize {n}x{k} -> fp32",
            "q4 ms": deq_ms,
            "q4 % of copy bw": 100 * deq_bytes / deq_ms / 1e6 / bw,
        }
        if bnbF is not None:
            bp, bs = bnbF.quantize_4bit(w, blocksize=64, quant_type="nf4", compress_statistics=True)
            row["bnb ms"] = median_ms(lambda: bnbF.dequantize_4bit(bp, bs))
        rows.append(row)
        wt = wd.t().contiguous()
        for m in (1, 32, 512):
            if m == 1 and n != sizes[-1]:
                continue
            x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
            y = F.matmul_4bit(x, packed.t(), state)
            ref = x.double() @ wd_cpu.to(dev).double().t()
            dense = x @ wt
            err, err_dense = rel(y, ref), rel(dense, ref)
            assert err <= 3 * err_dense + 1e-6, f"fused matmul error {err:.2e} vs dense bf16 {err_dense:.2e}"
            q_ms = median_ms(lambda: F.matmul_4bit(x, packed.t(), state))
            d_ms = median_ms(lambda: x @ wt)
            row = {
                "op": f"matmul {m}x{k} @ {n}x{k} NF4, bf16",
                "q4 ms": q_ms,
                "dense bf16 ms": d_ms,
                "dense / q4": d_ms / q_ms,
                "q4 err": err,
                "dense err": err_dense,
            }
            if m == 1:
                row["q4 % of copy bw"] = 100 * (packed.numel() + scale_bytes) / q_ms / 1e6 / bw
            if bnb is not None:
                bp, bs = bnbF.quantize_4bit(w, blocksize=64, quant_type="nf4", compress_statistics=True)
                fn = (
                    (lambda: bnbF.gemv_4bit(x, bp.t(), state=bs))
                    if m == 1
                    else (lambda: bnb.matmul_4bit(x, bp.t(), bs))
                )
                row["bnb ms"] = median_ms(fn)
                row["bnb / q4"] = row["bnb ms"] / q_ms
            rows.append(row)
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    res["rows"] = rows
    keys = []
    for r in rows:
        keys += [k for k in r if k not in keys]
    print("\n" + " | ".join(keys))
    for r in rows:
        print(" | ".join(f"{r[k]:.4g}" if isinstance(r.get(k), float) else str(r.get(k, "")) for k in keys))
    with open(args.out, "w") as f:
        json.dump(record, f, indent=1)
    print(f"\nJSON: {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
