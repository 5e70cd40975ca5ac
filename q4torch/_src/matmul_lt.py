"""bitsandbytes' LLM.int8 autograd entry point: ``matmul(A, B, state=...)``
with a ``MatmulLtState`` (``bnb.matmul`` / ``bnb.MatmulLtState``), on q4's
int8 kernels (``q4::int8_linear``, whose backward is ``q4::int8_grad_input``)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from q4torch._src import ops


@dataclass
class MatmulLtState:
    """The int8 weight (CB, SCB) and the LLM.int8 settings of one matmul, as
    bitsandbytes' MatmulLtState (its fields; the ones only its CUDA kernels
    used stay None). With has_fp16_weights the weight is quantized from B on
    every call; otherwise CB / SCB are used as they are."""

    force_no_igemmlt: bool = False
    CB: torch.Tensor | None = None
    SB: torch.Tensor | None = None
    SCB: torch.Tensor | None = None
    SBt: torch.Tensor | None = None
    CBt: torch.Tensor | None = None
    subB: torch.Tensor | None = None
    outlier_pool: object = None
    has_accumulated_gradients: bool = False
    threshold: float = 0.0
    idx: torch.Tensor | None = None
    is_training: bool = True
    has_fp16_weights: bool = True
    use_pool: bool = False

    def reset_grads(self) -> None:
        self.CB = self.SB = self.SCB = self.SBt = self.CBt = None


def matmul(
    A: torch.Tensor,
    B: torch.Tensor,
    out: torch.Tensor | None = None,
    state: MatmulLtState | None = None,
    threshold: float = 0.0,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """A . W^T (+ bias) with LLM.int8 arithmetic, W [out_features, in_features]:
    B itself (float, quantized row-wise now) when state.has_fp16_weights or
    state has no CB, else state.CB / state.SCB (B is then only the int8 weight
    or a view of it). Columns of A with an |A| >= threshold go through fp32
    unquantized. Differentiable in A and bias; the result has A's dtype."""
    state = state or MatmulLtState()
    if threshold > 0.0:
        state.threshold = threshold
    if not isinstance(A, torch.Tensor) or not A.is_floating_point():
        raise TypeError(f"matmul: A must be a float tensor, got {getattr(A, 'dtype', type(A))}")
    if state.has_fp16_weights or state.CB is None:
        if B.dim() != 2 or not B.is_floating_point():
            raise ValueError(f"matmul: B must be a 2-D float weight [out, in], got {B.dtype} {tuple(B.shape)}")
        rows = B.detach().to(torch.float16).contiguous()
        CB, SCB, _ = ops.int8_quantize_rows(rows, 0.0)
        if not state.has_fp16_weights:
            state.CB, state.SCB = CB, SCB
    else:
        CB, SCB = state.CB, state.SCB
    if SCB is None or CB.dim() != 2:
        raise ValueError("matmul: the state's CB must be a 2-D int8 weight with its SCB")
    n, k = CB.shape
    if A.shape[-1] != k:
        raise ValueError(f"matmul: A has {A.shape[-1]} features, the weight expects {k} (weight ({n}, {k}))")
    if A.numel() == 0:  # no rows: an empty result that still joins the autograd graph
        y = torch.matmul(A, A.new_zeros((k, n)))
        if bias is not None:
            y = y + bias.to(A.dtype)
    else:
        y = ops.int8_linear(A, CB, SCB, float(state.threshold), None if bias is None else bias.to(A.dtype))
    if out is not None:
        return out.copy_(y)
    return y
