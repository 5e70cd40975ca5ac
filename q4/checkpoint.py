"""Quantized checkpoints as safetensors files (numpy dicts, bitsandbytes keys)."""

from q4._src.checkpoint import (
    CheckpointError,
    Reader,
    Writer,
    bitsandbytes_quantization_config,
    inspect_file,
    layer_keys,
    load_checkpoint,
    load_file,
    load_metadata,
    parse_weight_format,
    quantized_groups,
    remove_stale_temporaries,
    save_file,
    validate,
)
from q4._src.pages import release_pages

__all__ = [
    "CheckpointError",
    "Reader",
    "Writer",
    "bitsandbytes_quantization_config",
    "inspect_file",
    "layer_keys",
    "load_checkpoint",
    "load_file",
    "load_metadata",
    "parse_weight_format",
    "quantized_groups",
    "release_pages",
    "remove_stale_temporaries",
    "save_file",
    "validate",
]
