"""`q4 parity`: a checkpoint's quantized layers loaded into q4torch and q4jax
through one small adapter interface per front end (q4torch/_src/parity.py,
q4jax/_src/parity.py, found by module name: q4/ imports neither front end),
their bytes, outputs and input gradients compared with an fp64 reference.
Everything crosses the interface as numpy arrays.

A layer spec: kind ('4bit' | '8bit'), quant_type, nested, blocksize,
threshold; weights W [out, in] fp32 and bias [out] fp32.
"""

from __future__ import annotations

from dataclasses import dataclass

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


# Each front end provides its adapter as `Adapter` in the module named here;
# q4/ imports neither front end itself (the modules are loaded on first use).
ADAPTER_MODULES = {"q4torch": "q4torch._src.parity", "q4jax": "q4jax._src.parity"}


def adapter(name: str):
    """The `q4 parity` adapter of front end `name` ('q4torch' or 'q4jax')."""
    from q4._src import plugins

    if name not in ADAPTER_MODULES:
        raise ValueError(f"unknown front end {name!r}; choose from {', '.join(ADAPTER_MODULES)}")
    return plugins.load(ADAPTER_MODULES[name] + ":Adapter")()


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
    from q4._src.schema import layer_keys

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
    from q4._src.container import Reader
    from q4._src.schema import validate

    adapters = [adapter(name) for name in ADAPTER_MODULES]
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
