"""fp64 references for the fused matmuls, and the error baseline they are
judged against: the same product computed by dequantizing the weight to the
input dtype and running a dense matmul in that dtype (what a user would do
without fused kernels)."""

from __future__ import annotations

import numpy as np


def rel_err(got, want) -> float:
    got = np.asarray(got, np.float64)
    want = np.asarray(want, np.float64)
    return float(np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-300))


def dense_baseline(a32: np.ndarray, b32: np.ndarray, dtype: str) -> np.ndarray:
    """a @ b computed densely in `dtype` (torch CPU matmul), returned as fp64.
    (torch is imported here, not by the module: JAX-only runs use the rest.)"""
    import torch

    dt = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}[dtype]
    a = torch.from_numpy(np.array(a32, np.float32)).to(dt)
    b = torch.from_numpy(np.array(b32, np.float32)).to(dt)
    return (a @ b).double().numpy()


def check_against_baseline(got, a32, b32, dtype: str, slack: float = 1.5, what: str = "") -> None:
    """Relative error of `got` vs the fp64 product no larger than `slack` x that
    of the dense baseline in the same dtype (plus one fp32 ulp of headroom)."""
    want = a32.astype(np.float64) @ b32.astype(np.float64)
    base = rel_err(dense_baseline(a32, b32, dtype), want)
    err = rel_err(got, want)
    assert err <= slack * base + 2 * np.finfo(np.float32).eps, f"{what}: error {err:.3e} vs dense {dtype} {base:.3e}"


def quantized_weight(rng, n: int, k: int, blocksize: int, quant_type: str, nested: bool, scale: float = 1.0):
    """A random weight [n, k] quantized by q4: (packed, q4.QuantState, W as fp32
    decoded by the oracle's arithmetic from the packed bytes and scales)."""
    import q4
    from q4_reference import oracle

    w = (rng.standard_normal((n, k)) * scale).astype(np.float32)
    packed, absmax = q4.quantize_4bit(w, blocksize, quant_type)
    if nested:
        codes, absmax2, offset = q4.quantize_nested(absmax)
        state = q4.QuantState(quant_type, blocksize, (n, k), "float32", codes, absmax2, offset)
        # the format's code book (a constant), decoded by the oracle's arithmetic
        absmax = oracle.dequantize_blockwise(codes, absmax2, 256, code=q4.code_table("dynamic"), offset=offset)
    else:
        state = q4.QuantState(quant_type, blocksize, (n, k), "float32", absmax)
    w32 = oracle.dequantize_4bit(packed.reshape(-1), absmax, n * k, blocksize, quant_type).reshape(n, k)
    return packed, state, w32


# unit roundoff of each output dtype (fp32 outputs are the accumulator itself)
UNIT_ROUNDOFF = {"float32": 0.0, "bfloat16": 2.0**-8, "float16": 2.0**-11}


def check_accumulation_bound(got, a64, b64, length, out_dtype, bias=None, tiny=2.0**-149, what="", extra=0.0):
    """got ~ a64 @ b64 (+ bias) within the fp32 accumulation bound
    (length + 2) * (2^-24 * |a| @ |b| + tiny) + extra, plus the output dtype's
    rounding of the result; `tiny` is the smallest magnitude the kernel keeps
    (2^-149 for IEEE fp32, 2^-126 where the hardware flushes denormals), `extra`
    (broadcast to the output) what a kernel's contract adds to that bound."""
    import pytest

    with np.errstate(invalid="ignore", over="ignore"):
        ref = a64 @ b64
        mags = np.abs(a64) @ np.abs(b64)
    if bias is not None:
        bias64 = np.asarray(bias).astype(np.float64)
        ref = ref + bias64
        mags = mags + np.abs(bias64)
    acc_bound = (length + 2) * (2.0**-24 * mags + tiny) + extra
    bound = acc_bound + UNIT_ROUNDOFF[out_dtype] * (np.abs(ref) + acc_bound)
    got64 = np.asarray(got).astype(np.float64)
    assert got64.shape == ref.shape, what
    err = np.abs(got64 - ref)
    bad = ~(err <= bound)
    if bad.any():
        i = np.argwhere(bad)[0]
        pytest.fail(
            f"{what}: {int(bad.sum())} of {bad.size} outside the bound; at {tuple(i)} got {got64[tuple(i)]!r} "
            f"want {ref[tuple(i)]!r} (bound {bound[tuple(i)]:.3e})"
        )
