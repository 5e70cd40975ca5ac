"""q4torch Int8Params / Linear8bitLt: bitsandbytes 0.50.2 compatibility
(quantization, forward accuracy, checkpoints both ways) and the three
behaviours every layer must get right (copying, reload, torch.compile)."""

import copy
import gc
import logging
import pickle
import weakref

import bitsandbytes as bnb
import pytest
import torch
from q4_reference import inputs

from q4torch.nn import Int8Params, Linear8bitLt

THRESHOLDS = pytest.mark.parametrize("threshold", [0.0, 6.0], ids=["thr0", "thr6"])
OUT, IN = 48, 96


@pytest.fixture(autouse=True)
def _quiet_bitsandbytes():
    # bitsandbytes logs a warning on every non-fp16 forward; keep the output readable
    logging.getLogger("bitsandbytes").setLevel(logging.ERROR)


def fp32_linear(rng, out=OUT, inp=IN) -> dict:
    """An fp32 nn.Linear state dict (weight ~ N(0, 0.3^2), bias ~ N(0, 3^2))."""
    w = torch.from_numpy(inputs.make(rng, (out, inp), "float32")) * 0.1
    return {"weight": w, "bias": torch.from_numpy(inputs.make(rng, (out,), "float32"))}


def make_x(rng, dtype=torch.float32, device="cpu", rows=6, inp=IN) -> torch.Tensor:
    """Inputs with one outlier column (|x| >= 12), so threshold 6 takes the fp32 path."""
    x = torch.from_numpy(inputs.make(rng, (rows, inp), "float32"))
    x[:, 5] = torch.where(x[:, 5] >= 0, 12.0, -12.0) + x[:, 5]
    return x.to(device=device, dtype=dtype)


def q4_layer(sd, threshold, device="cpu", bias=True) -> Linear8bitLt:
    layer = Linear8bitLt(IN, OUT, bias=bias, has_fp16_weights=False, threshold=threshold)
    layer.load_state_dict(sd)
    return layer.to(device)


def bnb_layer(sd, threshold) -> bnb.nn.Linear8bitLt:
    layer = bnb.nn.Linear8bitLt(IN, OUT, has_fp16_weights=False, threshold=threshold)
    layer.load_state_dict(sd)
    return layer.to("cpu")


def assert_sd_equal(got: dict, want: dict) -> None:
    """Same keys in the same order, same dtypes and shapes, identical values."""
    assert list(got) == list(want)
    for k in want:
        assert got[k].dtype == want[k].dtype, k
        assert torch.equal(got[k].cpu(), want[k].cpu()), k


def storages(layer) -> set[int]:
    w = layer.weight
    ts = [w, w.SCB, w.CB, layer.bias]
    return {t.untyped_storage().data_ptr() for t in ts if t is not None}


# -------------------------------------------------------- bitsandbytes 0.50.2


@THRESHOLDS
def test_quantization_and_keys_match_bitsandbytes(rng, threshold):
    sd = fp32_linear(rng)
    q, b = q4_layer(sd, threshold), bnb_layer(sd, threshold)
    assert q.weight.dtype == torch.int8 and q.weight.SCB.dtype == torch.float32
    assert torch.equal(q.weight.data, b.weight.data) and torch.equal(q.weight.SCB, b.weight.SCB)
    assert q.weight.CB.data_ptr() == q.weight.data_ptr()
    # identical checkpoint: keys and order, dtypes (weight_format is uint8 0), values
    assert_sd_equal(q.state_dict(), b.state_dict())


@THRESHOLDS
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=["f32", "f16", "bf16"])
def test_forward_accuracy_vs_bitsandbytes(rng, threshold, dtype):
    """Both layers approximate the fp32 layer with the same algorithm (row-wise
    int8 x and W, int32 dot products, outlier columns unquantized); they differ
    only in rounding: bitsandbytes rounds x to fp16 before quantizing it and
    adds the bias in x's dtype. Their relative errors against fp64 agree to
    within ~1.5% (measured over 40 seeds, all dtypes, both thresholds), and are
    ~0.6% themselves, so q4's error must be at most 1.1x bitsandbytes'."""
    sd = fp32_linear(rng)
    x = make_x(rng, dtype, rows=16)
    q, b = q4_layer(sd, threshold).eval(), bnb_layer(sd, threshold).eval()
    ref = x.double() @ sd["weight"].double().T + sd["bias"].double()
    with torch.no_grad():
        yq, yb = q(x), b(x)
    assert yq.dtype == dtype
    err_q = ((yq.double() - ref).norm() / ref.norm()).item()
    err_b = ((yb.double() - ref).norm() / ref.norm()).item()
    assert err_q <= 1.1 * err_b, (err_q, err_b)


