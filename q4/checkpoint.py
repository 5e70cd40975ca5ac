"""Quantized checkpoints as safetensors files (numpy dicts, bitsandbytes keys)."""

from q4._src.checkpoint import (
    CheckpointError,
    Reader,
    Writer,
    layer_keys,
    load_file,
    load_metadata,
    quantized_groups,
    save_file,
    validate,
)

__all__ = [
    "CheckpointError",
    "Reader",
    "Writer",
    "layer_keys",
    "load_file",
    "load_metadata",
    "quantized_groups",
    "save_file",
    "validate",
]
