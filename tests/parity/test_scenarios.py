"""Parity scenarios written once and run through each framework's adapter:
copying, reload after a forward, cross-framework bytes and outputs, and
checkpoint hops (including one saved by bitsandbytes)."""

import gc
import weakref

import numpy as np
import pytest
from q4_reference import inputs
from q4_reference.matmul import check_against_baseline
from q4_testing.adapters import ADAPTERS

from q4.parity import Spec

SPECS = [
    Spec("4bit", "nf4", True, 64),
    Spec("4bit", "fp4", False, 64),
    Spec("4bit", "nf4", False, 4096),
    Spec("4bit", "fp4", True, 4096),
    Spec("8bit", threshold=0.0),
    Spec("8bit", threshold=6.0),
]
OUT, IN = 48, 4096 // 32  # 128 inputs: a 4096 block spans several rows


@pytest.fixture(params=sorted(ADAPTERS))
def fw(request):
    return ADAPTERS[request.param]()


@pytest.fixture(params=SPECS, ids=lambda s: s.id)
def spec(request):
    return request.param


def _weights(rng):
    w = (inputs.make(rng, (OUT, IN), "float32") * 0.1).astype(np.float32)
    return w, inputs.make(rng, (OUT,), "float32")


def _x(rng, dtype="float32"):
    x = inputs.make(rng, (5, IN), dtype)
    x[:, 7] = 8.0  # an outlier column for LLM.int8 with threshold 6
    return x


def _same_state(a: dict, b: dict) -> bool:
    return sorted(a) == sorted(b) and all(np.asarray(a[k]).tobytes() == np.asarray(b[k]).tobytes() for k in a)


def test_copy(fw, spec, rng):
    """A copy is independent: re-quantizing it leaves the original's bytes and
    outputs unchanged, and the original can be collected while the copy lives."""
    w, b = _weights(rng)
    layer = fw.make(spec, w, b)
    x = _x(rng)
    before_state, before_out = fw.state(layer), fw.forward(layer, x)
    clone = fw.clone(layer)
    assert _same_state(fw.state(clone), before_state)
    assert np.array_equal(fw.forward(clone, x), before_out)
    fw.set_weight(clone, spec, w * 2)
    assert _same_state(fw.state(layer), before_state) and np.array_equal(fw.forward(layer, x), before_out)
    assert not np.array_equal(fw.forward(clone, x), before_out)
    ref = weakref.ref(layer)
    del layer
    gc.collect()
    assert ref() is None
    fw.forward(clone, x)


@pytest.mark.parametrize("destination", ["cold", "after_forward"])
def test_reload_and_switching(fw, spec, rng, destination):
    """Loading into a cold layer or one that already ran a forward, and
    switching checkpoints, gives exactly the source's outputs and resaved
    state; the caller's dict is untouched."""
    wa, ba = _weights(rng)
    wb, bb = _weights(rng)
    src_a, src_b = fw.make(spec, wa, ba), fw.make(spec, wb, bb)
    x = _x(rng)
    dest = fw.make(spec, wb * 0.5, bb)
    if destination == "after_forward":
        fw.forward(dest, x)
    for src in (src_a, src_b, src_a):
        state = fw.state(src)
        snapshot = {k: np.array(v, copy=True) for k, v in state.items()}
        fw.load(dest, state)
        assert np.array_equal(fw.forward(dest, x), fw.forward(src, x))
        assert _same_state(fw.state(dest), state)
        assert _same_state(state, snapshot)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_frameworks_agree(spec, rng, dtype):
    """Same weights and inputs through both frameworks: identical checkpoint
    bytes; outputs and input gradients of each checked against the fp64
    product with the dequantized weight (4-bit: as close as the dense matmul in
    the same dtype; 8-bit: within LLM.int8's derived bound), every spec and
    dtype; and in fp32 bit-identical to each other."""
    w, b = _weights(rng)
    x, g = _x(rng, dtype), inputs.make(rng, (5, OUT), dtype)
    results = {}
    for name, cls in sorted(ADAPTERS.items()):
        fw = cls()
        layer = fw.make(spec, w, b)
        results[name] = (fw.state(layer), fw.forward(layer, x), fw.input_grad(layer, x, g))
    (st_a, y_a, dx_a), (st_b, y_b, dx_b) = results.values()
    assert _same_state(st_a, st_b)
    w_deq = _dequantized(st_a) if spec.kind == "4bit" else _dequantized_int8(st_a)
    for name, (_, y, dx) in results.items():
        if spec.kind == "4bit":
            check_against_baseline(y - b, inputs.to_f32(x), w_deq.T, dtype, what=f"{name} output")
        else:
            _check_int8_output(y, inputs.to_f32(x), w_deq, b, dtype, what=f"{name} output")
        check_against_baseline(dx, inputs.to_f32(g), w_deq, dtype, what=f"{name} input gradient")
    if dtype == "float32":
        assert np.array_equal(y_a, y_b) and np.array_equal(dx_a, dx_b)


def _dequantized_int8(state) -> np.ndarray:
    """The LLM.int8 weight as fp64: int8 row codes * row absmax (SCB) / 127."""
    return np.asarray(state["weight"], np.float64) * np.asarray(state["SCB"], np.float64)[:, None] / 127