@THRESHOLDS
@pytest.mark.parametrize("when", ["before_forward", "after_forward"])
def test_checkpoint_from_bitsandbytes(rng, threshold, when):
    sd = fp32_linear(rng)
    x = make_x(rng)
    b = bnb_layer(sd, threshold)
    if when == "after_forward":
        b(x).sum().backward()
    ckpt = b.state_dict()
    own = q4_layer(sd, threshold)
    for dest in (  # never moved (quantizes nothing), and already quantized from other weights
        Linear8bitLt(IN, OUT, has_fp16_weights=False, threshold=threshold),
        q4_layer(fp32_linear(rng), threshold),
    ):
        dest.load_state_dict(ckpt)
        dest = dest.to("cpu")
        assert torch.equal(dest.weight.data, b.weight.data)
        assert torch.equal(dest.weight.SCB, b.state.SCB if when == "after_forward" else b.weight.SCB)
        assert torch.equal(dest.bias, b.bias) and dest.bias.dtype == b.bias.dtype
        assert torch.equal(dest(x), own(x))


@THRESHOLDS
def test_checkpoint_to_bitsandbytes(rng, threshold):
    sd = fp32_linear(rng)
    x = make_x(rng, torch.float16)
    q = q4_layer(sd, threshold)
    q(x.float())
    dest = bnb_layer(fp32_linear(rng), threshold)  # bitsandbytes loads int8 only into a quantized layer
    dest.load_state_dict(q.state_dict())
    assert torch.equal(dest.weight.data, q.weight.data) and torch.equal(dest.weight.SCB, q.weight.SCB)
    own = bnb_layer(sd, threshold).eval()
    with torch.no_grad():
        assert torch.equal(dest.eval()(x), own(x))


# ------------------------------------------------------------------- copying


def _copy(layer, how):
    return copy.deepcopy(layer) if how == "deepcopy" else pickle.loads(pickle.dumps(layer))


def _step(layer, x, g, lr=0.1):
    """One SGD step on the bias; returns (y, x.grad, bias.grad)."""
    x = x.clone().requires_grad_()
    y = layer(x)
    y.backward(g)
    grads = (y.detach(), x.grad, layer.bias.grad.clone())
    with torch.no_grad():
        layer.bias -= lr * layer.bias.grad
    layer.bias.grad = None
    return grads


@THRESHOLDS
@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
def test_copy_is_independent(rng, threshold, device, how):
    sd = fp32_linear(rng)
    x = make_x(rng, device=device)
    g = torch.from_numpy(inputs.make(rng, (x.shape[0], OUT), "float32")).to(device)

    # quantizing the copy of an unquantized layer leaves the original as it was
    orig = Linear8bitLt(IN, OUT, has_fp16_weights=False, threshold=threshold)
    orig.load_state_dict(sd)
    cp = _copy(orig, how).to(device)
    assert isinstance(cp.weight, Int8Params) and cp.weight.dtype == torch.int8
    assert orig.weight.dtype == torch.float32 and orig.weight.SCB is None
    assert torch.equal(orig.weight.data, sd["weight"])

    orig = orig.to(device)
    cp = _copy(orig, how)
    assert isinstance(cp.weight, Int8Params) and not storages(cp) & storages(orig)
    assert cp.weight.CB.data_ptr() == cp.weight.data_ptr()
    assert cp.state == orig.state
    for _ in range(3):  # outputs and gradients stay equal over SGD steps on the bias
        for a, b in zip(_step(orig, x, g), _step(cp, x, g), strict=True):
            assert torch.equal(a, b)

    # training the copy leaves the original unchanged
    before = copy.deepcopy(orig.state_dict())
    _step(cp, x, g)
    assert_sd_equal(orig.state_dict(), before)

    # nothing in the copy keeps the original alive
    ref = weakref.ref(orig)
    y = orig(x)
    del orig
    gc.collect()
    assert ref() is None
    cp2 = copy.deepcopy(cp)
    assert torch.equal(cp(x), cp2(x)) and not torch.equal(cp(x), y)


