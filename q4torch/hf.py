"""transformers integration (imports transformers): importing this module
registers q4 with ``from_pretrained`` (method "q4", and q4 as the backend of
bitsandbytes-format folders). See q4torch/_src/hf.py and the README's
"transformers, sentence-transformers and peft"."""

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
