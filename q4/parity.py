"""Parity adapters: one small interface over each framework's quantized
layer, so a parity check is written once and run for q4torch and q4jax. The
test suite (tests/parity) and user-facing parity checks share them.
Everything crosses the interface as numpy arrays; each adapter imports its
framework only when constructed.

A layer spec: kind ('4bit' | '8bit'), quant_type, nested, blocksize,
threshold; weights W [out, in] fp32 and bias [out] fp32.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

import numpy as np


@dataclass(frozen=True)
class Spec:
    kind: str = "4bit"
    quant_type: str = "nf4"
    nested: bool = True
    blocksize: int = 64
    threshold: float = 0.0

    @property
    def id(self) -> str:
        if self.kind == "8bit":
            return f"int8-t{self.threshold:g}"
        return f"{self.quant_type}-{'nested' if self.nested else 'plain'}-bs{self.blocksize}"


class TorchAdapter:
    name = "q4torch"

    def __init__(self):
        import torch

        import q4torch.nn as qnn

        self.torch, self.nn = torch, qnn

    def make(self, spec: Spec, w: np.ndarray, b: np.ndarray):
        torch = self.torch
        out_f, in_f = w.shape
        layer: Any
        if spec.kind == "8bit":
            layer = self.nn.Linear8bitLt(in_f, out_f, has_fp16_weights=False, threshold=spec.threshold)
        else:
            layer = self.nn.Linear4bit(in_f, out_f, quant_type=spec.quant_type, compress_statistics=spec.nested)
            layer.weight = self.nn.Params4bit(
                torch.from_numpy(w.copy()),
                blocksize=spec.blocksize,
                compress_statistics=spec.nested,
                quant_type=spec.quant_type,
                module=layer,
            )
        if spec.kind == "8bit":
            layer.weight.data = torch.from_numpy(w.copy())
        layer.bias.data = torch.from_numpy(b.copy())
        return layer.to("cpu")

    def forward(self, layer, x: np.ndarray) -> np.ndarray:
        with self.torch.no_grad():
            return layer(self._t(x)).float().numpy()

    def input_grad(self, layer, x: np.ndarray, g: np.ndarray) -> np.ndarray:
        xt = self._t(x).requires_grad_()
        layer(xt).backward(self._t(g))
        return xt.grad.float().numpy()

    def state(self, layer) -> dict[str, np.ndarray]:
        return {k: v.detach().numpy().copy() for k, v in layer.state_dict().items()}

    def load(self, layer, state: dict[str, np.ndarray]) -> None:
        layer.load_state_dict({k: self.torch.from_numpy(np.array(v)) for k, v in state.items()})

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

    def _t(self, x: np.ndarray):
        if x.dtype.name == "bfloat16":
            return self.torch.from_numpy(x.view(np.uint16).copy()).view(self.torch.bfloat16)
        return self.torch.from_numpy(x.copy())


class JaxAdapter:
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


# ------------------------------------------------------------ file checks

_U = 2.0**-24  # fp32 unit roundoff


@dataclass
class LayerCheck:
    """One quantized layer of a checkpoint checked in both frameworks."""

    name: str
    spec: Spec
    shape: tuple[int, int]
    bytes_identical: bool
    err: dict[str, float]  # framework -> max |output or input-gradient - fp64 reference|
    ratio: dict[str, float]  # framework -> max of that error / its bound
    cross: float  # max |q4torch - q4jax| over outputs and input gradients
    cross_ratio: float

    @property
    def ok(self) -> bool:
        return self.bytes_identical and max(self.ratio.values()) <= 1.0 and self.cross_ratio <= 1.0


def _layer_entries(tensors, layer: str) -> dict[str, np.ndarray]:
    from q4._src.checkpoint import layer_keys

    keys = layer_keys(tensors, layer) + ([f"{layer}.bias"] if f"{layer}.bias" in tensors else [])
    return {key[len(layer) + 1 :]: np.array(tensors[key]) for key in keys}


def _reference_weight(spec: Spec, entries: dict[str, np.ndarray]) -> np.ndarray:
    from q4._src.quant_state import QuantState
    from q4._src.weights import dequantize_weight_4bit, dequantize_weight_int8

    if spec.kind == "8bit":
        return dequantize_weight_int8(entries["weight"], entries["SCB"]).astype(np.float64)
    state = QuantState.from_dict({k[len("weight.") :]: v for k, v in entries.items() if k.startswith("weight.")})
    return dequantize_weight_4bit(entries["weight"], state).astype(np.float64)


def check_layer(adapters, name: str, spec: Spec, entries: dict[str, np.ndarray], batch: int, seed: int) -> LayerCheck:
    """Load one layer's checkpoint entries into every adapter, compare their
    state bytes with the file, and their outputs and input gradients on random
    inputs with an fp64 reference computed from the stored weight.

    Bounds: an fp32 dot product of length k is within (k + 2) u sum|x||w| of
    the exact one (u = 2^-24); an 8-bit layer also quantizes each input row to
    int8 (error <= rowmax|x| / 254 per element), so its output bound adds
    rowmax|x| / 254 * sum|w|.
    """
    w = _reference_weight(spec, entries)
    out_f, in_f = w.shape
    entries = dict(entries)
    b = entries.setdefault("bias", np.zeros(out_f, np.float32)).astype(np.float64)
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((batch, in_f)).astype(np.float32)
    g = rng.standard_normal((batch, out_f)).astype(np.float32)
    x64, g64, aw = x.astype(np.float64), g.astype(np.float64), np.abs(w)
    y_ref, dx_ref = x64 @ w.T + b, g64 @ w
    y_bound = (in_f + 2) * _U * (np.abs(x64) @ aw.T + np.abs(b)) + 1e-30
    if spec.kind == "8bit":
        y_bound += np.abs(x64).max(axis=1, keepdims=True) / 254.0 * aw.sum(axis=1)[None, :]
    dx_bound = (out_f + 2) * _U * (np.abs(g64) @ aw) + 1e-30

    results, identical = {}, True
    for adapter in adapters:
        layer = adapter.make(spec, np.zeros((out_f, in_f), np.float32), np.zeros(out_f, np.float32))
        adapter.load(layer, entries)
        state = adapter.state(layer)
        identical &= set(state) == set(entries) and all(
            state[k].dtype == entries[k].dtype and state[k].tobytes() == entries[k].tobytes() for k in entries
        )
        results[adapter.name] = (adapter.forward(layer, x), adapter.input_grad(layer, x, g))
    err, ratio = {}, {}
    for fw, (y, dx) in results.items():
        dy, ddx = np.abs(y - y_ref), np.abs(dx - dx_ref)
        err[fw] = float(max(dy.max(), ddx.max()))
        ratio[fw] = float(max((dy / y_bound).max(), (ddx / dx_bound).max()))
    (y0, dx0), (y1, dx1) = list(results.values())[:2] if len(results) > 1 else (results[adapters[0].name],) * 2
    cy, cdx = np.abs(y0 - y1), np.abs(dx0 - dx1)
    cross = float(max(cy.max(), cdx.max()))
    cross_ratio = float(max((cy / y_bound).max(), (cdx / dx_bound).max()))
    return LayerCheck(name, spec, (out_f, in_f), bool(identical), err, ratio, cross, cross_ratio)


def spec_of(meta: dict) -> Spec:
    """The Spec of a layer from its ``q4.layers`` entry (see q4.checkpoint.validate)."""
    if meta["kind"] == "Linear8bitLt":
        return Spec(kind="8bit")
    return Spec(kind="4bit", quant_type=meta["quant_type"], nested=meta["nested"], blocksize=meta["blocksize"])


def check_file(path, *, batch: int = 4, seed: int = 0, layers=None, progress=None) -> list[LayerCheck]:
    """Check every quantized layer of a checkpoint in q4torch and q4jax (see
    check_layer); ``layers`` restricts the check to these layer names."""
    from q4._src.checkpoint import Reader, validate

    adapters = [TorchAdapter(), JaxAdapter()]
    with Reader(path) as r:
        views = {k: r.view(k) for k in r.keys()}
        metas = validate(views)
        names = [n for n in metas if layers is None or n in layers]
        checks = []
        for i, name in enumerate(names):
            if progress:
                progress(i, len(names), name)
            entries = _layer_entries(views, name)
            checks.append(check_layer(adapters, name, spec_of(metas[name]), entries, batch, seed + i))
        if progress:
            progress(len(names), len(names), "")
    return checks
