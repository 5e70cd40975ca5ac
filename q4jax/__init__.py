"""q4jax: the JAX front end of q4 (XLA FFI custom calls into the shared kernels)."""

from q4jax._src.quant import (
    QuantState,
    dequantize_4bit,
    dequantize_blockwise,
    quantize_4bit,
    quantize_blockwise,
)

__all__ = [
    "QuantState",
    "dequantize_4bit",
    "dequantize_blockwise",
    "quantize_4bit",
    "quantize_blockwise",
]
