"""The parity scenarios' adapters: each front end's `q4 parity` adapter
(q4torch/_src/parity.py, q4jax/_src/parity.py) plus what only the scenarios
need -- copying a layer, re-quantizing it, and the gradient through a stack of
checkpointed layers with the weights streamed through a recycled pool."""

from __future__ import annotations

import copy

import numpy as np

from q4.parity import Spec
from q4jax._src.parity import Adapter as JaxParity
from q4torch._src.parity import Adapter as TorchParity


class TorchAdapter(TorchParity):
    def clone(self, layer):
        return copy.deepcopy(layer)

    def set_weight(self, layer, spec: Spec, w: np.ndarray) -> None:
        """Re-quantize the layer in place from new float weights."""
        fresh = self.make(spec, w, self.state(layer)["bias"])
        self.load(layer, self.state(fresh))

    def upstream_grad(self, spec, weights, upstream, x, pool_size):
        """Gradient of an upstream vector through a stack of square layers (one
        per (w, b) in `weights`) under activation checkpointing; with
        `pool_size`, the layers' packed bytes are streamed through a recycled
        buffer pool (a fresh weight bound to the next buffer on every call)."""
        torch = self.torch
        from torch.utils.checkpoint import checkpoint

        layers = [self.make(spec, w, b) for w, b in weights]
        if pool_size:
            _stream_torch(torch, self.nn, layers, pool_size)
        u = torch.nn.Parameter(torch.from_numpy(upstream.copy()))
        h = self._t(x) * u
        for layer in layers:
            h = torch.tanh(checkpoint(layer, h, use_reentrant=False))
        (h**2).sum().backward()
        return u.grad.numpy()


class JaxAdapter(JaxParity):
    def clone(self, layer):
        return self.nnx.clone(layer)

    def set_weight(self, layer, spec: Spec, w: np.ndarray) -> None:
        layer.set_weight(self.jnp.asarray(w))

    def upstream_grad(self, spec, weights, upstream, x, pool_size):
        """Gradient of an upstream vector through a stack of square layers (one
        per (w, b) in `weights`) under activation checkpointing; with
        `pool_size`, the layers' packed bytes are streamed through a recycled
        buffer pool (a fresh weight bound to the next buffer on every call)."""
        jax, jnp = self.jax, self.jnp
        layers = [self.make(spec, w, b) for w, b in weights]
        packed = jnp.stack([layer.weight.get_value() for layer in layers])
        state = jax.tree.map(lambda *a: jnp.stack(a), *[layer.quant_state.get_value() for layer in layers])
        bias = jnp.stack([layer.bias.get_value() for layer in layers])
        pool_n = pool_size or 1

        def body(carry, layer):
            h, pool, step = carry
            p, s, b = layer
            if pool_size:  # the streaming copy into the next pool slot, read back for use
                pool = jax.lax.dynamic_update_index_in_dim(pool, p, step % pool_n, 0)
                p = jax.lax.dynamic_index_in_dim(pool, step % pool_n, 0, keepdims=False)
            return (jnp.tanh(self.q4jax.matmul_4bit(h, p, s, b)), pool, step + 1), None

        def loss(u):
            pool = jnp.zeros((pool_n,) + packed.shape[1:], packed.dtype)
            (h, _, _), _ = jax.lax.scan(jax.checkpoint(body), (jnp.asarray(x) * u, pool, 0), (packed, state, bias))
            return (h**2).sum()

        return np.asarray(jax.jit(jax.grad(loss))(jnp.asarray(upstream)))


def _stream_torch(torch, nn, layers, pool_size: int) -> None:
    """Streaming caller: each forward copies the layer's packed bytes into the
    next buffer of a round-robin pool and binds a fresh weight to it."""
    homes = [layer.weight.data.clone() for layer in layers]
    buffers = [torch.empty_like(homes[0]) for _ in range(pool_size)]
    calls = [0]

    def make_hook(i):
        def hook(module, args):
            buf = buffers[calls[0] % pool_size]
            calls[0] += 1
            with torch.no_grad():
                buf.copy_(homes[i])
            w = module.weight
            module.weight = w.with_data(buf, quant_state=module.quant_state, module=module, bnb_quantized=True)

        return hook

    for i, layer in enumerate(layers):
        layer.register_forward_pre_hook(make_hook(i))


ADAPTERS = {"q4torch": TorchAdapter, "q4jax": JaxAdapter}
