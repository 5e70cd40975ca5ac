"""q4torch: the PyTorch front end of q4 (bitsandbytes-compatible names)."""

from q4torch import functional, nn
from q4torch._src.replace import replace_linear
from q4torch.functional import QuantState, matmul_4bit

__all__ = ["QuantState", "functional", "matmul_4bit", "nn", "replace_linear"]
