"""Independent numpy oracle of the blockwise 8-bit optimizer update.

Written from the semantics of bitsandbytes 0.50.2's CPU optimizer step (one
8-bit step = dequantize both states, an fp32 update, write the parameter,
re-quantize the states), not from q4's kernels. Each line below is one fp32
operation of that step, in the same order, rounded the same way:

- scalar hyperparameters are Python floats (fp64); each derived constant is
  computed in fp64 and rounded once to fp32 where a tensor op consumes it
  (`fp32(1 - beta1)`, `fp32(-lr / correction1)`, ...);
- `a.add_(b, alpha=c)` is one fused multiply-add `fma(b, c, a)` and
  `a.addcmul_(b, b, value=c)` is `fma(fp32(c * b), b, a)` (PyTorch's vectorised
  CPU kernels contract these; `addcdiv` is `a + fp32(c * b) / d`, uncontracted);
- `sqrt` is the correctly rounded fp32 square root. (PyTorch's CPU `sqrt` on
  x86 goes through MKL VML, which is not always correctly rounded: there the
  parameter bytes of Adam and RMSprop can differ from bitsandbytes' in the last
  place, while the state bytes, which never see a square root, cannot.)

The fused multiply-add is emulated as fp64 `a * b + c` rounded once to fp32
(the product is exact in fp64; the sum rounds twice, which differs from a true
fma only when the fp64 sum sits exactly on an fp32 rounding boundary).
"""

from __future__ import annotations

import math

import numpy as np

from .oracle import dequantize_blockwise, dynamic_map, quantize_blockwise

F32 = np.float32
BLOCKSIZE = 256
OPTIMIZERS = ("adam", "momentum", "lion", "rmsprop")
TWO_STATE = ("adam",)


def unsigned_dynamic_map() -> np.ndarray:
    """Unsigned 8-bit dynamic map: for i = 0..6, the 2^(i+1) means of
    linspace(0.1, 1, 2^(i+1) + 1) scaled by 10^(i-6); plus 0 and 1; sorted. As
    with dynamic_map, exact arithmetic here agrees with the format's fp32 table
    to within 2 ulp; the library's table is compared with bitsandbytes' bit for
    bit separately."""
    data = []
    for i in range(7):
        bounds = np.linspace(0.1, 1, 2 ** (i + 1) + 1, dtype=np.float64).astype(F32)
        means = ((bounds[:-1] + bounds[1:]) / F32(2)).astype(np.float64)
        data += list(10.0 ** (-6 + i) * means)
    data += [0.0, 1.0]
    return np.array(sorted(data), F32)


def fma(a, b, c) -> np.ndarray:
    """fp32 fused multiply-add (see the module docstring for the emulation)."""
    with np.errstate(invalid="ignore", over="ignore"):
        return (np.asarray(a, F32).astype(np.float64) * np.asarray(b, F32) + np.asarray(c, F32)).astype(F32)


def constants(name: str, step: int, lr: float, beta1: float, beta2: float, eps: float, weight_decay: float) -> dict:
    """The fp32 constants of one step, each computed in fp64 and rounded once."""
    c = {
        "beta1": F32(beta1),
        "one_minus_beta1": F32(1.0 - beta1),
        "beta2": F32(beta2),
        "one_minus_beta2": F32(1.0 - beta2),
        "eps": F32(eps),
        "neg_lr": F32(-lr),
        "weight_decay": F32(weight_decay),
        "decay": F32(1.0 - lr * weight_decay) if weight_decay > 0.0 else None,
    }
    if name == "adam":
        correction1 = 1.0 - beta1**step
        correction2 = math.sqrt(1.0 - beta2**step)
        c["correction2"] = F32(correction2)
        c["step_size"] = F32(-lr / correction1)
    return c


def update(
    name: str,
    grad: np.ndarray,
    param: np.ndarray,
    state1: np.ndarray,
    absmax1: np.ndarray,
    state2: np.ndarray | None = None,
    absmax2: np.ndarray | None = None,
    *,
    step: int,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float = 1e-8,
    weight_decay: float = 0.0,
    gnorm_scale: float = 1.0,
    qmap1: np.ndarray | None = None,
    qmap2: np.ndarray | None = None,
    sqrt=np.sqrt,
):
    """One step. grad / param: fp32 arrays (bf16 widens exactly); states: uint8
    codes; absmax: fp32 per block of 256. Returns (param fp32, state1, absmax1,
    state2, absmax2) with the parameter before rounding to its storage dtype.
    `sqrt` replaces the fp32 square root (a test substitutes PyTorch's)."""
    if name not in OPTIMIZERS:
        raise ValueError(f"optimizer must be one of {OPTIMIZERS}, got {name!r}")
    qmap1 = dynamic_map() if qmap1 is None else np.asarray(qmap1, F32)
    qmap2 = unsigned_dynamic_map() if qmap2 is None else np.asarray(qmap2, F32)
    k = constants(name, step, lr, beta1, beta2, eps, weight_decay)
    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
        g = (np.asarray(grad, F32).reshape(-1) * F32(gnorm_scale)).astype(F32)
        p = np.asarray(param, F32).reshape(-1).copy()
        m = dequantize_blockwise(state1, absmax1, BLOCKSIZE, qmap1)
        v = dequantize_blockwise(state2, absmax2, BLOCKSIZE, qmap2) if name in TWO_STATE else None
        if name == "adam":
            m = fma(g, k["one_minus_beta1"], (m * k["beta1"]).astype(F32))
            v = fma((k["one_minus_beta2"] * g).astype(F32), g, (v * k["beta2"]).astype(F32))
            denom = ((sqrt(v) / k["correction2"]).astype(F32) + k["eps"]).astype(F32)
            if k["decay"] is not None:
                p = (p * k["decay"]).astype(F32)
            p = (p + ((k["step_size"] * m).astype(F32) / denom).astype(F32)).astype(F32)
        elif name == "momentum":
            g = fma(p, k["weight_decay"], g)
            m = g.copy() if step == 1 else ((m * k["beta1"]).astype(F32) + g).astype(F32)
            p = fma(m, k["neg_lr"], p)
        elif name == "lion":
            if k["decay"] is not None:
                p = (p * k["decay"]).astype(F32)
            direction = np.sign(((m * k["beta1"]).astype(F32) + (g * k["one_minus_beta1"]).astype(F32)).astype(F32))
            p = fma(direction.astype(F32), k["neg_lr"], p)
            m = fma(g, k["one_minus_beta2"], (m * k["beta2"]).astype(F32))
        else:  # rmsprop
            g = fma(p, k["weight_decay"], g)
            m = fma((k["one_minus_beta1"] * g).astype(F32), g, (m * k["beta1"]).astype(F32))
            denom = (sqrt(m) + k["eps"]).astype(F32)
            p = (p + ((k["neg_lr"] * g).astype(F32) / denom).astype(F32)).astype(F32)
    s1, a1 = quantize_blockwise(m, BLOCKSIZE, qmap1)
    if name in TWO_STATE:
        s2, a2 = quantize_blockwise(v, BLOCKSIZE, qmap2)
        return p, s1, a1, s2, a2
    return p, s1, a1, None, None


def initial_state(n: int, name: str):
    """Zero codes and zero absmax, as a fresh optimizer holds them."""
    blocks = -(-n // BLOCKSIZE)
    s1, a1 = np.zeros(n, np.uint8), np.zeros(blocks, F32)
    if name in TWO_STATE:
        return s1, a1, np.zeros(n, np.uint8), np.zeros(blocks, F32)
    return s1, a1, None, None
