"""q4torch's adapter for `q4 parity` (q4/parity.py finds it by this module's
name): one small interface over the PyTorch layers, everything crossing it as
numpy arrays. The parity test scenarios extend it (tests/parity/adapters.py).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from q4.parity import Spec


class Adapter:
    name = "q4torch"

    def __init__(self):
        import torch

        import q4torch.nn as qnn

        self.torch, self.nn = torch, qnn

    def make(self, spec: Spec, w: np.ndarray, b: np.ndarray):
        return build_layer(self.nn, spec, w, b)

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

    def _t(self, x: np.ndarray):
        if x.dtype.name == "bfloat16":
            return self.torch.from_numpy(x.view(np.uint16).copy()).view(self.torch.bfloat16)
        return self.torch.from_numpy(x.copy())


def build_layer(nn: Any, spec: Spec, w: np.ndarray, b: np.ndarray):
    """The quantized layer for `spec` with float weight `w` and bias `b`,
    built through `nn` -- q4torch.nn, or bitsandbytes.nn, whose layers take
    the same arguments -- and quantized on the CPU."""
    import torch

    out_f, in_f = w.shape
    layer: Any
    if spec.kind == "8bit":
        layer = nn.Linear8bitLt(in_f, out_f, has_fp16_weights=False, threshold=spec.threshold)
        layer.weight.data = torch.from_numpy(w.copy())
    else:
        layer = nn.Linear4bit(in_f, out_f, quant_type=spec.quant_type, compress_statistics=spec.nested)
        layer.weight = nn.Params4bit(
            torch.from_numpy(w.copy()),
            blocksize=spec.blocksize,
            compress_statistics=spec.nested,
            quant_type=spec.quant_type,
            module=layer,
        )
    layer.bias.data = torch.from_numpy(b.copy())
    return layer.to("cpu")
