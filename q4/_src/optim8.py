"""The blockwise 8-bit optimizer step of the kernel library, framework-free.

State layout and arithmetic: kernels/include/q4/optim8.h (bitsandbytes
0.50.2's 8-bit optimizer state: uint8 codes per element in the signed dynamic
map (state1) and, for Adam, the unsigned one (state2), one fp32 absmax per
block of 256). The front ends (q4torch.optim, q4jax.optim) call
`update_8bit_ptr` with their buffers' addresses; `update_8bit` is the numpy
convenience the tests use.
"""

from __future__ import annotations

import ctypes

import numpy as np

from q4._src import formats
from q4._src.kernels import _call

BLOCKSIZE = 256
# optimizer name (bitsandbytes' optimizer_name) -> the kernel's code
OPTIMIZERS = {"adam": 0, "momentum": 1, "lion": 2, "rmsprop": 3}
TWO_STATE = ("adam",)


def num_blocks(n: int) -> int:
    return formats.num_blocks(n, BLOCKSIZE)


def qmap(signed: bool) -> np.ndarray:
    """bitsandbytes' create_dynamic_map(signed=...) as the library holds it (read-only)."""
    return formats.code_table("dynamic" if signed else "udynamic")


def optimizer_code(name: str) -> int:
    if name not in OPTIMIZERS:
        raise ValueError(f"optimizer must be one of {sorted(OPTIMIZERS)}, got {name!r}")
    return OPTIMIZERS[name]


def update_8bit_ptr(
    optimizer: str,
    param,
    param_dtype: int,
    grad,
    grad_dtype: int,
    n: int,
    state1,
    absmax1,
    qmap1,
    state2,
    absmax2,
    qmap2,
    step: int,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    gnorm_scale: float,
    skipped,
    stream=None,
    update=None,
) -> None:
    """One step in place on raw addresses (state2 / absmax2 / qmap2 None for the
    1-state optimizers); `skipped` (int32 [1] or None) receives the number of
    blocks left unchanged because their gradient held a NaN or infinity. With
    `update` (fp32 [n]) the parameter is only read and update receives the u
    with fp32(param + u) == the new parameter (see Optim8bitParams)."""
    _call(
        "optimizer_update_8bit",
        stream,
        optimizer_code(optimizer),
        param,
        param_dtype,
        grad,
        grad_dtype,
        n,
        state1,
        absmax1,
        qmap1,
        state2,
        absmax2,
        qmap2,
        num_blocks(n),
        step,
        float(lr),
        float(beta1),
        float(beta2),
        float(eps),
        float(weight_decay),
        float(gnorm_scale),
        skipped,
        update,
    )


def _ptr(a: np.ndarray | None):
    return None if a is None else a.ctypes.data_as(ctypes.c_void_p)


def update_8bit(
    optimizer: str,
    param: np.ndarray,
    grad: np.ndarray,
    state1: np.ndarray,
    absmax1: np.ndarray,
    state2: np.ndarray | None = None,
    absmax2: np.ndarray | None = None,
    *,
    step: int,
    lr: float,
    beta1: float,
    beta2: float = 0.0,
    eps: float = 0.0,
    weight_decay: float = 0.0,
    gnorm_scale: float = 1.0,
    qmap1: np.ndarray | None = None,
    qmap2: np.ndarray | None = None,
    update: np.ndarray | None = None,
) -> int:
    """One step on numpy arrays, in place (param: float32, float16 or
    bfloat16, C-contiguous; grad likewise), or into `update` (fp32, like param:
    param is left as it is). Returns the skipped block count."""
    for a, what in ((param, "param"), (grad, "grad"), (state1, "state1"), (absmax1, "absmax1")):
        if not a.flags.c_contiguous or not a.flags.writeable:
            raise ValueError(f"{what} must be a writeable C-contiguous array")
    two = optimizer in TWO_STATE
    q1 = np.ascontiguousarray(qmap(True) if qmap1 is None else qmap1, np.float32)
    q2 = np.ascontiguousarray(qmap(False) if qmap2 is None else qmap2, np.float32) if two else None
    skipped = np.zeros(1, np.int32)
    update_8bit_ptr(
        optimizer,
        _ptr(param),
        formats.DTYPE_CODES[np.dtype(param.dtype).name],
        _ptr(grad),
        formats.DTYPE_CODES[np.dtype(grad.dtype).name],
        param.size,
        _ptr(state1),
        _ptr(absmax1),
        _ptr(q1),
        _ptr(state2) if two else None,
        _ptr(absmax2) if two else None,
        _ptr(q2),
        step,
        lr,
        beta1,
        beta2,
        eps,
        weight_decay,
        gnorm_scale,
        _ptr(skipped),
        update=_ptr(update),
    )
    return int(skipped[0])