def test_copy_keeps_sharing_inside_the_copy(rng):
    sd = fp32_linear(rng)
    a, b = q4_layer(sd, 0.0), Linear8bitLt(IN, OUT, has_fp16_weights=False)
    b.weight = a.weight  # tied
    pair = copy.deepcopy(torch.nn.ModuleList([a, b]))
    assert pair[1].weight is pair[0].weight and pair[0].weight is not a.weight
    assert pair[0].weight.SCB is not a.weight.SCB
    # a shallow copy shares everything, as in bitsandbytes
    shallow = copy.copy(a)
    assert shallow.weight is a.weight and shallow.bias is a.bias


# -------------------------------------------------------------------- reload


def _dest(kind, rng, threshold, device, x):
    """A destination layer (other weights) in the requested condition."""
    if kind == "unmoved":
        layer = Linear8bitLt(IN, OUT, has_fp16_weights=False, threshold=threshold)
        layer.load_state_dict(fp32_linear(rng))
        return layer
    layer = q4_layer(fp32_linear(rng), threshold, device)
    if kind == "warm_train":
        layer.train()
        layer(x.clone().requires_grad_()).sum().backward()
    elif kind == "warm_eval":
        layer.eval()
        with torch.no_grad():
            layer(x)
    return layer


@THRESHOLDS
@pytest.mark.parametrize("kind", ["cold", "unmoved", "warm_train", "warm_eval"])
def test_reload(rng, threshold, device, kind):
    src = q4_layer(fp32_linear(rng), threshold, device)
    x = make_x(rng, device=device)
    saved = {"before_forward": src.state_dict()}
    src(x.clone().requires_grad_()).sum().backward()
    saved["after_forward"] = src.state_dict()  # aliases src's tensors
    want = src(x)
    for ckpt in saved.values():
        snapshot = copy.deepcopy(ckpt)
        dest = _dest(kind, rng, threshold, device, x)
        dest.load_state_dict(ckpt)
        dest = dest.to(device)
        assert torch.equal(dest(x), want)
        assert torch.equal(dest.weight.SCB, src.weight.SCB) and dest.state.SCB is dest.weight.SCB
        assert_sd_equal(dest.state_dict(), ckpt)
        assert_sd_equal(ckpt, snapshot)
        assert not storages(dest) & storages(src)


@THRESHOLDS
def test_reload_switches_between_checkpoints(rng, threshold, device):
    x = make_x(rng, device=device)
    srcs = [q4_layer(fp32_linear(rng), threshold, device) for _ in range(2)]
    dest = _dest("warm_train", rng, threshold, device, x)
    own = dest.state_dict()  # aliases dest's tensors: loading must not write into them
    own_y, own_snapshot = dest(x), copy.deepcopy(own)
    for src in (srcs[0], srcs[1], srcs[0]):
        ckpt = src.state_dict()
        dest.load_state_dict(ckpt)
        assert torch.equal(dest(x), src(x))
        assert_sd_equal(dest.state_dict(), ckpt)
    assert_sd_equal(own, own_snapshot)
    dest.load_state_dict(own)
    assert torch.equal(dest(x), own_y)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "f16"])
def test_forward_never_changes_parameters(rng, device, dtype):
    ckpt = q4_layer(fp32_linear(rng), 6.0, device).state_dict()
    layer = Linear8bitLt(IN, OUT, has_fp16_weights=False, threshold=6.0).to(device)
    layer.load_state_dict(ckpt)
    ptrs = storages(layer)
    x = make_x(rng, dtype, device).requires_grad_()
    y = layer(x)
    y.float().sum().backward()
    assert y.dtype == dtype and x.grad.dtype == dtype
    assert layer.bias.dtype == torch.float32 and layer.bias.grad.dtype == torch.float32
    assert layer.weight.dtype == torch.int8 and storages(layer) == ptrs
    assert_sd_equal(layer.state_dict(), ckpt)


# ------------------------------------------------------------- torch.compile


