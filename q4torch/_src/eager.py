"""The eager fast path: direct calls of the CPU kernels, without the
torch.library dispatcher.

At batch 1 on a small layer the Python around the kernel is most of the call,
and the op's dispatch alone is a tenth of it. Here are the one entry for each
kernel, used by the layers (Linear4bit, Linear8bitLt) and by the functional
API (q4torch.functional.matmul_4bit, int8_linear) alike: ``matmul_4bit`` and
``int8_linear`` return the op's result (the same kernel with the same
arguments, so the same bytes) or None where the op must run. The op runs
wherever something must see it or record it: torch.compile, a torch function
or dispatch mode, a functorch transform, a tensor subclass, a device other
than the CPU. Where autograd records the call, the kernels' autograd twins
(EagerGemm4bit, EagerInt8Linear) record the op's node (same kernels,
same saved tensors) without the dispatch.

The kernels are called through the ops module's attributes (ops.gemm_4bit_call,
...), so that a caller that wraps one (a profiler, a test) sees every call.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch

from q4torch._src import ops
from q4torch._src.quant_state import QuantState, check_quant_state
from q4torch._src.torch_internals import (
    DISABLED_TORCH_FUNCTION,
    DisableTorchFunctionSubclass,
    dispatch_stack_len,
    is_functorch_wrapped_tensor,
    torch_function_mode_enabled,
)

__all__ = ["EagerGemm4bit", "EagerInt8Linear", "int8_linear", "matmul_4bit"]

# Validated kernel arguments of a 4-bit weight, per QuantState: (key, args).
# The arguments are pointers and sizes, a function of the key alone (the
# pointers, sizes, dtypes and layout of the packed bytes and scales, and the
# state's fields), so an entry is either exactly what validation would produce
# now or it does not match: it cannot go stale. The nested offset's value is
# read on every call (tensors made under inference_mode have no version
# counter that could tell an in-place change).
# Keyed by id(state) (QuantState compares by value, so it is not hashable);
# an entry holds a weak reference to its state and leaves with it.
_PREPARED: dict[int, tuple] = {}


def _prepared_key(qs: QuantState, B: torch.Tensor):
    a = qs.absmax
    key: tuple[Any, ...] = (B.data_ptr(), B.numel(), B.element_size(), B.is_contiguous(), qs.blocksize, qs.quant_type)
    key += (tuple(qs.shape), qs.dtype, qs.nested, a.data_ptr(), a.numel(), a.dtype, a.is_contiguous())
    if qs.nested:
        s2, off = qs.state2, qs.offset
        a2 = s2.absmax
        key += (a2.data_ptr(), a2.numel(), a2.dtype, a2.is_contiguous(), s2.blocksize)
        key += (off.numel(), off.dtype)
    return key


def _prepared_args(qs: QuantState, B: torch.Tensor):
    """(n, k, scales) for the C ABI, validated once per distinct key."""
    try:
        key = _prepared_key(qs, B)
    except (AttributeError, TypeError):  # not tensors where tensors belong: the full check says which
        key = None
    hit = _PREPARED.get(id(qs))
    if key is not None and hit is not None and hit[0]() is qs and hit[1] == key:
        n, k, scales = hit[2]
        if qs.nested:  # the offset's current value (a tensor never cached)
            scales = scales[:5] + (float(qs.offset.item()),) + scales[6:]
        return n, k, scales
    check_quant_state(qs, B)
    if len(qs.shape) != 2:
        raise ValueError(f"matmul_4bit needs a 2-D weight, quant_state.shape is {tuple(qs.shape)}")
    n, k = (int(s) for s in qs.shape)
    packed = (B if B.dtype == torch.uint8 else B.view(torch.uint8)).reshape(-1)
    nested = qs.nested
    scales = ops.weight_args(
        packed,
        qs.absmax,
        qs.state2.absmax if nested else None,
        qs.offset if nested else None,
        n,
        k,
        int(qs.blocksize),
        qs.quant_type,
    )
    args = (n, k, scales)
    if key is not None:
        ident = id(qs)

        def forget(_ref: weakref.ref, i: int = ident) -> None:
            _PREPARED.pop(i, None)

        _PREPARED[ident] = (weakref.ref(qs, forget), key, args)
    return args


def plain(t) -> bool:
    """A tensor with no torch function of its own: torch.Tensor, or an
    nn.Parameter (or a subclass, such as Int8Params, that keeps Parameter's
    disabled one)."""
    tp = type(t)
    return tp is torch.Tensor or getattr(tp, "__torch_function__", None) is DISABLED_TORCH_FUNCTION


def recording(A: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """Whether autograd records this call (A or the bias requires grad, grad mode on)."""
    return torch.is_grad_enabled() and (A.requires_grad or (bias is not None and bias.requires_grad))


def eager_cpu(A: torch.Tensor, bias: torch.Tensor | None, records: bool = False) -> bool:
    """Whether a call may run the CPU kernel directly rather than through its
    op (q4::gemm_4bit, q4::int8_linear): eager mode, plain CPU tensors, nothing recording
    (no autograd graph, no tracing, no torch function or dispatch mode). The
    result is the op's, byte for byte (the same kernel with the same
    arguments); what is skipped is the dispatcher's per-call cost, which at
    batch 1 is a tenth of the whole call. records=True also allows an
    autograd graph (A or the bias requiring grad) outside functorch's
    transforms: the caller records it itself (EagerGemm4bit, EagerInt8Linear)."""
    if type(A) is not torch.Tensor or not A.is_cpu or torch.compiler.is_compiling():
        return False
    if recording(A, bias) and (not records or is_functorch_wrapped_tensor(A)):
        return False
    if bias is not None and (not plain(bias) or not bias.is_cpu):  # (a layer's bias: an nn.Parameter)
        return False
    return not torch_function_mode_enabled() and dispatch_stack_len() == 0


def _cpu_tensor(t) -> bool:
    return isinstance(t, torch.Tensor) and t.is_cpu


def matmul_4bit(A, B, quant_state, bias, activation_quant) -> torch.Tensor | None:
    """matmul_4bit(A, B, quant_state, bias=bias, activation_quant=...) by a
    direct call of the CPU kernel, or None where the q4::gemm_4bit op (or the
    general path's checks and errors) must run: the conditions of eager_cpu,
    a QuantState of a 2-D [N, K] weight whose K is A's last dimension, a
    non-empty A, a contiguous CPU B. activation_quant is already checked.
    Linear4bit.forward calls it directly: at batch 1 on a small layer the
    Python around the kernel is most of the call. Where A or the bias
    requires grad, EagerGemm4bit records the op's autograd (same kernels,
    same saved tensors) without the op's dispatch: in a training step of a
    small layer that dispatch cost more than the kernels."""
    if not isinstance(quant_state, QuantState) or not eager_cpu(A, bias, records=True):
        return None
    shape = quant_state.shape
    # (a mismatch: an error, or the [K, N] orientation, in the general path)
    if shape is None or len(shape) != 2 or A.dim() == 0 or A.numel() == 0 or A.shape[-1] != shape[-1]:
        return None
    # (a Params4bit's own __torch_function__ would cost ~1 us per method call)
    with DisableTorchFunctionSubclass():
        absmax = quant_state.absmax  # (a non-tensor or meta absmax: the general path's checks name it)
        if not isinstance(B, torch.Tensor) or not B.is_cpu or not B.is_contiguous() or not _cpu_tensor(absmax):
            return None
        if B.dtype is torch.bool or (quant_state.nested and not _cpu_tensor(quant_state.state2.absmax)):
            return None
        n, k, scales = _prepared_args(quant_state, B)
        bs, qt = int(quant_state.blocksize), quant_state.quant_type
        if not recording(A, bias):
            return ops.gemm_4bit_call(A, B.data_ptr(), n, k, scales, bs, qt, bias, activation_quant)
        packed = (B if B.dtype == torch.uint8 else B.view(torch.uint8)).reshape(-1)
        nested = quant_state.nested
        absmax, state2, offset = quant_state.absmax, quant_state.state2, quant_state.offset
        nested_absmax, nested_offset = (state2.absmax, offset) if nested else (None, None)
    return EagerGemm4bit.apply(
        A, packed, absmax, nested_absmax, nested_offset, bias, n, k, scales, bs, qt, activation_quant
    )


def int8_linear(A, CB, SCB, threshold: float, bias) -> torch.Tensor | None:
    """int8_linear(A, CB, SCB, threshold, bias) by a direct call of the CPU
    kernel, or None where the q4::int8_linear op must run: the conditions of
    eager_cpu, and plain CPU CB and SCB (an Int8Params keeps nn.Parameter's
    torch function). Where A or the bias requires grad, EagerInt8Linear
    records the op's autograd."""
    if eager_cpu(A, bias, records=True) and plain(CB) and plain(SCB) and CB.is_cpu and SCB.is_cpu:
        if recording(A, bias):
            return EagerInt8Linear.apply(A, CB, SCB, float(threshold), bias)
        return ops.int8_linear_call(A, CB, SCB, float(threshold), bias)
    return None


