"""Quantized checkpoints as safetensors files (numpy dicts, bitsandbytes keys)."""

from q4._src.checkpoint import CheckpointError, Reader, Writer, load_file, load_metadata, save_file, validate

__all__ = ["CheckpointError", "Reader", "Writer", "load_file", "load_metadata", "save_file", "validate"]
