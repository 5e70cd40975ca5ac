"""Seeded test inputs, generated once in numpy and converted per framework."""

from __future__ import annotations

import ml_dtypes
import numpy as np

DTYPES = ("float32", "float16", "bfloat16")
NP_DTYPES = {"float32": np.float32, "float16": np.float16, "bfloat16": ml_dtypes.bfloat16}
BLOCKSIZES = (32, 64, 128, 256, 512, 1024, 2048, 4096)


def special_values(rng: np.random.Generator, n: int) -> np.ndarray:
    """Normal values salted with +-0, denormals, huge values and exact code points."""
    x = rng.standard_normal(n).astype(np.float32) * 2
    picks = rng.integers(0, n, size=max(1, n // 8))
    specials = np.array([0.0, -0.0, 1e-40, -1e-45, 3e38, -3e38, 1e-38, 65504.0, 1.0, -1.0, 0.5, 2**-24], np.float32)
    x[picks] = specials[rng.integers(0, specials.size, size=picks.size)]
    return x


def make(rng: np.random.Generator, shape, dtype: str, kind: str = "normal") -> np.ndarray:
    """An array of `dtype` (numpy / ml_dtypes) with the requested content."""
    n = int(np.prod(shape))
    if kind == "normal":
        x = rng.standard_normal(n).astype(np.float32) * 3
    elif kind == "special":
        x = special_values(rng, n)
    elif kind == "zeros":
        x = np.zeros(n, np.float32)
    elif kind == "tiny":
        x = (rng.standard_normal(n) * 1e-39).astype(np.float32)
    else:
        raise ValueError(kind)
    with np.errstate(over="ignore"):
        return x.astype(NP_DTYPES[dtype]).reshape(shape)


def to_f32(x: np.ndarray) -> np.ndarray:
    return np.asarray(x).astype(np.float32)


def to_dtype(x32: np.ndarray, dtype: str) -> np.ndarray:
    """Round fp32 values to dtype (round to nearest even), as the kernels store them."""
    with np.errstate(over="ignore"):
        return np.asarray(x32, np.float32).astype(NP_DTYPES[dtype])


def bits(x: np.ndarray) -> np.ndarray:
    """Raw bit patterns, for exact comparisons that distinguish -0 and NaN payloads."""
    x = np.ascontiguousarray(x)
    return x.view({4: np.uint32, 2: np.uint16, 1: np.uint8}[x.dtype.itemsize])
