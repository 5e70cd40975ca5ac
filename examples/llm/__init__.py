"""A Llama-family decoder made from a config with random weights, run in PyTorch (transformers + q4torch) and in flax.nnx (q4jax) from the same bytes."""
