"""q4torch.nn.Linear4bit: bitsandbytes compatibility, copying and reload."""

import copy
import gc
import pickle
import weakref

import bitsandbytes as bnb
import pytest
import torch
from q4_reference import inputs
from q4_reference.matmul import rel_err

import q4torch.functional as q4f
from q4torch.nn import Linear4bit, LinearFP4, LinearNF4, Params4bit

VARIANTS = [("nf4", True), ("nf4", False), ("fp4", True), ("fp4", False)]


def _pair(rng, quant_type, nested, n=48, k=128, bias=True, quant_storage=torch.uint8):
    """A q4 layer and a bitsandbytes layer with the same float weights, both quantized."""
    w = torch.from_numpy(inputs.make(rng, (n, k), "float32")) * 0.1
    b = torch.from_numpy(inputs.make(rng, (n,), "float32"))
    layers = []
    for cls in (Linear4bit, bnb.nn.Linear4bit):
        layer = cls(k, n, bias=bias, compress_statistics=nested, quant_type=quant_type, quant_storage=quant_storage)
        layer.weight.data = w.clone()
        if bias:
            layer.bias.data = b.clone()
        layers.append(layer.to("cpu"))
    return layers[0], layers[1], w


@pytest.mark.parametrize("quant_type, nested", VARIANTS)
def test_same_bytes_and_outputs_as_bitsandbytes(rng, quant_type, nested):
    ours, theirs, w = _pair(rng, quant_type, nested)
    assert torch.equal(ours.weight.data, theirs.weight.data)
    x = torch.from_numpy(inputs.make(rng, (5, 128), "float32"))
    # both compute x . dequantize(W)^T + b in fp32, in different orders
    want = (
        x.double() @ bnb.functional.dequantize_4bit(theirs.weight.data, theirs.weight.quant_state).double().t()
        + theirs.bias.detach().double()
    )
    assert rel_err(ours(x).detach().numpy(), want.numpy()) < 1e-6
    assert rel_err(theirs(x).detach().numpy(), want.numpy()) < 1e-5


@pytest.mark.parametrize("quant_type, nested", VARIANTS)
def test_checkpoints_interchange_with_bitsandbytes(rng, quant_type, nested):
    ours, theirs, _ = _pair(rng, quant_type, nested)
    x = torch.from_numpy(inputs.make(rng, (3, 128), "float32"))
    # bitsandbytes -> q4 (strict): the same layer as quantizing in q4
    sd = theirs.state_dict()
    snapshot = {k: v.clone() for k, v in sd.items()}
    fresh = Linear4bit(128, 48, quant_type="fp4" if quant_type == "nf4" else "nf4")  # overwritten by the checkpoint
    fresh.load_state_dict(sd, strict=True)
    assert fresh.weight.quant_type == quant_type and fresh.weight.quant_state.nested == nested
    assert torch.equal(fresh.weight.data, ours.weight.data)
    if not nested:
        assert torch.equal(fresh(x), ours(x))
    assert all(torch.equal(sd[k], snapshot[k]) for k in sd), "the caller's state dict was modified"
    # q4 -> bitsandbytes: same keys, same JSON layout; bitsandbytes reads the state
    ours_sd = ours.state_dict()
    assert sorted(ours_sd) == sorted(sd)
    qs = bnb.functional.QuantState.from_dict(
        {k[len("weight.") :]: v for k, v in ours_sd.items() if k.startswith("weight.")}, device="cpu"
    )
    assert torch.equal(
        bnb.functional.dequantize_4bit(ours_sd["weight"], qs),
        q4f.dequantize_4bit(ours.weight.data, ours.weight.quant_state),
    )


def test_strict_reload_of_own_state_dict(rng):
    ours, _, _ = _pair(rng, "nf4", True)
    again = Linear4bit(128, 48)
    result = again.load_state_dict(ours.state_dict(), strict=True)
    assert not result.missing_keys and not result.unexpected_keys
    x = torch.from_numpy(inputs.make(rng, (2, 128), "float32"))
    assert torch.equal(again(x), ours(x))