# ------------------------------------------------ the direct calls' autograd


def _direct_backward(grad: torch.Tensor) -> bool:
    """Whether an eager node's backward may call a kernel directly: a plain
    CPU gradient with nothing tracing or recording (else the op, which a
    compiled autograd or a dispatch mode sees). A backward that records
    (create_graph=True with a gradient that requires grad) takes the op too,
    so a second derivative through it raises the op's error rather than
    silently counting as zero."""
    return (
        type(grad) is torch.Tensor
        and grad.is_cpu
        and not (torch.is_grad_enabled() and grad.requires_grad)
        and not torch.compiler.is_compiling()
        and not torch_function_mode_enabled()
        and dispatch_stack_len() == 0
    )


class EagerGemm4bit(torch.autograd.Function):
    """q4::gemm_4bit (activation_quant=None) or q4::gemm_4bit_w4a8 ('int8')
    with its autograd, for eager CPU calls that record a graph: the same
    kernels with the same arguments (so the same bytes, forward and
    backward) and the same saved tensors as the op's autograd, without the
    custom op's dispatch (~50-100 us a call in Python, more than the kernel
    on a small layer). matmul_4bit takes it under the conditions of
    eager_cpu; the backward calls the op instead when it is
    being traced (compiled autograd) or runs under a dispatch mode.

    apply(x, packed, absmax, nested_absmax, nested_offset, bias, n, k,
    scales, blocksize, quant_type, activation_quant): packed flat uint8;
    scales the forward's validated C ABI arguments (weight_args) -- the
    backward validates its own from the saved tensors, never reusing
    pointers across a recompute."""

    @staticmethod
    def forward(ctx, x, packed, absmax, nested_absmax, nested_offset, bias, n, k, scales, blocksize, quant_type, aq):
        ctx.save_for_backward(packed, absmax, nested_absmax, nested_offset)
        ctx.meta = (n, k, blocksize, quant_type, None if bias is None else bias.dtype)
        return ops.gemm_4bit_call(x, packed.data_ptr(), n, k, scales, blocksize, quant_type, bias, aq)

    @staticmethod
    def backward(ctx, grad):
        grad_input = ops.gemm_4bit_grad_input_call if _direct_backward(grad) else ops.gemm_4bit_grad_input
        return ops.gemm_grads(ctx, grad, grad_input, 5)


class EagerInt8Linear(torch.autograd.Function):
    """q4::int8_linear with its autograd for eager CPU calls that record a
    graph (as EagerGemm4bit): the same kernels, arguments and saved tensors,
    without the op's dispatch. apply(x, weight, weight_scale, threshold, bias)."""

    @staticmethod
    def forward(ctx, x, weight, weight_scale, threshold, bias):
        ops.int8_setup_context(ctx, (x, weight, weight_scale, threshold, bias), None)
        return ops.int8_linear_call(x, weight, weight_scale, threshold, bias)

    @staticmethod
    def backward(ctx, grad):
        grad_input = ops.int8_grad_input_call if _direct_backward(grad) else ops.int8_grad_input
        return ops.int8_grads(ctx, grad, grad_input)
