"""matmul_4bit: x . dequantize(W)^T (+ bias) as a jax.custom_vjp over the
fused kernels. Neither direction materialises the dequantized weight."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from q4._src import formats
from q4jax._src import ffi
from q4jax._src.quant import QuantState, check_state


def check_matmul_4bit(x, packed, state: QuantState, bias) -> None:
    """Trace-time checks of matmul_4bit's operands: the weight and its state
    (quant.check_state), a 2-D weight, x's features and dtype, bias shape."""
    check_state(packed, state)
    if len(state.shape) != 2:
        raise ValueError(f"a matmul weight must be 2-D (out_features, in_features), got shape {state.shape}")
    n, k = state.shape
    if x.ndim < 1 or x.shape[-1] != k:
        raise ValueError(
            f"x has {x.shape[-1] if x.ndim else 0} features, the weight expects {k} (weight shape {state.shape})"
        )
    ffi.dtype_name(x.dtype)
    if bias is not None:
        if bias.shape != (n,):
            raise ValueError(f"bias must have shape ({n},), got {bias.shape}")
        ffi.dtype_name(bias.dtype)


def _forward(x, packed, state, bias, activation_quant):
    n, k = state.shape
    return ffi.gemm_4bit_raw(
        x,
        packed,
        state.absmax,
        state.nested_absmax,
        state.nested_offset,
        bias,
        n,
        k,
        state.blocksize,
        state.quant_type,
        x.dtype,
        activation_quant,
    )


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _matmul_4bit(x, packed, state, bias, activation_quant):
    return _forward(x, packed, state, bias, activation_quant)


def _matmul_4bit_fwd(x, packed, state, bias, activation_quant):
    """Residuals: (packed, state, bias-is-present marker, x dtype) — the packed
    weight and its state, never the dequantized weight and never a value
    captured from Python, so remat / scan recompute uses the weight they see."""
    y = _forward(x, packed, state, bias, activation_quant)
    return y, (packed, state, None if bias is None else jnp.zeros((), bias.dtype), jnp.zeros((), x.dtype))


def _matmul_4bit_bwd(activation_quant, res, g):
    # W4A8's gradient is the exact one of x . dequantize(W)^T (straight through
    # the activation rounding): the same input-gradient kernel
    packed, state, bias_marker, x_marker = res
    n, k = state.shape
    dx = ffi.gemm_4bit_grad_input_raw(
        g,
        packed,
        state.absmax,
        state.nested_absmax,
        state.nested_offset,
        n,
        k,
        state.blocksize,
        state.quant_type,
        x_marker.dtype,
    )
    dbias = None
    if bias_marker is not None:
        dbias = jnp.sum(g.reshape(-1, n).astype(jnp.float32), axis=0).astype(bias_marker.dtype)
    # the quantized weight is frozen: zero cotangents for its arrays
    zero_state = jax.tree.map(jnp.zeros_like, state)
    return dx, jnp.zeros_like(packed), zero_state, dbias


_matmul_4bit.defvjp(_matmul_4bit_fwd, _matmul_4bit_bwd)


def matmul_4bit(
    x: jax.Array,
    packed: jax.Array,
    state: QuantState,
    bias: jax.Array | None = None,
    activation_quant: str | None = None,
) -> jax.Array:
    """y = x . dequantize(packed, state)^T (+ bias), for x [..., in_features].

    The weight [out_features, in_features] is used through the fused kernels in
    both directions; gradients flow to x and bias (the quantized weight is
    frozen). Works under jit, vmap (over x, or over stacked weights), grad,
    jax.checkpoint and lax.scan.

    activation_quant='int8' (opt-in W4A8, the kernel q4torch runs, bit for
    bit): x quantized to int8 per row in blocks of min(64, blocksize), integer
    dot products (README "W4A8"); in_features must be a multiple of the block.
    The gradient is the exact one of x . dequantize(W)^T.
    """
    formats.check_activation_quant(activation_quant)
    check_matmul_4bit(x, packed, state, bias)
    if activation_quant is not None:
        formats.check_w4a8_features(state.shape[1], state.blocksize)
    return _matmul_4bit(x, packed, state, bias, activation_quant)


# ------------------------------------------------------------------ 8-bit


def _check_8bit(x, weight, scale, bias, threshold):
    if weight.dtype != jnp.int8 or weight.ndim != 2:
        raise TypeError(f"weight must be a 2-D int8 array (CB), got {weight.dtype} with shape {weight.shape}")
    n, k = weight.shape
    if scale.shape != (n,) or scale.dtype != jnp.float32:
        raise ValueError(f"weight_scale must be float32 of shape ({n},), got {scale.dtype} {scale.shape}")
    if x.ndim < 1 or x.shape[-1] != k:
        raise ValueError(
            f"x has {x.shape[-1] if x.ndim else 0} features, the weight expects {k} (weight shape {(n, k)})"
        )
    ffi.dtype_name(x.dtype)
    if bias is not None and bias.shape != (n,):
        raise ValueError(f"bias must have shape ({n},), got {bias.shape}")
    formats.check_threshold(threshold)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _matmul_8bit(x, weight, scale, bias, threshold):
    return ffi.int8_linear_raw(x, weight, scale, bias, threshold, x.dtype)


def _matmul_8bit_fwd(x, weight, scale, bias, threshold):
    """Residuals: the int8 weight and its scales (never a dequantized copy)."""
    y = ffi.int8_linear_raw(x, weight, scale, bias, threshold, x.dtype)
    return y, (weight, scale, None if bias is None else jnp.zeros((), bias.dtype), jnp.zeros((), x.dtype))


def _matmul_8bit_bwd(threshold, res, g):
    weight, scale, bias_marker, x_marker = res
    dx = ffi.int8_grad_input_raw(g, weight, scale, x_marker.dtype)
    dbias = None
    if bias_marker is not None:
        dbias = jnp.sum(g.reshape(-1, weight.shape[0]).astype(jnp.float32), axis=0).astype(bias_marker.dtype)
    return dx, jnp.zeros_like(weight), jnp.zeros_like(scale), dbias


_matmul_8bit.defvjp(_matmul_8bit_fwd, _matmul_8bit_bwd)


def matmul_8bit(
    x: jax.Array, weight: jax.Array, weight_scale: jax.Array, bias: jax.Array | None = None, threshold: float = 0.0
) -> jax.Array:
    """LLM.int8 linear: y ~= x . (weight * weight_scale[:, None] / 127)^T (+ bias).

    x is quantized row-wise to int8 inside the kernel; with threshold > 0 the
    input columns holding any |x| >= threshold go through an fp32 matmul
    unquantized. Gradients flow to x (dX = g . dequantized W, fused) and bias.
    """
    _check_8bit(x, weight, weight_scale, bias, threshold)
    return _matmul_8bit(x, weight, weight_scale, bias, float(threshold))
