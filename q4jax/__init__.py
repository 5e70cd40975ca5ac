"""q4jax: the JAX front end of q4 (XLA FFI custom calls into the shared kernels)."""

from q4jax import nn, optim
from q4jax._src.checkpoint import load_quantized, load_state_dict, state_dict
from q4jax._src.lora import add_lora
from q4jax._src.matmul import matmul_4bit, matmul_8bit
from q4jax._src.model import QuantizeReport, quantize_model
from q4jax._src.model_sharding import shard_model
from q4jax._src.quant import (
    QuantState,
    dequantize_4bit,
    dequantize_blockwise,
    quantize_4bit,
    quantize_blockwise,
    quantize_int8_weight,
)
from q4jax._src.sharding import (
    LinearSharding,
    place_bias,
    shard_4bit,
    shard_8bit,
    sharded_matmul_4bit,
    sharded_matmul_8bit,
    unshard_4bit,
    unshard_8bit,
)

__all__ = [
    "add_lora",
    "load_quantized",
    "load_state_dict",
    "nn",
    "optim",
    "quantize_model",
    "QuantizeReport",
    "shard_model",
    "state_dict",
    "QuantState",
    "dequantize_4bit",
    "dequantize_blockwise",
    "matmul_4bit",
    "matmul_8bit",
    "quantize_4bit",
    "quantize_blockwise",
    "quantize_int8_weight",
    # SPMD: quantized layers over a device mesh
    "LinearSharding",
    "place_bias",
    "shard_4bit",
    "shard_8bit",
    "sharded_matmul_4bit",
    "sharded_matmul_8bit",
    "unshard_4bit",
    "unshard_8bit",
]
