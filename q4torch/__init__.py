"""q4torch: the PyTorch front end of q4 (bitsandbytes-compatible names)."""

from q4torch import functional
from q4torch.functional import QuantState

__all__ = ["QuantState", "functional"]
