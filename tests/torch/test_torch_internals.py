"""The private PyTorch functions q4torch relies on (q4torch/_src/torch_internals.py)
still mean what the eager path and the parameters take them to mean: each is
checked on a case where it must hold and one where it must not, so a torch
upgrade that changes one fails here."""

from __future__ import annotations

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from q4torch._src import torch_internals as ti
from q4torch.nn import Int8Params, Params4bit


class _PassFunctions(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


class _PassDispatch(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


def test_functorch_wrapped_tensor():
    seen = []

    def f(t):
        seen.append(ti.is_functorch_wrapped_tensor(t))
        return t.sum()

    x = torch.ones(3)
    torch.func.grad(f)(x)
    torch.func.vmap(f)(torch.ones(2, 3))
    assert seen == [True, True]
    assert ti.is_functorch_wrapped_tensor(x) is False
    assert ti.is_functorch_wrapped_tensor(torch.ones(3, requires_grad=True)) is False


def test_torch_function_mode_enabled():
    assert ti.torch_function_mode_enabled() is False
    with _PassFunctions():
        assert ti.torch_function_mode_enabled() is True
    assert ti.torch_function_mode_enabled() is False
    with torch.inference_mode(), torch.no_grad():  # autograd modes are not torch function modes
        assert ti.torch_function_mode_enabled() is False


def test_dispatch_stack_len():
    assert ti.dispatch_stack_len() == 0
    with _PassDispatch():
        assert ti.dispatch_stack_len() == 1
        with _PassDispatch():
            assert ti.dispatch_stack_len() == 2
    assert ti.dispatch_stack_len() == 0
    with torch.inference_mode():
        assert ti.dispatch_stack_len() == 0


class _Counting(torch.Tensor):
    calls = 0

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        cls.calls += 1
        return super().__torch_function__(func, types, args, kwargs or {})


def test_disable_torch_function_subclass():
    t = torch.ones(4).as_subclass(_Counting)
    _Counting.calls = 0
    assert type(t.reshape(-1)) is _Counting and _Counting.calls > 0
    _Counting.calls = 0
    with ti.DisableTorchFunctionSubclass():
        r = t.reshape(-1)
        assert t.is_cpu and t.is_contiguous() and t.data_ptr() == r.data_ptr()
    assert _Counting.calls == 0 and type(r) is torch.Tensor


def test_disabled_torch_function():
    """nn.Parameter's (and Int8Params') torch function is the disabled one;
    torch.Tensor's and Params4bit's (its own) are not."""
    assert torch.nn.Parameter.__torch_function__ is ti.DISABLED_TORCH_FUNCTION
    assert Int8Params.__torch_function__ is ti.DISABLED_TORCH_FUNCTION
    assert torch.Tensor.__torch_function__ is not ti.DISABLED_TORCH_FUNCTION
    assert Params4bit.__torch_function__ is not ti.DISABLED_TORCH_FUNCTION
    p = torch.nn.Parameter(torch.ones(2))
    assert type(p + 1) is torch.Tensor  # disabled: results are plain tensors


def test_parse_to():
    assert ti.parse_to("cpu") == (torch.device("cpu"), None, False, None)
    assert ti.parse_to(torch.bfloat16) == (None, torch.bfloat16, False, None)
    got = ti.parse_to(device="cpu", dtype=torch.float16, non_blocking=True)
    assert got == (torch.device("cpu"), torch.float16, True, None)
    assert ti.parse_to(torch.ones(1, dtype=torch.float64))[:2] == (torch.device("cpu"), torch.float64)


def test_make_subclass():
    data = torch.arange(4.0)
    p = ti.make_subclass(torch.nn.Parameter, data, False)
    assert type(p) is torch.nn.Parameter and not p.requires_grad
    assert p.data_ptr() == data.data_ptr()
    q = ti.make_subclass(torch.nn.Parameter, data, True)
    assert q.requires_grad and not data.requires_grad
