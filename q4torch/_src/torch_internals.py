"""The private PyTorch functions q4torch relies on, in one place.

Each name below is a private (underscored or torch._C) function whose
meaning torch does not promise to keep; tests/torch/test_torch_internals.py
checks each one on a case where it must hold and one where it must not, so a
torch upgrade that changes one fails there, not silently in a layer. They are
bound once at import: the eager batch-1 forward (q4torch/_src/eager.py) calls
several per call, and a module-global lookup is the cheapest read.

Why each is used:

- ``is_functorch_wrapped_tensor(t)``: t is a functorch transform's wrapper
  (``torch.func.grad`` / ``vmap`` ...). The direct kernel call records its own
  autograd node, which those transforms do not see; such calls take the op,
  whose error names the transform.
- ``torch_function_mode_enabled()``: a ``TorchFunctionMode`` is active. The
  mode must see the op, so the direct call is not taken.
- ``dispatch_stack_len()``: the number of active ``TorchDispatchMode`` s
  (0: none). A mode (FakeTensorMode, a profiler's or a test's recorder) must
  see the op, so the direct call is taken only at 0.
- ``DisableTorchFunctionSubclass``: a context in which a tensor subclass's
  ``__torch_function__`` is skipped (its methods run as torch.Tensor's).
  Params4bit defines one (to keep its attributes through torch.chunk /
  split); reading its fields without it costs ~1 us a method call at batch 1.
- ``DISABLED_TORCH_FUNCTION``: the ``__torch_function__`` that nn.Parameter
  (and subclasses that keep it, such as Int8Params) carries, which does
  nothing: a tensor whose type has it computes as a torch.Tensor.
- ``parse_to(*args, **kwargs)``: ``Tensor.to``'s own argument parser,
  (device, dtype, non_blocking, memory_format), so that Params4bit /
  Int8Params.to accept every form ``Tensor.to`` does.
- ``make_subclass(cls, data, requires_grad)``: a ``cls`` instance sharing
  ``data``'s storage, as nn.Parameter builds itself.
"""

from __future__ import annotations

import torch

__all__ = [
    "DISABLED_TORCH_FUNCTION",
    "DisableTorchFunctionSubclass",
    "dispatch_stack_len",
    "is_functorch_wrapped_tensor",
    "make_subclass",
    "parse_to",
    "torch_function_mode_enabled",
]

is_functorch_wrapped_tensor = torch._C._functorch.is_functorch_wrapped_tensor
torch_function_mode_enabled = torch._C._is_torch_function_mode_enabled
dispatch_stack_len = torch._C._len_torch_dispatch_stack
DisableTorchFunctionSubclass = torch._C.DisableTorchFunctionSubclass
DISABLED_TORCH_FUNCTION = torch._C._disabled_torch_function_impl
parse_to = torch._C._nn._parse_to
make_subclass = torch.Tensor._make_subclass
