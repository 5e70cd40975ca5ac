"""Small-model layer shapes: the linear layers of a MiniLM-sized encoder
(384 -> 384, 384 -> 1536, 1536 -> 384) at 64, 256 and 1024 rows (a batch of
sentences times their tokens), bf16 and fp32, q4 beside torch's dense matmul
on the dequantized weight in the same dtype (oneDNN; on AMX CPUs its bf16
GEMM runs on the tile unit). One process, interleaved medians, ms.

    Q4_LIBRARY=build/<dir>/libq4.so PYTHONPATH=. .venv/bin/python benchmarks/run.py shapes

Forward: q4torch.functional.matmul_4bit(x, W) against F.linear(x, W_dense).
Input gradient: what the backward runs, q4torch's gemm_4bit_grad_input (the
op's body, called directly as the eager backward calls it) on dY and W,
against dY @ W_dense. Step: a training step's share of the layer as a user
runs it -- x requiring grad, y = matmul_4bit(x, W), y.backward(dY), autograd
included -- against F.linear(x, W_dense) with the same backward. NF4, block
64, nested absmax. Printed beside each row: the q4 kernel that ran
(q4.cpu_features()["last_kernel"]) and q4 / dense as a speed ratio (> 1: q4
is faster).
"""

from __future__ import annotations

import numpy as np
from common import interleaved, print_header, print_table, write_json

SHAPES = [(384, 384), (384, 1536), (1536, 384)]  # (k in, n out)
ROWS = [64, 256, 1024]


def main() -> dict:
    import torch
    import torch.nn.functional as tF

    import q4
    import q4torch
    import q4torch.functional as F
    from q4torch.functional import _weight_operands, ops

    record = print_header("small-model layer shapes: q4torch against torch dense, bf16 and fp32")
    torch.manual_seed(0)
    rows_out = []
    results = []
    for dtype_name, dtype in (("bf16", torch.bfloat16), ("fp32", torch.float32)):
        for k, n in SHAPES:
            w = torch.randn(n, k) * 0.02
            packed, state = F.quantize_4bit(w, blocksize=64, quant_type="nf4", compress_statistics=True)
            wd = F.dequantize_4bit(packed, state).to(dtype)
            operands = _weight_operands(packed, state)
            for m in ROWS:
                x = torch.randn(m, k).to(dtype)
                g = torch.randn(m, n).to(dtype)
                kernels = {}

                def q4_fwd(x=x, packed=packed, state=state):
                    return q4torch.matmul_4bit(x, packed, state)

                def q4_grad(g=g, operands=operands):
                    return ops.gemm_4bit_grad_input_call(g, *operands)

                xg = x.clone().requires_grad_(True)

                def q4_step(xg=xg, g=g, packed=packed, state=state):
                    xg.grad = None
                    q4torch.matmul_4bit(xg, packed, state).backward(g)

                def dense_step(xg=xg, g=g, wd=wd):
                    xg.grad = None
                    tF.linear(xg, wd).backward(g)

                q4_fwd()
                kernels["fwd"] = q4.cpu_features()["last_kernel"]["gemm_4bit"]
                q4_grad()
                kernels["grad"] = q4.cpu_features()["last_kernel"]["gemm_4bit_grad_input"]
                t = interleaved(
                    {
                        "q4 fwd": q4_fwd,
                        "dense fwd": lambda x=x, wd=wd: tF.linear(x, wd),
                        "q4 grad": q4_grad,
                        "dense grad": lambda g=g, wd=wd: g @ wd,
                        "q4 step": q4_step,
                        "dense step": dense_step,
                    }
                )
                ms = {name: r["median_ms"] for name, r in t.items()}
                fr, gr = ms["dense fwd"] / ms["q4 fwd"], ms["dense grad"] / ms["q4 grad"]
                sr = ms["dense step"] / ms["q4 step"]
                rows_out.append(
                    [
                        dtype_name,
                        f"{k}->{n}",
                        m,
                        ms["q4 fwd"],
                        ms["dense fwd"],
                        fr,
                        kernels["fwd"],
                        ms["q4 grad"],
                        ms["dense grad"],
                        gr,
                        kernels["grad"],
                        ms["q4 step"],
                        ms["dense step"],
                        sr,
                    ]
                )
                results.append(
                    {
                        "dtype": dtype_name,
                        "k": k,
                        "n": n,
                        "m": m,
                        "ms": ms,
                        "kernels": kernels,
                        "fwd_x": fr,
                        "grad_x": gr,
                        "step_x": sr,
                    }
                )
    print_table(
        "ms, medians of interleaved rounds; x = dense / q4 (> 1: q4 faster)",
        [
            "dtype",
            "layer",
            "rows",
            "q4 fwd",
            "dense fwd",
            "x",
            "q4 kernel",
            "q4 grad",
            "dense grad",
            "x",
            "q4 kernel",
            "q4 step",
            "dense step",
            "x",
        ],
        rows_out,
    )
    geo = {
        d: float(np.exp(np.mean([np.log(r[f"{p}_x"]) for r in results if r["dtype"] == d for p in ("fwd", "grad")])))
        for d in ("bf16", "fp32")
    }
    step = {
        d: float(np.exp(np.mean([np.log(r["step_x"]) for r in results if r["dtype"] == d]))) for d in ("bf16", "fp32")
    }
    print(
        f"\ngeometric mean of the ratios (forward and gradient): bf16 {geo['bf16']:.2f}x, fp32 {geo['fp32']:.2f}x dense"
    )
    print(f"geometric mean of the step ratios: bf16 {step['bf16']:.2f}x, fp32 {step['fp32']:.2f}x dense")
    record.update({"results": results, "geomean_x": geo, "step_geomean_x": step})
    path = write_json("shapes", record)
    print(f"wrote {path}")
    return record


if __name__ == "__main__":
    main()
