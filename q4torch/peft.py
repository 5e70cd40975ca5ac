"""peft integration (imports peft): LoRA / DoRA over q4torch's quantized layers,
merge_and_unload included. See q4torch/_src/peft.py and the README's
"transformers, sentence-transformers and peft"."""

try:
    import peft  # noqa: F401
except ImportError as e:
    raise ImportError(f"q4torch.peft needs the peft package (pip install 'q4[hf]'): {e}") from None

from q4torch._src.peft import LoraLinear, Q4DoraLayer, merge_and_dequantize, register, requantize

__all__ = ["LoraLinear", "Q4DoraLayer", "merge_and_dequantize", "register", "requantize"]
