"""matmul_4bit's and int8_linear's direct CPU calls (eager mode, nothing
recording): they return the q4::gemm_4bit / q4::int8_linear op's bytes, are
taken only where nothing needs the dispatcher, and matmul_4bit's cache of
validated weight arguments never goes stale -- every change to the weight's
bytes, scales or state is seen by the next call.

The op's result (the reference here) is what every other path computes and
what the kernel tests check against the fp64 oracle."""

from __future__ import annotations

import pytest
import torch
from q4_reference import inputs

from q4torch import functional as F
from q4torch._src import eager, ops
from q4torch.nn import Int8Params, Linear4bit, Linear8bitLt


def _weight(rng, n=64, k=256, blocksize=64, nested=True, quant_type="nf4"):
    w = torch.from_numpy(inputs.make(rng, (n, k), "float32"))
    return F.quantize_4bit(w, blocksize=blocksize, compress_statistics=nested, quant_type=quant_type)


def _op(x, packed, qs, bias=None):
    """The q4::gemm_4bit op itself, through the dispatcher."""
    return torch.ops.q4.gemm_4bit(x, *F._weight_operands(packed.view(torch.uint8).reshape(-1), qs), bias)


def _count_calls(monkeypatch, name):
    """Counts calls of the op ops.<name> made through functional."""
    calls = []
    real = getattr(ops, name)

    def counting(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(F.ops, name, counting)
    return calls


@pytest.fixture
def op_calls(monkeypatch):
    """Counts calls of the q4::gemm_4bit op made by matmul_4bit."""
    return _count_calls(monkeypatch, "gemm_4bit")


# the autograd modes a layer runs in: only "grad" records
MODES = {"inference_mode": torch.inference_mode, "no_grad": torch.no_grad, "grad": torch.enable_grad}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("nested", [True, False], ids=["nested", "plain"])
@pytest.mark.parametrize("shape", [(1,), (5,), (2, 3)], ids=["1", "5", "2x3"])
def test_direct_call_gives_the_op_bytes(rng, op_calls, dtype, nested, shape):
    packed, qs = _weight(rng, nested=nested)
    x = torch.from_numpy(inputs.make(rng, (*shape, 256), "float32")).to(dtype)
    bias = torch.from_numpy(inputs.make(rng, (64,), "float32")).to(dtype)
    for b in (None, bias):
        with torch.inference_mode():
            got = F.matmul_4bit(x, packed.t(), qs, bias=b)
        assert op_calls == [], "the direct call was not taken"
        want = _op(x, packed, qs, b)
        assert got.dtype == want.dtype and got.shape == want.shape
        assert torch.equal(got, want)


def test_direct_call_under_no_grad_and_without_grad_inputs(rng, op_calls):
    packed, qs = _weight(rng)
    x = torch.from_numpy(inputs.make(rng, (3, 256), "float32"))
    with torch.no_grad():
        a = F.matmul_4bit(x, packed.t(), qs)
    b = F.matmul_4bit(x, packed.t(), qs)  # grad enabled, but nothing requires grad
    assert op_calls == []
    assert torch.equal(a, _op(x, packed, qs)) and torch.equal(b, a)


def _op_with_grads(x, packed, qs, bias, g, activation_quant=None):
    """The op's forward and gradients (x, bias) through its own autograd."""
    op = torch.ops.q4.gemm_4bit if activation_quant is None else torch.ops.q4.gemm_4bit_w4a8
    xr = x.detach().clone().requires_grad_(True)
    br = None if bias is None else bias.detach().clone().requires_grad_(bias.requires_grad)
    y = op(xr, *F._weight_operands(packed.view(torch.uint8).reshape(-1), qs), br)
    assert type(y.grad_fn).__name__ != "EagerGemm4bitBackward"
    y.backward(g)
    return y.detach(), xr.grad, None if br is None else br.grad


@pytest.fixture
def grad_op_calls(monkeypatch):
    """Counts calls of the q4::gemm_4bit_grad_input op made by the backward."""
    return _count_calls(monkeypatch, "gemm_4bit_grad_input")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("nested", [True, False], ids=["nested", "plain"])
@pytest.mark.parametrize("bias_grad", [None, False, True], ids=["no-bias", "frozen-bias", "bias-grad"])
@pytest.mark.parametrize("activation_quant", [None, "int8"])
def test_recording_call_gives_the_op_bytes_and_gradients(
    rng, op_calls, grad_op_calls, dtype, nested, bias_grad, activation_quant
):
    """With x (or the bias) requiring grad, an eager CPU call records its own
    autograd node (eager.EagerGemm4bit) instead of dispatching the op: the
    output, dX and dBias are the op's, bit for bit, and neither op runs."""
    packed, qs = _weight(rng, nested=nested)
    x = torch.from_numpy(inputs.make(rng, (2, 3, 256), "float32")).to(dtype)
    bias = None
    if bias_grad is not None:
        bias = torch.from_numpy(inputs.make(rng, (64,), "float32")).to(dtype).requires_grad_(bias_grad)
    g = torch.from_numpy(inputs.make(rng, (2, 3, 64), "float32")).to(dtype)
    want_y, want_dx, want_db = _op_with_grads(x, packed, qs, bias, g, activation_quant)
    op_calls.clear(), grad_op_calls.clear()
    xg = x.clone().requires_grad_(True)
    y = F.matmul_4bit(xg, packed.t(), qs, bias=bias, activation_quant=activation_quant)
    assert type(y.grad_fn).__name__ == "EagerGemm4bitBackward"
    y.backward(g)
    assert op_calls == [] and grad_op_calls == [], "an op was dispatched"
    assert torch.equal(y.detach(), want_y)
    assert xg.grad.dtype == dtype and torch.equal(xg.grad, want_dx)
    if bias_grad:
        assert bias.grad.dtype == dtype and torch.equal(bias.grad, want_db)
    elif bias is not None:
        assert bias.grad is None
    # only the bias requires grad: dX is not computed
    if bias_grad:
        bias.grad = None
        F.matmul_4bit(x, packed.t(), qs, bias=bias, activation_quant=activation_quant).backward(g)
        assert grad_op_calls == [] and torch.equal(bias.grad, want_db)


@pytest.mark.parametrize("direct", [True, False], ids=["direct", "op"])
@pytest.mark.parametrize("kind", ["4bit", "int8"])
def test_second_derivatives_are_refused_on_both_paths(rng, monkeypatch, direct, kind):
    """Neither path has a second derivative: differentiating the gradient
    raises (a recording backward of the direct node calls the op), never a
    silent zero beside another term that reaches x."""
    if not direct:
        monkeypatch.setattr(eager, "eager_cpu", lambda *args, **kwargs: False)
    x = torch.from_numpy(inputs.make(rng, (3, 256), "float32")).requires_grad_(True)
    if kind == "4bit":
        packed, qs = _weight(rng)
        y, node = F.matmul_4bit(x, packed.t(), qs), "EagerGemm4bitBackward"
    else:
        layer = _int8_layer(rng, 0.0)
        y, node = F.int8_linear(x, layer.weight, layer.weight.SCB), "EagerInt8LinearBackward"
    assert (type(y.grad_fn).__name__ == node) == direct
    (gx,) = torch.autograd.grad((y**2).sum(), x, create_graph=True)
    assert gx.requires_grad
    with pytest.raises(RuntimeError, match="no autograd formula"):
        torch.autograd.grad(gx.sum() + (x**2).sum(), x)


def test_modes_and_transforms_take_the_op(rng, op_calls, grad_op_calls):
    """A dispatch mode sees q4.gemm_4bit (forward) and q4.gemm_4bit_grad_input
    (a backward run under it); functorch's transforms take the op (which
    refuses them: one error, whichever path a call would take)."""
    packed, qs = _weight(rng)
    x = torch.from_numpy(inputs.make(rng, (3, 256), "float32"))
    xg = x.clone().requires_grad_(True)
    F.matmul_4bit(xg, packed.t(), qs).sum().backward()
    assert op_calls == [] and grad_op_calls == []

    from torch.utils._python_dispatch import TorchDispatchMode

    seen = []

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.append(str(func))
            return func(*args, **(kwargs or {}))

    with Record():
        F.matmul_4bit(x.clone().requires_grad_(True), packed.t(), qs)
    assert len(op_calls) == 1 and any("q4.gemm_4bit" in s for s in seen)
    # the direct call's backward under a dispatch mode: the op, seen by the mode
    seen.clear()
    y2 = F.matmul_4bit(x.clone().requires_grad_(True), packed.t(), qs)
    with Record():
        y2.sum().backward()
    assert len(grad_op_calls) == 1 and any("q4.gemm_4bit_grad_input" in s for s in seen)

    # functorch's transforms: the op (which does not support them: its error, not the direct call's)
    with pytest.raises(RuntimeError, match="functorch"):
        torch.func.grad(lambda t: F.matmul_4bit(t, packed.t(), qs).sum())(x)
    assert len(op_calls) == 2


def test_recording_call_saves_the_weight_for_backward(rng):
    """The direct call's node saves the weight's tensors as the op's does: a
    weight changed in place between forward and backward is an error, not a
    silently wrong gradient."""
    packed, qs = _weight(rng)
    x = torch.from_numpy(inputs.make(rng, (3, 256), "float32")).requires_grad_(True)
    y = F.matmul_4bit(x, packed.t(), qs)
    assert type(y.grad_fn).__name__ == "EagerGemm4bitBackward"
    with torch.no_grad():
        packed.view(torch.uint8).add_(1)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.sum().backward()


def _fresh_equal(x, packed, qs):
    with torch.inference_mode():
        got = F.matmul_4bit(x, packed.t(), qs)
    assert torch.equal(got, _op(x, packed, qs))
    return got


def test_in_place_changes_are_seen(rng):
    """Bytes, absmax codes, nested absmax and the offset changed in place (as
    load_state_dict's copy_ does) reach the next call."""
    packed, qs = _weight(rng)
    x = torch.from_numpy(inputs.make(rng, (2, 256), "float32"))
    first = _fresh_equal(x, packed, qs)
    other_packed, other = _weight(rng)
    results = [first]
    with torch.no_grad():
        packed.copy_(other_packed)
        results.append(_fresh_equal(x, packed, qs))
        qs.absmax.copy_(other.absmax)
        results.append(_fresh_equal(x, packed, qs))
        qs.state2.absmax.mul_(2)
        results.append(_fresh_equal(x, packed, qs))
        qs.offset.add_(0.25)
        results.append(_fresh_equal(x, packed, qs))
    for a, b in zip(results, results[1:], strict=False):
        assert not torch.equal(a, b)


def test_replaced_tensors_and_fields_are_seen(rng):
    packed, qs = _weight(rng)
    x = torch.from_numpy(inputs.make(rng, (2, 256), "float32"))
    first = _fresh_equal(x, packed, qs)
    other_packed, other = _weight(rng)
    qs.offset = other.offset.clone()
    second = _fresh_equal(x, packed, qs)
    assert not torch.equal(first, second)
    qs.absmax, qs.state2, qs.offset = other.absmax, other.state2, other.offset
    third = _fresh_equal(x, other_packed, qs)
    assert torch.equal(third, _op(x, other_packed, other))
    # a field made invalid is refused with its value, not served from the cache
    qs.blocksize = 48
    with torch.inference_mode(), pytest.raises(ValueError, match="48"):
        F.matmul_4bit(x, other_packed.t(), qs)
    qs.blocksize = 128
    with torch.inference_mode(), pytest.raises(ValueError, match="absmax"):
        F.matmul_4bit(x, other_packed.t(), qs)


def test_bad_inputs_are_refused_on_the_direct_call(rng):
    packed, qs = _weight(rng)
    with torch.inference_mode():
        with pytest.raises(ValueError, match="255 features"):
            F.matmul_4bit(torch.zeros(1, 255), packed.t(), qs)
        with pytest.raises(TypeError, match="int32"):
            F.matmul_4bit(torch.zeros(1, 256, dtype=torch.int32), packed.t(), qs)
        with pytest.raises(ValueError, match=r"bias must have shape \(64,\)"):
            F.matmul_4bit(torch.zeros(1, 256), packed.t(), qs, bias=torch.zeros(63))
        # no rows is not an error (bitsandbytes returns an empty result too)
        assert F.matmul_4bit(torch.zeros(0, 256), packed.t(), qs).shape == (0, 64)


def test_layer_in_eval_inference_mode_equals_the_op(rng, op_calls):
    w = torch.from_numpy(inputs.make(rng, (64, 256), "float32"))
    layer = Linear4bit(256, 64, bias=True, compute_dtype=torch.bfloat16, quant_type="nf4", compress_statistics=True)
    layer.weight.data = w
    layer = layer.to("cpu").eval()
    x = torch.from_numpy(inputs.make(rng, (4, 256), "float32")).bfloat16()
    with torch.inference_mode():
        got = layer(x)
    assert op_calls == []
    packed, qs = layer.packed_weight()
    assert torch.equal(got, _op(x, packed, qs, layer.bias.bfloat16()))
    # reloading a different checkpoint into the same layer is seen
    other = Linear4bit(256, 64, bias=True, compute_dtype=torch.bfloat16, quant_type="nf4", compress_statistics=True)
    other.weight.data = torch.from_numpy(inputs.make(rng, (64, 256), "float32"))
    other = other.to("cpu")
    layer.load_state_dict(other.state_dict())
    with torch.inference_mode():
        assert torch.equal(layer(x), other.eval()(x))
        assert not torch.equal(layer(x), got)


@pytest.mark.parametrize("mode", list(MODES))
def test_layer_bias_parameter_takes_the_direct_call(rng, op_calls, mode):
    """A layer whose bias needs no conversion passes its nn.Parameter as it
    is: the direct call takes it (the same bytes as the op) in every mode,
    recording its own node when autograd needs the bias' gradient."""
    layer = Linear4bit(256, 64, bias=True, quant_type="nf4", compress_statistics=True)
    layer.weight.data = torch.from_numpy(inputs.make(rng, (64, 256), "float32"))
    layer = layer.to("cpu").eval()
    assert type(layer.bias) is torch.nn.Parameter and layer.bias.requires_grad
    x = torch.from_numpy(inputs.make(rng, (3, 256), "float32"))
    with MODES[mode]():
        got = layer(x)
    assert op_calls == []
    assert got.requires_grad == (mode == "grad")
    packed, qs = layer.packed_weight()
    assert torch.equal(got.detach(), _op(x, packed, qs, layer.bias.detach()))
    if mode == "grad":
        got.sum().backward()
        assert torch.equal(layer.bias.grad, torch.full((64,), 3.0))


def test_inference_tensors_changed_in_place_are_seen(rng):
    """A weight quantized under inference_mode (tensors without a version
    counter) and changed in place there: every call sees the current values."""
    with torch.inference_mode():
        packed, qs = _weight(rng)
        x = torch.from_numpy(inputs.make(rng, (2, 256), "float32"))
        first = F.matmul_4bit(x, packed.t(), qs)
        qs.offset.add_(0.5)
        second = F.matmul_4bit(x, packed.t(), qs)
        other_packed, other = _weight(rng)
        packed.copy_(other_packed)
        third = F.matmul_4bit(x, packed.t(), qs)
        assert not torch.equal(first, second) and not torch.equal(second, third)
        assert torch.equal(third, _op(x, packed, qs))


@pytest.fixture
def int8_op_calls(monkeypatch):
    """Counts calls of the q4::int8_linear op made by int8_linear."""
    return _count_calls(monkeypatch, "int8_linear")


def _int8_layer(rng, threshold):
    layer = Linear8bitLt(256, 64, bias=True, has_fp16_weights=False, threshold=threshold)
    w = torch.from_numpy(inputs.make(rng, (64, 256), "float32"))
    layer.weight = Int8Params(w, requires_grad=False, has_fp16_weights=False)
    layer.bias.data = torch.from_numpy(inputs.make(rng, (64,), "float32"))
    return layer.to("cpu").eval()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("threshold", [0.0, 1.5])
@pytest.mark.parametrize("mode", list(MODES))
def test_int8_layer_direct_call_gives_the_op_bytes(rng, int8_op_calls, monkeypatch, dtype, threshold, mode):
    """Linear8bitLt passes its Int8Params, SCB and nn.Parameter bias as they
    are: the direct call runs in every mode (the op's bytes, outlier columns
    included), recording its own node (eager.EagerInt8Linear) where autograd
    needs it, whose dX and dBias are the op's autograd's, bit for bit."""
    layer = _int8_layer(rng, threshold)
    x = torch.from_numpy(inputs.make(rng, (5, 256), "float32")).to(dtype)
    x[:, 7] = 3.0  # an outlier column at threshold 1.5
    xg = x.clone().requires_grad_(True)
    grad_calls = _count_calls(monkeypatch, "int8_grad_input")
    with MODES[mode]():
        got = layer(xg)
    assert int8_op_calls == []
    weight, scb = layer.weight.detach(), layer.weight.SCB
    xr = x.clone().requires_grad_(True)
    br = layer.bias.detach().clone().requires_grad_(True)
    want = torch.ops.q4.int8_linear(xr, weight, scb, threshold, br)
    assert got.dtype == want.dtype and torch.equal(got.detach(), want.detach())
    if mode == "grad":
        g = torch.from_numpy(inputs.make(rng, (5, 64), "float32")).to(dtype)
        got.backward(g)
        want.backward(g)
        assert len(grad_calls) == 1, "only the op's own backward dispatches q4::int8_grad_input"
        assert torch.equal(xg.grad, xr.grad) and torch.equal(layer.bias.grad, br.grad)


def test_int8_recording_call_saves_the_weight_for_backward(rng):
    """As the 4-bit node: CB changed in place between forward and backward is an error."""
    layer = _int8_layer(rng, 0.0)
    x = torch.from_numpy(inputs.make(rng, (3, 256), "float32")).requires_grad_(True)
    y = layer(x)
    assert type(y.grad_fn).__name__ == "EagerInt8LinearBackward"
    with torch.no_grad():
        layer.weight.add_(1)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.sum().backward()


def test_int8_direct_call_refuses_bad_inputs(rng):
    layer = _int8_layer(rng, 0.0)
    with torch.inference_mode():
        with pytest.raises(ValueError, match="255 features"):
            layer(torch.zeros(1, 255))
        with pytest.raises(TypeError, match="int32"):
            F.int8_linear(torch.zeros(1, 256, dtype=torch.int32), layer.weight, layer.weight.SCB)
        with pytest.raises(ValueError, match=r"bias must have shape \(64,\)"):
            F.int8_linear(torch.zeros(1, 256), layer.weight, layer.weight.SCB, bias=torch.zeros(63))


def _layer(rng, bias=True, dtype=torch.float32, cls=Linear4bit):
    layer = cls(256, 64, bias=bias, quant_type="nf4", compress_statistics=True)
    layer.weight.data = torch.from_numpy(inputs.make(rng, (64, 256), "float32"))
    if bias:
        layer.bias.data = torch.from_numpy(inputs.make(rng, (64,), "float32"))
    return layer.to("cpu").to(dtype).eval()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_layer_flat_forward_sees_replaced_parameters(rng, op_calls, monkeypatch, dtype):
    """Linear4bit's flat forward (_eager_forward: parameters read from
    _parameters, no packed_weight call) gives the op's bytes, and a weight or
    bias assigned since the last call is the one used."""
    seen = []
    real = Linear4bit.packed_weight

    def counting(self):
        seen.append(1)
        return real(self)

    monkeypatch.setattr(Linear4bit, "packed_weight", counting)
    layer, other = _layer(rng, dtype=dtype), _layer(rng, dtype=dtype)
    x = torch.from_numpy(inputs.make(rng, (3, 256), "float32")).to(dtype)

    def check():
        with torch.inference_mode():
            got = layer(x)
        packed = layer._parameters["weight"]
        bias = layer._parameters["bias"]
        assert torch.equal(got, _op(x, packed, packed.quant_state, None if bias is None else bias.detach()))
        return got

    first = check()
    layer.weight = other.weight
    second = check()
    layer.bias = other.bias
    third = check()
    layer.bias = None
    fourth = check()
    assert seen == [] and op_calls == [], "the flat forward was not taken"
    for a, b in zip([first, second, third], [second, third, fourth], strict=True):
        assert not torch.equal(a, b)


def test_layer_flat_forward_agrees_with_the_general_forward(rng, op_calls):
    """A bias of another dtype is cast on a copy (the parameter keeps its
    dtype), as the general forward does; a compute_dtype other than the
    input's and a subclass whose `weight` is a property (not the _parameters
    entry) take the general forward. Every case gives the op's bytes."""
    x = torch.from_numpy(inputs.make(rng, (3, 256), "float32"))
    layer = _layer(rng)
    with torch.inference_mode():
        want_bf16 = _op(x.bfloat16(), layer.weight, layer.weight.quant_state, layer.bias.detach().bfloat16())
        assert torch.equal(layer(x.bfloat16()), want_bf16)  # fp32 bias, bf16 input
        assert layer.bias.dtype == torch.float32
        layer.compute_dtype = torch.bfloat16
        assert torch.equal(layer(x), want_bf16.float())
    assert op_calls == []

    class Swapped(Linear4bit):
        """`weight` is another layer's weight once `swap` is set."""

        @property
        def weight(self):
            swap = self.__dict__.get("swap")
            if swap is not None:
                return swap
            w = self.__dict__["_parameters"].get("weight")
            if w is None:
                raise AttributeError("weight")
            return w

    swapped, other = _layer(rng, cls=Swapped), _layer(rng)
    swapped.__dict__["swap"] = other.weight
    with torch.inference_mode():
        assert torch.equal(swapped(x), _op(x, other.weight, other.weight.quant_state, swapped.bias.detach()))


@pytest.mark.parametrize("kind", ["4bit", "8bit"])
def test_layer_bias_registered_as_a_buffer_is_used(rng, kind):
    """weight_and_bias reads _parameters only where that is what `bias` is: a
    bias deleted and registered again as a buffer still reaches the output."""
    layer = _layer(rng) if kind == "4bit" else _int8_layer(rng, 0.0)
    x = torch.from_numpy(inputs.make(rng, (3, 256), "float32"))
    bias = torch.from_numpy(inputs.make(rng, (64,), "float32"))
    del layer.bias
    layer.register_buffer("bias", bias)
    with torch.inference_mode():
        got = layer(x)
    w = layer.weight
    if kind == "4bit":
        want = _op(x, w, w.quant_state, bias)
    else:
        want = torch.ops.q4.int8_linear(x, w.detach(), w.SCB, 0.0, bias)
    assert torch.equal(got, want)


# ------------------------------------------------ the op body's argument cache


def _op_fresh(x, packed, qs):
    """The op with its cache of validated weight arguments emptied first."""
    ops._WEIGHT_ARGS.clear()
    return _op(x, packed, qs)


def test_op_argument_cache_sees_in_place_changes(rng):
    """The q4::gemm_4bit op (what a compiled model calls) keeps validated
    weight arguments by pointers and sizes: bytes, scales and the offset
    changed in place reach the next call, and each result is the one an
    empty cache gives."""
    packed, qs = _weight(rng)
    x = torch.from_numpy(inputs.make(rng, (2, 256), "float32"))
    other_packed, other = _weight(rng)
    results = []
    with torch.no_grad():
        for change in (
            lambda: None,
            lambda: packed.copy_(other_packed),
            lambda: qs.absmax.copy_(other.absmax),
            lambda: qs.state2.absmax.mul_(2),
            lambda: qs.offset.add_(0.25),
        ):
            change()
            cached = _op(x, packed, qs)
            assert len(ops._WEIGHT_ARGS) >= 1
            assert torch.equal(cached, _op_fresh(x, packed, qs))
            results.append(cached)
    for a, b in zip(results, results[1:], strict=False):
        assert not torch.equal(a, b)


def test_op_argument_cache_serves_a_new_weight_at_a_freed_address(rng):
    """A weight freed and another made in its memory (same sizes) gets the
    new weight's result: an entry holds pointers and sizes, nothing else."""
    x = torch.from_numpy(inputs.make(rng, (1, 256), "float32"))
    for _ in range(4):
        packed, qs = _weight(rng)
        got = _op(x, packed, qs)
        assert torch.equal(got, _op_fresh(x, packed, qs))
        del packed, qs


def test_op_argument_cache_keeps_no_copy_and_still_refuses(rng):
    """Scales read through a contiguous copy are never kept (the copy's
    pointer dies with the call), and a bad offset after a good call is refused
    with a clear error, not read from the cache."""
    packed, qs = _weight(rng, nested=False)
    x = torch.from_numpy(inputs.make(rng, (1, 256), "float32"))
    strided = torch.stack([qs.absmax, qs.absmax], 1)[:, 0]
    assert not strided.is_contiguous()
    ops._WEIGHT_ARGS.clear()
    got = torch.ops.q4.gemm_4bit(x, packed.reshape(-1), strided, None, None, 64, 256, 64, "nf4", None)
    assert len(ops._WEIGHT_ARGS) == 0
    assert torch.equal(got, _op_fresh(x, packed, qs))
    packed, qs = _weight(rng)
    _op(x, packed, qs)
    operands = list(F._weight_operands(packed.reshape(-1), qs))
    operands[3] = torch.zeros(2)
    with pytest.raises(ValueError, match="one-element nested_offset"):
        torch.ops.q4.gemm_4bit(x, *operands, None)
