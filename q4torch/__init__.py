"""q4torch: the PyTorch front end of q4 (bitsandbytes-compatible names)."""

from q4torch import functional
from q4torch.functional import QuantState, matmul_4bit

__all__ = ["QuantState", "functional", "matmul_4bit"]