@pytest.mark.parametrize("quant_type, nested", VARIANTS)
@pytest.mark.parametrize("when", ["before", "after"])
def test_deepcopy(rng, quant_type, nested, when):
    w = torch.from_numpy(inputs.make(rng, (32, 64), "float32"))
    original = Linear4bit(64, 32, quant_type=quant_type, compress_statistics=nested)
    original.weight.data = w.clone()
    if when == "after":
        original.to("cpu")
    clone = copy.deepcopy(original)
    assert clone.weight.module is clone
    if when == "before":
        clone.to("cpu")
        assert original.quant_state is None and not original.weight.bnb_quantized
        original.to("cpu")
    assert clone.quant_state is clone.weight.quant_state
    assert clone.weight.data.data_ptr() != original.weight.data.data_ptr()
    assert clone.weight.quant_state is not original.weight.quant_state
    assert clone.weight.quant_state.absmax.data_ptr() != original.weight.quant_state.absmax.data_ptr()
    assert torch.equal(clone.weight.data, original.weight.data)
    # identical outputs, input gradients and bias updates over a few SGD steps
    opts = [torch.optim.SGD([m.bias], lr=0.1) for m in (original, clone)]
    for step in range(3):
        x = torch.from_numpy(inputs.make(rng, (4, 64), "float32")).requires_grad_()
        grads = []
        for m, opt in zip((original, clone), opts, strict=True):
            xi = x.detach().clone().requires_grad_()
            opt.zero_grad()
            m(xi).pow(2).sum().backward()
            opt.step()
            grads.append((xi.grad, m.bias.detach().clone()))
        assert torch.equal(grads[0][0], grads[1][0]) and torch.equal(grads[0][1], grads[1][1]), step
    # the copy does not keep the original alive
    ref = weakref.ref(original)
    del original, opts
    gc.collect()
    assert ref() is None
    assert clone(torch.ones(1, 64)).shape == (1, 32)


def test_copy_and_pickle(rng):
    layer, _, _ = _pair(rng, "nf4", True)
    x = torch.from_numpy(inputs.make(rng, (2, 128), "float32"))
    shallow = copy.copy(layer)
    assert torch.equal(shallow(x), layer(x))
    restored = pickle.loads(pickle.dumps(layer))
    assert torch.equal(restored(x), layer(x))
    assert restored.weight.quant_state is not layer.weight.quant_state
    p = pickle.loads(pickle.dumps(layer.weight))
    assert isinstance(p, Params4bit) and torch.equal(p.data, layer.weight.data) and p.quant_type == "nf4"


@pytest.mark.parametrize("mode", ["cold", "train", "eval"])
def test_reload_after_forward_and_switching(rng, mode):
    a, _, _ = _pair(rng, "nf4", True)
    b, _, _ = _pair(rng, "fp4", False)
    x = torch.from_numpy(inputs.make(rng, (3, 128), "float32"))
    sd_a, sd_b = a.state_dict(), b.state_dict()
    dest = Linear4bit(128, 48)
    if mode != "cold":
        dest.to("cpu")
        dest.train(mode == "train")
        dest(x)
    for src, sd in ((a, sd_a), (b, sd_b), (a, sd_a)):
        snapshot = {k: v.clone() for k, v in sd.items()}
        dest.load_state_dict(sd)
        assert torch.equal(dest(x), src(x))
        resaved = dest.state_dict()
        assert sorted(resaved) == sorted(sd) and all(torch.equal(resaved[k], sd[k]) for k in sd)
        assert all(torch.equal(sd[k], snapshot[k]) for k in sd)


def test_forward_never_changes_parameter_dtypes(rng):
    layer, _, _ = _pair(rng, "nf4", True)
    before = layer.state_dict()
    y = layer(torch.from_numpy(inputs.make(rng, (2, 128), "bfloat16").view("uint16")).view(torch.bfloat16))
    assert y.dtype == torch.bfloat16 and layer.bias.dtype == torch.float32
    after = layer.state_dict()
    assert all(torch.equal(before[k], after[k]) and before[k].dtype == after[k].dtype for k in before)


