"""q4jax.optim: bitsandbytes-compatible 8-bit optimizers as optax GradientTransformations
(the same state bytes as q4torch.optim and bitsandbytes; see docs/guides/optimizers.md)."""

from q4jax._src.optim import Optim8State, adam_8bit, adamw_8bit, lion_8bit, rmsprop_8bit, sgd_8bit

__all__ = ["Optim8State", "adam_8bit", "adamw_8bit", "lion_8bit", "rmsprop_8bit", "sgd_8bit"]
