"""bitsandbytes-compatible quantized layers (import as you would bitsandbytes.nn)."""

from q4torch._src.embedding import Embedding4bit, Embedding8bit, EmbeddingFP4, EmbeddingNF4, StableEmbedding
from q4torch._src.linear4bit import Linear4bit, LinearFP4, LinearNF4, Params4bit
from q4torch._src.linear8bit import Int8Params, Linear8bitLt

__all__ = [
    "Embedding4bit",
    "Embedding8bit",
    "EmbeddingFP4",
    "EmbeddingNF4",
    "Int8Params",
    "Linear4bit",
    "Linear8bitLt",
    "LinearFP4",
    "LinearNF4",
    "Params4bit",
    "StableEmbedding",
]
