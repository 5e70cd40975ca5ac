"""q4jax.nn: flax.nnx layers on the shared kernels, and the checkpoint and sharding helpers."""

from q4jax._src.nn import (
    Linear4bit,
    Linear8bit,
    QuantStateVar,
    load_quantized,
    load_state_dict,
    quantize_model,
    shard_model,
    state_dict,
)

__all__ = [
    "Linear4bit",
    "Linear8bit",
    "QuantStateVar",
    "load_quantized",
    "load_state_dict",
    "quantize_model",
    "shard_model",
    "state_dict",
]
