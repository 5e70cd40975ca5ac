"""q4torch: the PyTorch front end of q4 (bitsandbytes-compatible names)."""

from q4torch import functional, nn
from q4torch._src.replace import load_quantized, replace_linear
from q4torch.functional import QuantState, matmul_4bit

__all__ = [
    "QuantState",
    "QuantStateLoadPlanner",
    "fully_shard",
    "functional",
    "load_quantized",
    "matmul_4bit",
    "nn",
    "replace_linear",
]

# FSDP2 / torch.distributed.checkpoint helpers, imported on first use (torch.distributed
# adds about half a second to `import q4torch`)
_FSDP_NAMES = ("QuantStateLoadPlanner", "fully_shard")


def __getattr__(name: str):
    if name in _FSDP_NAMES:
        from q4torch._src import fsdp

        return getattr(fsdp, name)
    raise AttributeError(f"module 'q4torch' has no attribute {name!r}")
