"""transformers integration (imports transformers): importing this module
registers q4 with ``from_pretrained`` (method "q4", and q4 as the backend of
bitsandbytes-format folders). See q4torch/_src/hf.py and the README's
"transformers, sentence-transformers and peft"."""

try:
    import transformers  # noqa: F401
except ImportError as e:
    raise ImportError(f"q4torch.hf needs the transformers package (pip install 'q4[hf]'): {e}") from None

from q4torch._src.hf import (
    Q4Config,
    Q4HfQuantizer,
    dequantize_model,
    dequantized_weight,
    restore_bitsandbytes,
    serves_bitsandbytes,
    use_for_bitsandbytes,
)

__all__ = [
    "Q4Config",
    "Q4HfQuantizer",
    "dequantize_model",
    "dequantized_weight",
    "restore_bitsandbytes",
    "serves_bitsandbytes",
    "use_for_bitsandbytes",
]
