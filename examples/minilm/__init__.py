"""all-MiniLM-L6-v2 sentence embeddings in PyTorch (torch_model) and flax.nnx
(flax_model), on the same safetensors weights, dense or quantized by q4."""
