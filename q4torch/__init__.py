"""q4torch: the PyTorch front end of q4 (bitsandbytes-compatible names)."""

from q4torch import functional, nn, optim
from q4torch._src.matmul_lt import MatmulLtState, matmul
from q4torch._src.replace import load_quantized, quantize_model, replace_linear
from q4torch.functional import QuantState, matmul_4bit


def _share_threads() -> None:
    from q4._src.native import NativeLibraryError
    from q4torch._src.threads import use_torch_openmp

    try:
        use_torch_openmp()
    except NativeLibraryError:
        pass  # reported by the first op that needs the library


_share_threads()

__all__ = [
    "MatmulLtState",
    "Q4Config",
    "QuantState",
    "QuantStateLoadPlanner",
    "fully_shard",
    "functional",
    "load_quantized",
    "matmul",
    "matmul_4bit",
    "nn",
    "optim",
    "quantize_model",
    "replace_linear",
]

# FSDP2 / torch.distributed.checkpoint helpers, imported on first use (torch.distributed
# adds about half a second to `import q4torch`)
_FSDP_NAMES = ("QuantStateLoadPlanner", "fully_shard")


def __getattr__(name: str):
    if name == "Q4Config":  # imports transformers and registers q4 with it (q4torch.hf)
        from q4torch.hf import Q4Config

        return Q4Config
    if name in _FSDP_NAMES:
        from q4torch._src import fsdp

        return getattr(fsdp, name)
    raise AttributeError(f"module 'q4torch' has no attribute {name!r}")