@pytest.mark.parametrize("storage", [torch.bfloat16, torch.float16, torch.float32, torch.uint8])
def test_quant_storage_round_trip(rng, storage):
    ours, theirs, _ = _pair(rng, "nf4", True, quant_storage=storage)
    assert ours.weight.dtype == storage and theirs.weight.dtype == storage
    assert torch.equal(ours.weight.data.view(torch.uint8), theirs.weight.data.view(torch.uint8))
    again = Linear4bit(128, 48, quant_storage=storage)
    again.load_state_dict(ours.state_dict())
    x = torch.from_numpy(inputs.make(rng, (2, 128), "float32"))
    assert again.weight.dtype == storage and torch.equal(again(x), ours(x))


def test_from_prequantized(rng):
    ours, theirs, _ = _pair(rng, "fp4", True)
    sd = theirs.state_dict()
    stats = {k[len("weight.") :]: v for k, v in sd.items() if k.startswith("weight.")}
    p = Params4bit.from_prequantized(sd["weight"], stats, device="cpu")
    assert p.bnb_quantized and p.quant_type == "fp4" and p.compress_statistics and p.blocksize == 64
    assert p.data.data_ptr() != sd["weight"].data_ptr()
    assert torch.equal(p.data, ours.weight.data)


def test_subclasses_and_explicit_quantize(rng):
    assert LinearNF4(64, 32).weight.quant_type == "nf4" and LinearFP4(64, 32).weight.quant_type == "fp4"
    layer = Linear4bit(64, 32, quant_type="nf4")
    with pytest.raises(RuntimeError, match="not quantized yet"):
        layer(torch.ones(1, 64))
    layer.quantize()
    assert layer.weight.bnb_quantized and layer.quant_state is layer.weight.quant_state


def test_tied_quant_state_stays_shared_in_copies(rng):
    a = Linear4bit(64, 32, quant_type="nf4").to("cpu")
    model = torch.nn.ModuleDict({"a": a})
    model.b = a  # the same layer registered twice
    clone = copy.deepcopy(model)
    assert clone.a is clone.b and clone.a.weight.module is clone.a


def test_bad_input(rng):
    layer, _, _ = _pair(rng, "nf4", True)
    with pytest.raises(ValueError, match="input has 64 features, this layer expects in_features=128"):
        layer(torch.ones(2, 64))
    with pytest.raises(TypeError, match="got torch.int64"):
        layer(torch.ones(2, 128, dtype=torch.int64))
    sd = layer.state_dict()
    bad = dict(sd)
    bad["weight.quant_state.bitsandbytes__nf4"] = sd["weight.quant_state.bitsandbytes__nf4"][:-3]
    with pytest.raises(RuntimeError, match="not valid UTF-8 JSON"):
        Linear4bit(128, 48).load_state_dict(bad)
    bad = {k: v for k, v in sd.items() if k != "weight.absmax"}
    with pytest.raises(RuntimeError, match="missing checkpoint entry 'absmax'"):
        Linear4bit(128, 48).load_state_dict(bad)
    bad = dict(sd)
    bad["weight"] = sd["weight"][:-1]
    with pytest.raises(RuntimeError, match="'weight' has 3071 bytes"):
        Linear4bit(128, 48).load_state_dict(bad)
    with pytest.raises(RuntimeError, match=r"quant_state shape \(48, 128\) does not match this layer's \(48, 64\)"):
        Linear4bit(64, 48).load_state_dict(sd)


def test_compile_fullgraph_inference_and_training(rng):
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        Linear4bit(64, 64, quant_type="nf4"), torch.nn.Tanh(), Linear4bit(64, 32, quant_type="fp4")
    ).to("cpu")
    x = torch.from_numpy(inputs.make(rng, (4, 64), "float32"))
    # (inductor evaluates tanh with its own code: equal to eager within fp32 rounding)
    torch.testing.assert_close(torch.compile(model, fullgraph=True)(x), model(x), rtol=1e-5, atol=1e-6)

    def step(inp):
        return model(inp).pow(2).sum()

    torch.compile(step, fullgraph=True)(x).backward()
    compiled = [p.grad.clone() for p in (model[0].bias, model[2].bias)]
    model.zero_grad()
    step(x).backward()
    for c, p in zip(compiled, (model[0].bias, model[2].bias), strict=True):
        torch.testing.assert_close(c, p.grad, rtol=1e-5, atol=1e-5)