@THRESHOLDS
def test_compile_fullgraph(rng, threshold, device):
    sd1, sd2 = fp32_linear(rng, OUT, IN), fp32_linear(rng, IN, OUT)
    second = Linear8bitLt(OUT, IN, bias=False, has_fp16_weights=False, threshold=threshold)
    second.load_state_dict({"weight": sd2["weight"]})
    model = torch.nn.Sequential(q4_layer(sd1, threshold, device), torch.nn.ReLU(), second.to(device))
    twin = copy.deepcopy(model)
    compiled = torch.compile(twin, fullgraph=True)
    x = make_x(rng, device=device)
    with torch.no_grad():
        assert torch.equal(compiled(x), model(x))
    opt_e = torch.optim.SGD([model[0].bias], lr=0.1)
    opt_c = torch.optim.SGD([twin[0].bias], lr=0.1)
    for m, opt in ((model, opt_e), (compiled, opt_c)):
        (m(x) ** 2).mean().backward()
        opt.step()
    # inductor may reorder the fp32 sums of the backward: fp32 tolerances
    torch.testing.assert_close(twin[0].bias.grad, model[0].bias.grad)
    torch.testing.assert_close(twin[0].bias, model[0].bias)
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), model(x))


# ---------------------------------------------------------------- fp16 path


def test_float_weight_path(rng):
    """has_fp16_weights=True: the float weight is quantized on each forward
    (same result as the int8 layer) and gets the gradient g^T x."""
    sd = fp32_linear(rng)
    layer = Linear8bitLt(IN, OUT, has_fp16_weights=True, threshold=6.0)
    layer.load_state_dict(sd)
    layer = layer.to("cpu")
    assert layer.weight.dtype == torch.float32 and set(layer.state_dict()) == {"weight", "bias"}
    x = make_x(rng)
    g = torch.from_numpy(inputs.make(rng, (x.shape[0], OUT), "float32"))
    y = layer(x)
    y.backward(g)
    assert torch.equal(y.detach(), q4_layer(sd, 6.0)(x).detach())
    torch.testing.assert_close(layer.weight.grad, g.T @ x)


# ----------------------------------------------------------------- bad input


def test_bad_input(rng):
    sd = fp32_linear(rng)
    layer = q4_layer(sd, 6.0)
    with pytest.raises(ValueError, match=f"input has {IN - 1} features, the weight expects {IN}"):
        layer(torch.ones(2, IN - 1))
    with pytest.raises(TypeError, match="float32, float16 or bfloat16, got torch.int32"):
        layer(torch.ones(2, IN, dtype=torch.int32))

    good = layer.state_dict()
    bad_cases = {
        "SCB has 47 values, the layer has 48 output features": {"SCB": good["SCB"][:-1]},
        "SCB is missing: an int8 weight needs its row scales": {"SCB": None},
        r"size mismatch for weight: checkpoint has \(48, 95\)": {"weight": good["weight"][:, :-1]},
        "weight must be int8 .quantized. or float, got torch.int16": {"weight": good["weight"].to(torch.int16)},
        "weight_format: only the row-major format": {"weight_format": torch.tensor(1, dtype=torch.uint8)},
        "weight is a float .* but this layer is already quantized": {"weight": sd["weight"], "SCB": None},
    }
    dest = q4_layer(fp32_linear(rng), 6.0)
    before = copy.deepcopy(dest.state_dict())
    for message, change in bad_cases.items():
        ckpt = {**good, **change}
        ckpt = {k: v for k, v in ckpt.items() if v is not None}
        with pytest.raises(RuntimeError, match=message):
            dest.load_state_dict(ckpt)
        assert_sd_equal(dest.state_dict(), before)  # nothing loaded

    # an int8 checkpoint cannot go into a layer that keeps a float weight
    fp16_layer = Linear8bitLt(IN, OUT, has_fp16_weights=True).to("cpu")
    with pytest.raises(RuntimeError, match="Loading a quantized checkpoint into non-quantized Linear8bitLt"):
        fp16_layer.load_state_dict(good)
    tied = Linear8bitLt(IN, OUT, has_fp16_weights=False)
    tied.weight = torch.nn.Parameter(torch.randn(OUT, IN, generator=torch.Generator().manual_seed(0)))
    with pytest.raises(RuntimeError, match="Loading a quantized checkpoint into non-quantized Linear8bitLt"):
        tied.load_state_dict(good)

    with pytest.raises(ValueError, match="not finite after rounding to float16"):
        Int8Params(torch.full((4, 8), 1e5), requires_grad=False).to("cpu")
