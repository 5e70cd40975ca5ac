"""q4jax: the JAX front end of q4 (XLA FFI custom calls into the shared kernels)."""

from q4jax import nn
from q4jax._src.matmul import matmul_4bit, matmul_8bit
from q4jax._src.nn import load_state_dict, quantize_model, state_dict
from q4jax._src.quant import (
    QuantState,
    dequantize_4bit,
    dequantize_blockwise,
    quantize_4bit,
    quantize_blockwise,
)

__all__ = [
    "load_state_dict",
    "nn",
    "quantize_model",
    "state_dict",
    "QuantState",
    "dequantize_4bit",
    "dequantize_blockwise",
    "matmul_4bit",
    "matmul_8bit",
    "quantize_4bit",
    "quantize_blockwise",
]
