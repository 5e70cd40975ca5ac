"""Quantize / dequantize of a 4096x4096 weight: q4 (raw kernel, PyTorch op,
JAX op) beside bitsandbytes 0.50.2 in one process, with the machine's copy
bandwidth as the floor.

    Q4_LIBRARY=build/<dir>/libq4.so PYTHONPATH=. .venv/bin/python benchmarks/run.py kernels

Columns: median ms over repeats. "raw kernel" calls the C ABI with
preallocated outputs; the PyTorch and JAX paths allocate their outputs as a
user's call does ("fresh" buffers: first-touch page faults included, see
DESIGN.md) and, where the API allows, also write into a reused output
("reused"). The bandwidth floor is bytes / copy bandwidth, where the copy
bandwidth counts bytes read + written per second (STREAM convention).
"""

from __future__ import annotations

import numpy as np
from common import median_ms, print_header, print_table, write_json

N = 4096


def copy_bandwidth_gbs(nbytes: int = 64 << 20) -> float:
    src = np.ones(nbytes // 4, np.float32)
    dst = np.empty_like(src)
    ms = median_ms(lambda: np.copyto(dst, src), repeat=20)
    return 2 * nbytes / (ms * 1e-3) / 1e9


def main() -> dict:
    import bitsandbytes.functional as bnbf
    import jax
    import jax.numpy as jnp
    import torch

    import q4jax
    import q4torch.functional as F
    from q4._src import kernels as K

    head = print_header("kernels: quantize / dequantize of a 4096x4096 weight")
    rng = np.random.default_rng(0)
    w = rng.standard_normal((N, N)).astype(np.float32)
    n = w.size
    wt, wj = torch.from_numpy(w), jnp.asarray(w)
    bw = copy_bandwidth_gbs()
    floor_read_ms = w.nbytes / (bw * 1e9) * 1e3
    floor_write_ms = {"float32": n * 4 / (bw * 1e9) * 1e3, "bfloat16": n * 2 / (bw * 1e9) * 1e3}

    packed = np.empty(n // 2, np.uint8)
    absmax = np.empty(n // 64, np.float32)
    results: dict[str, dict] = {}

    # quantize, NF4, block 64, fp32 input, plain absmax (bitsandbytes' default statistics)
    raw = median_ms(lambda: K.quantize_4bit_ptr(w.ctypes.data, 0, n, 64, 0, packed.ctypes.data, absmax.ctypes.data))
    qj = jax.jit(lambda x: q4jax.quantize_4bit(x, 64, "nf4"))
    results["quantize nf4 fp32"] = {
        "raw kernel": raw,
        "q4 PyTorch": median_ms(lambda: F.quantize_4bit(wt, blocksize=64, quant_type="nf4")),
        "q4 JAX (jit)": median_ms(lambda: jax.block_until_ready(qj(wj))),
        "bitsandbytes": median_ms(lambda: bnbf.quantize_4bit(wt, blocksize=64, quant_type="nf4"), repeat=3),
        "floor": floor_read_ms,
    }

    pt, st = F.quantize_4bit(wt, blocksize=64, quant_type="nf4")
    pj, sj = q4jax.quantize_4bit(wj, 64, "nf4")
    bp, bst = bnbf.quantize_4bit(wt, blocksize=64, quant_type="nf4")
    for dtype, tdt, code in (("float32", torch.float32, 0), ("bfloat16", torch.bfloat16, 2)):
        out = torch.empty((N, N), dtype=tdt)
        st.dtype = bst.dtype = tdt
        sj_d = q4jax.QuantState(sj.absmax, None, None, "nf4", 64, (N, N), dtype)
        dj = jax.jit(q4jax.dequantize_4bit)
        raw = median_ms(
            lambda out=out, code=code: K.dequantize_4bit_ptr(
                packed.ctypes.data, absmax.ctypes.data, n, 64, 0, out.data_ptr(), code
            )
        )
        results[f"dequantize nf4 -> {dtype}"] = {
            "raw kernel": raw,
            "q4 PyTorch": median_ms(lambda: F.dequantize_4bit(pt, st)),
            "q4 PyTorch (reused out)": median_ms(lambda out=out: F.dequantize_4bit(pt, st, out=out)),
            "q4 JAX (jit)": median_ms(lambda dj=dj, sj_d=sj_d: jax.block_until_ready(dj(pj, sj_d))),
            "bitsandbytes": median_ms(lambda: bnbf.dequantize_4bit(bp, bst), repeat=5),
            "floor": floor_write_ms[dtype],
        }

    header = [
        "op (4096x4096)",
        "raw kernel",
        "q4 PyTorch",
        "q4 PyTorch (reused out)",
        "q4 JAX (jit)",
        "bitsandbytes",
        "floor",
        "bnb / q4 PyTorch",
        "raw / floor",
        "PyTorch / raw",
        "JAX / raw",
    ]
    rows = []
    for op, r in results.items():
        r["bnb / q4 PyTorch"] = r["bitsandbytes"] / r["q4 PyTorch"]
        r["raw / floor"] = r["raw kernel"] / r["floor"]
        r["PyTorch / raw"] = r.get("q4 PyTorch (reused out)", r["q4 PyTorch"]) / r["raw kernel"]
        r["JAX / raw"] = r["q4 JAX (jit)"] / r["raw kernel"]
        rows.append([op] + [r.get(h, "-") for h in header[1:]])
    print(f"copy bandwidth {bw:.1f} GB/s (read + write, numpy copy of 64 MiB)")
    print_table("median ms (lower is better); ratios > 1 mean the first is slower", header, rows)
    record = {**head, "copy_bandwidth_gbs": bw, "results": results}
    path = write_json("kernels", record)
    print(f"\nJSON: {path}")
    return record


if __name__ == "__main__":
    main()
