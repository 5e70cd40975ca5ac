"""q4jax.nn: flax.nnx layers on the shared kernels, and the checkpoint and sharding helpers."""

from q4jax._src.checkpoint import load_quantized, load_state_dict, state_dict
from q4jax._src.embedding import Embedding4bit, Embedding8bit, EmbeddingFP4, EmbeddingNF4, StableEmbedding
from q4jax._src.layers import Linear4bit, Linear8bit, QuantStateVar
from q4jax._src.model import QuantizeReport, quantize_model
from q4jax._src.model_sharding import shard_model
from q4jax._src.projection import QuantizedEinsum, QuantizedLinearGeneral

__all__ = [
    "Embedding4bit",
    "Embedding8bit",
    "EmbeddingFP4",
    "EmbeddingNF4",
    "Linear4bit",
    "Linear8bit",
    "QuantStateVar",
    "QuantizeReport",
    "QuantizedEinsum",
    "QuantizedLinearGeneral",
    "StableEmbedding",
    "load_quantized",
    "load_state_dict",
    "quantize_model",
    "shard_model",
    "state_dict",
]
