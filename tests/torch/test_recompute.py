"""Recompute under activation checkpointing with streamed weights.

A streaming caller (as weight offloading does) keeps each layer's packed
bytes at home and, in a forward pre-hook, copies them into the next buffer of
a small recycled pool and rebinds the layer's weight to it. Buffers are handed
out round-robin by call count, so a layer recomputed during backward lands in
a different buffer than in its first forward. Gradients must equal, bit for
bit, those of the same model where every layer owns its weight: the backward
has to use what the recompute saw (save_for_backward), never a reference taken
during the first forward. A deliberately wrong autograd Function (weight kept
as a ctx attribute) shows that the harness catches the difference.
"""

import pytest
import torch
from q4_reference import inputs
from torch.utils.checkpoint import checkpoint

from q4torch._src import eager, ops
from q4torch.nn import Linear4bit, Params4bit

LAYERS, WIDTH = 5, 64


class Pool:
    """Round-robin buffers; `bind` copies a layer's home bytes into the next one."""

    def __init__(self, size: int, like: torch.Tensor):
        self.buffers = [torch.empty_like(like) for _ in range(size)]
        self.calls = 0

    def next(self) -> torch.Tensor:
        buf = self.buffers[self.calls % len(self.buffers)]
        self.calls += 1
        return buf


def _model(rng, dtype, nested=True):
    torch.manual_seed(0)
    layers = torch.nn.ModuleList()
    for _ in range(LAYERS):
        layer = Linear4bit(WIDTH, WIDTH, bias=False, quant_type="nf4", compute_dtype=dtype, compress_statistics=nested)
        layer.weight.data = torch.from_numpy(inputs.make(rng, (WIDTH, WIDTH), "float32")) * 0.2
        layers.append(layer.to("cpu"))
    upstream = torch.nn.Parameter(torch.from_numpy(inputs.make(rng, (WIDTH,), "float32")))
    return layers, upstream


def _stream(layers, pool_size):
    """Move every layer's bytes home and install the streaming pre-hooks."""
    homes = [layer.weight.data.clone() for layer in layers]
    pool = Pool(pool_size, homes[0])

    def make_hook(i):
        def hook(module, args):
            buf = pool.next()
            with torch.no_grad():
                buf.copy_(homes[i])
            module.weight = Params4bit(
                buf, quant_state=module.quant_state, quant_type="nf4", module=module, bnb_quantized=True
            )

        return hook

    for i, layer in enumerate(layers):
        layer.weight = Params4bit(torch.zeros_like(homes[i]), quant_state=layer.quant_state, bnb_quantized=True)
        layer.register_forward_pre_hook(make_hook(i))


def _loss(layers, upstream, x, reentrant, layer_fn=None):
    h = x * upstream
    for layer in layers:
        fn = layer if layer_fn is None else (lambda t, layer=layer: layer_fn(layer, t))
        h = torch.tanh(checkpoint(fn, h, use_reentrant=reentrant))
    return (h.float() ** 2).sum()


def _grad(layers, upstream, x, reentrant, layer_fn=None):
    upstream.grad = None
    _loss(layers, upstream, x, reentrant, layer_fn).backward()
    return upstream.grad.clone()


def _node_names(node) -> set:
    """The class names of an autograd graph's nodes."""
    names, todo = set(), [node]
    while todo:
        node = todo.pop()
        if node is not None and type(node).__name__ not in names:
            names.add(type(node).__name__)
            todo.extend(next_node for next_node, _ in node.next_functions)
    return names


@pytest.fixture(params=["direct", "op"])
def path(request, monkeypatch):
    """The layers' two autograd paths: eager CPU calls record their own node
    (eager.EagerGemm4bit); with the direct call turned off, the q4::gemm_4bit
    op's autograd. Both save the weight with save_for_backward."""
    if request.param == "op":
        monkeypatch.setattr(eager, "matmul_4bit", lambda *args: None)
    return "EagerGemm4bitBackward" if request.param == "direct" else "GeneratedBackwardFor_q4_gemm_4bit_defaultBackward"


@pytest.mark.parametrize("reentrant", [False, True])
@pytest.mark.parametrize("pool_size", [1, 2, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_streamed_gradients_bit_identical(rng, reentrant, pool_size, dtype, path):
    x = torch.from_numpy(inputs.make(rng, (4, WIDTH), "float32")).to(dtype)
    layers, upstream = _model(rng, dtype)
    assert path in _node_names(layers[0](x * upstream).grad_fn)
    owned = _grad(layers, upstream, x, reentrant)
    _stream(layers, pool_size)
    streamed = _grad(layers, upstream, x, reentrant)
    assert torch.equal(owned, streamed)


@pytest.mark.parametrize("reentrant", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dense_control_arm(rng, reentrant, dtype):
    """Dense layers through the same harness (their weights are streamed the same way)."""
    torch.manual_seed(0)
    layers = torch.nn.ModuleList(torch.nn.Linear(WIDTH, WIDTH, bias=False).to(dtype) for _ in range(LAYERS))
    for layer in layers:
        layer.weight.requires_grad_(False)
    upstream = torch.nn.Parameter(torch.from_numpy(inputs.make(rng, (WIDTH,), "float32")).to(dtype))
    x = torch.from_numpy(inputs.make(rng, (4, WIDTH), "float32")).to(dtype)
    owned = _grad(layers, upstream, x, reentrant)
    homes = [layer.weight.detach().clone() for layer in layers]
    pool = Pool(2, homes[0])

    def make_hook(i):
        def hook(module, args):
            buf = pool.next()
            buf.copy_(homes[i])
            module.weight = torch.nn.Parameter(buf, requires_grad=False)

        return hook

    for i, layer in enumerate(layers):
        layer.register_forward_pre_hook(make_hook(i))
    assert torch.equal(owned, _grad(layers, upstream, x, reentrant))


class _WeightOnCtx(torch.autograd.Function):
    """The anti-pattern: the packed weight kept as a ctx attribute."""

    @staticmethod
    def forward(ctx, x, packed, quant_state):
        ctx.packed, ctx.quant_state = packed, quant_state
        n, k = quant_state.shape
        return ops.gemm_4bit(x, packed.reshape(-1), quant_state.absmax, None, None, n, k, 64, "nf4", None)

    @staticmethod
    def backward(ctx, grad):
        n, k = ctx.quant_state.shape
        packed = ctx.packed.reshape(-1)
        return ops.gemm_4bit_grad_input(grad, packed, ctx.quant_state.absmax, None, None, n, k, 64, "nf4"), None, None


def test_harness_catches_weight_kept_on_ctx(rng, path):
    """Under non-reentrant checkpointing the backward runs on the first forward's
    autograd nodes with recomputed saved tensors; a weight kept on ctx is the
    first forward's buffer, which the pool has since refilled."""
    x = torch.from_numpy(inputs.make(rng, (4, WIDTH), "float32"))
    layers, upstream = _model(rng, torch.float32, nested=False)  # plain absmax for the hand-written Function

    def bad(layer, h):
        return _WeightOnCtx.apply(h, layer.weight, layer.quant_state)

    owned_bad = _grad(layers, upstream, x, False, bad)
    owned_good = _grad(layers, upstream, x, False)
    assert torch.equal(owned_bad, owned_good)  # without streaming the two agree
    _stream(layers, 2)
    assert torch.equal(_grad(layers, upstream, x, False), owned_good)  # save_for_backward: still right
    assert not torch.equal(_grad(layers, upstream, x, False, bad), owned_good)  # ctx attribute: wrong