def _check_int8_output(y, x32, w_deq, bias, dtype, what):
    """y = x . W^T + bias through LLM.int8, against the fp64 product with the
    dequantized weight. Derived bound, per output (m, n): quantizing x's row m
    to int8 moves each element by at most absmax_m / 254 (outlier columns,
    kept in floating point, by less), so the product moves by at most
    absmax_m / 254 * sum_k |W[n, k]|; the fp32 accumulation adds at most
    (k + 2) * 2^-24 * sum_k |x||W|, and rounding to the output dtype u * |y|."""
    x = np.asarray(x32, np.float64)
    want = x @ w_deq.T + np.asarray(bias, np.float64)
    absmax = np.abs(x).max(axis=1, keepdims=True)
    bound = absmax / 254 * np.abs(w_deq).sum(axis=1)[None, :]
    bound += (x.shape[1] + 2) * 2.0**-24 * (np.abs(x) @ np.abs(w_deq).T + np.abs(bias))
    u = {"float32": 2.0**-24, "bfloat16": 2.0**-8, "float16": 2.0**-11}[dtype]
    bound += u * (np.abs(want) + bound + np.abs(bias))  # (a bias in the layer's dtype is rounded once too)
    err = np.abs(np.asarray(inputs.to_f32(y), np.float64) - want)
    assert (err <= bound).all(), (
        f"{what}: error {err.max():.3e} exceeds the bound at {np.unravel_index((err - bound).argmax(), err.shape)}"
    )


def _dequantized(state) -> np.ndarray:
    """The 4-bit weight of a saved state as fp32, decoded by the oracle's
    arithmetic (tests/q4_reference/oracle.py) from the bytes and scales; the
    library only parses the entries."""
    from q4_reference import oracle

    import q4

    entries = {k[len("weight.") :]: v for k, v in state.items() if k.startswith("weight.")}
    qs = q4.QuantState.from_dict(entries)
    n = int(np.prod(qs.shape))
    absmax = np.asarray(qs.absmax)
    if qs.nested:
        absmax = oracle.dequantize_blockwise(
            absmax,  # the uint8 codes
            np.asarray(qs.nested_absmax),
            qs.nested_blocksize,
            code=q4.code_table("dynamic"),
            offset=qs.nested_offset,
        )
    packed = np.asarray(state["weight"]).view(np.uint8).reshape(-1)
    return oracle.dequantize_4bit(packed, absmax, n, qs.blocksize, qs.quant_type).reshape(qs.shape)


def test_checkpoint_hops_including_bitsandbytes(spec, rng, tmp_path):
    """bitsandbytes -> file -> q4jax -> file -> q4torch -> file: bytes identical after each hop."""
    import bitsandbytes as bnb

    import q4
    from q4torch._src.parity import build_layer

    w, b = _weights(rng)
    layer = build_layer(bnb.nn, spec, w, b)  # bitsandbytes' own layers, built as q4torch's are
    origin = {k: v.detach().numpy().copy() for k, v in layer.state_dict().items()}
    q4.checkpoint.save_file(origin, tmp_path / "bnb.safetensors")
    state = q4.checkpoint.load_file(tmp_path / "bnb.safetensors")
    for i, name in enumerate(("q4jax", "q4torch", "q4jax")):
        fw = ADAPTERS[name]()
        dest = fw.make(spec, w * 0.5, b)
        fw.load(dest, state)
        q4.checkpoint.save_file(fw.state(dest), tmp_path / f"hop{i}.safetensors")
        state = q4.checkpoint.load_file(tmp_path / f"hop{i}.safetensors")
        assert _same_state(state, origin), name


@pytest.mark.parametrize("pool_size", [1, 2, 3])
@pytest.mark.parametrize("spec4", [s for s in SPECS if s.kind == "4bit"], ids=lambda s: s.id)
def test_recompute_with_streamed_weights(fw, spec4, pool_size, rng):
    """Under activation checkpointing (torch checkpoint / jax.checkpoint in a
    scan), streaming each layer's bytes through a recycled pool gives gradients
    bit-identical to the layers reading their own weights."""
    weights = [
        ((inputs.make(rng, (IN, IN), "float32") * 0.1).astype(np.float32), inputs.make(rng, (IN,), "float32") * 0.1)
        for _ in range(4)
    ]
    upstream = inputs.make(rng, (IN,), "float32")
    x = inputs.make(rng, (3, IN), "float32")
    owned = fw.upstream_grad(spec4, weights, upstream, x, None)
    streamed = fw.upstream_grad(spec4, weights, upstream, x, pool_size)
    assert np.array_equal(owned, streamed)


@pytest.mark.parametrize("spec4", [s for s in SPECS if s.kind == "4bit"], ids=lambda s: s.id)
def test_jax_backward_keeps_no_dequantized_weight(spec4, rng):
    """The JAX half of the streamed-weights scenario cannot fail on values
    (JAX arrays are immutable: a backward holding a dequantized weight gets the
    same gradients), so what it targets is asserted directly: the residuals
    matmul_4bit saves for its backward hold no floating-point [n, k] (or [k, n]) array.
    The control -- dequantize, then a dense dot -- does hold one, so the check
    can fail."""
    import jax.numpy as jnp
    from jax._src.ad_checkpoint import saved_residuals

    import q4jax

    layer = ADAPTERS["q4jax"]().make(spec4, *_weights(rng))
    packed, state, bias = layer.weight.get_value(), layer.quant_state.get_value(), layer.bias.get_value()
    x = jnp.asarray(_x(rng))

    def dense_weights(fn):
        # the weight enters as an argument, as model parameters do
        return [
            aval
            for aval, _ in saved_residuals(fn, x, packed)
            if sorted(aval.shape) == sorted((OUT, IN)) and jnp.issubdtype(aval.dtype, jnp.floating)
        ]

    assert dense_weights(lambda h, p: q4jax.matmul_4bit(h, p, state, bias)) == []
    control = dense_weights(lambda h, p: h @ q4jax.dequantize_4bit(p, state).T + bias)
    assert len(control) == 1, "the control should save the dequantized weight"
