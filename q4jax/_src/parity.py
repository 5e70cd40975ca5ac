"""q4jax's adapter for `q4 parity` (q4/parity.py finds it by this module's
name): one small interface over the flax.nnx layers, everything crossing it as
numpy arrays. The parity test scenarios extend it (tests/parity/adapters.py).
"""

from __future__ import annotations

import numpy as np

from q4.parity import Spec


class Adapter:
    name = "q4jax"

    def __init__(self):
        import jax
        import jax.numpy as jnp
        from flax import nnx

        import q4jax

        self.jax, self.jnp, self.nnx, self.q4jax = jax, jnp, nnx, q4jax

    def make(self, spec: Spec, w: np.ndarray, b: np.ndarray):
        nn, nnx = self.q4jax.nn, self.nnx
        out_f, in_f = w.shape
        if spec.kind == "8bit":
            layer = nn.Linear8bit(in_f, out_f, threshold=spec.threshold, rngs=nnx.Rngs(0))
        else:
            layer = nn.Linear4bit(
                in_f,
                out_f,
                quant_type=spec.quant_type,
                blocksize=spec.blocksize,
                compress_statistics=spec.nested,
                rngs=nnx.Rngs(0),
            )
        layer.set_weight(self.jnp.asarray(w))
        self.q4jax.load_state_dict(layer, {**self.state(layer), "bias": b})
        return layer

    def forward(self, layer, x: np.ndarray) -> np.ndarray:
        return np.asarray(layer(self.jnp.asarray(x)), np.float32)

    def input_grad(self, layer, x: np.ndarray, g: np.ndarray) -> np.ndarray:
        _, vjp = self.jax.vjp(lambda a: layer(a), self.jnp.asarray(x))
        return np.asarray(vjp(self.jnp.asarray(g))[0], np.float32)

    def state(self, layer) -> dict[str, np.ndarray]:
        return self.q4jax.state_dict(layer)

    def load(self, layer, state: dict[str, np.ndarray]) -> None:
        self.q4jax.load_state_dict(layer, state)
