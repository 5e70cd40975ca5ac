"""Multi-device checks for test_sharding.py.

Run once per test module in a subprocess whose XLA_FLAGS hold
--xla_force_host_platform_device_count=8 (the pytest process has already
initialised JAX with one device). Every check runs here, against the same
computation on one device, and records plain numbers (max differences,
reference magnitudes, exactness, HLO facts, error messages) in one JSON file;
the tests assert on them. A check that raises records its traceback instead.

usage: XLA_FLAGS=--xla_force_host_platform_device_count=8 python sharding_worker.py OUT.json
"""

from __future__ import annotations

import json
import re
import sys
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import q4jax

DEVICES = 8
D, F = 256, 512  # MLP widths: up W [F, D] column-parallel, down W [D, F] row-parallel
RESULTS: dict[str, dict] = {}
CHECKS: list = []

# 4-bit MLP cases: (quant_type, compress_statistics); int8 cases: threshold
CASES_4BIT = {
    "nf4-bs64": ("nf4", False),
    "nf4-bs64-nested": ("nf4", True),
    "fp4-bs64": ("fp4", False),
    "fp4-bs64-nested": ("fp4", True),
}
CASES_INT8 = {"int8-t0": 0.0, "int8-t6": 6.0}


def check(name):
    def wrap(fn):
        CHECKS.append((name, fn))
        return fn

    return wrap


def run_checks():
    for name, fn in CHECKS:
        t0 = time.perf_counter()
        try:
            RESULTS[name] = fn()
        except Exception:  # recorded for the test to report, never turned into a pass
            RESULTS[name] = {"error": traceback.format_exc()}
        RESULTS[name]["seconds"] = round(time.perf_counter() - t0, 2)


def compare(got, want) -> dict:
    """Max |got - want| over all leaves, the reference's max |value|, exactness."""
    g, w = jax.tree.leaves(got), jax.tree.leaves(want)
    assert len(g) == len(w), (len(g), len(w))
    max_abs = ref_max = 0.0
    exact = True
    for a, b in zip(g, w, strict=True):
        a, b = np.asarray(a), np.asarray(b)
        assert a.shape == b.shape, (a.shape, b.shape)
        exact &= bool(np.array_equal(a, b))
        max_abs = max(max_abs, float(np.max(np.abs(a.astype(np.float64) - b.astype(np.float64)), initial=0.0)))
        ref_max = max(ref_max, float(np.max(np.abs(b.astype(np.float64)), initial=0.0)))
    return {"max_abs": max_abs, "ref_max": ref_max, "exact": exact}


def rng_array(rng, shape, scale=1.0):
    return jnp.asarray((rng.standard_normal(shape) * scale).astype(np.float32))


# ------------------------------------------------------------------ models


class MLP(nnx.Module):
    def __init__(self, d, f, *, rngs):
        self.up = nnx.Linear(d, f, rngs=rngs)
        self.down = nnx.Linear(f, d, rngs=rngs)

    def __call__(self, x):
        return self.down(jax.nn.gelu(self.up(x)))


def quantized_mlp(kind, seed=0, **kw):
    rng = np.random.default_rng(seed)
    model = MLP(D, F, rngs=nnx.Rngs(seed))
    for lin in (model.up, model.down):
        lin.bias.set_value(rng_array(rng, lin.bias.get_value().shape, 0.1))
    if kind in CASES_INT8:
        q4jax.quantize_model(model, "int8", threshold=CASES_INT8[kind], skip=())
    else:
        qt, nested = CASES_4BIT[kind]
        q4jax.quantize_model(model, qt, blocksize=64, compress_statistics=nested, skip=())
    return model


def mlp_input(kind, rng, shape):
    x = np.asarray(rng.standard_normal(shape), np.float32)
    if kind == "int8-t6":
        x[..., 3] = 20.0  # an outlier column of the up layer's input
        x.reshape(-1, shape[-1])[1, 7] = -9.0  # an outlier element in one row only
    return jnp.asarray(x)


def loss_and_grads(model, x, r, jit=True):
    """loss = sum(model(x) * r); its value, output, grads of the nnx.Params and of x."""
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    def f(params, rest, x):
        y = nnx.merge(graphdef, params, rest)(x)
        return jnp.sum(y * r), y

    fn = jax.value_and_grad(f, argnums=(0, 2), has_aux=True)
    fn = jax.jit(fn) if jit else fn
    (loss, y), (dparams, dx) = fn(params, rest, x)
    return loss, y, dparams, dx


def run_mlp_case(kind, mesh, data_axis, x_shape, x_spec):
    rng = np.random.default_rng(1)
    ref = quantized_mlp(kind)
    tp = nnx.clone(ref)
    shardings = q4jax.shard_model(
        tp, mesh, {"up": "column", "down": "row"}, model_axis="model", data_axis=data_axis, unnest=True
    )
    x = mlp_input(kind, rng, x_shape)
    r = rng_array(rng, x_shape[:-1] + (D,))
    loss0, y0, dp0, dx0 = loss_and_grads(ref, x, r)
    xs = jax.device_put(x, NamedSharding(mesh, x_spec))
    loss1, y1, dp1, dx1 = loss_and_grads(tp, xs, jax.device_put(r, NamedSharding(mesh, x_spec)))
    # the column-parallel layer alone (its output before the row-parallel one)
    h0 = jax.jit(lambda m, x: m.up(x))(ref, x)
    h1 = jax.jit(lambda m, x: m.up(x))(tp, xs)
    out = {
        "loss": compare(loss1, loss0),
        "loss_terms": float(jnp.sum(jnp.abs(y0 * r))),
        "y": compare(y1, y0),
        "up_forward": compare(h1, h0),
        "dx": compare(dx1, dx0),
        "d_bias_up": compare(dp1["up"]["bias"], dp0["up"]["bias"]),
        "d_bias_down": compare(dp1["down"]["bias"], dp0["down"]["bias"]),
        "model_axis_size": int(mesh.shape["model"]),
        "y_sharding": str(y1.sharding.spec),
        "up_sharding": str(tp.up.sharding.mode),
        "down_sharding": str(tp.down.sharding.mode),
        "shardings_cover_state": len(jax.tree.leaves(shardings)) == len(jax.tree.leaves(nnx.state(tp))),
    }
    if kind in CASES_4BIT:
        out["up_nested_kept"] = bool(tp.up.quant_state.get_value().nested)
        out["down_nested_kept"] = bool(tp.down.quant_state.get_value().nested)
        out["down_packed_local_shape"] = list(tp.down.weight.get_value().addressable_shards[0].data.shape)
    # checkpoints are the canonical single-device format whatever the layout;
    # a layer whose nested statistics were decoded saves them decoded
    sd0, sd1 = q4jax.state_dict(ref), q4jax.state_dict(tp)
    pairs = (("up.", ref.up, tp.up), ("down.", ref.down, tp.down))
    decoded = [
        p for p, a, b in pairs if kind in CASES_4BIT and a.compress_statistics and not b.quant_state.get_value().nested
    ]
    keep = [k for k in sd0 if not any(k.startswith(p) and k not in (p + "weight", p + "bias") for p in decoded)]
    out["decoded_layers"] = decoded
    out["state_dict_equal"] = all(k in sd1 and np.array_equal(sd0[k], sd1[k]) for k in keep)
    if kind in CASES_4BIT:
        out["dequantized_equal"] = all(
            np.array_equal(q4jax.dequantize_4bit(*a._canonical()), q4jax.dequantize_4bit(*b._canonical()))
            for _, a, b in pairs
        )
    # reloading the reference's checkpoint into the sharded model keeps it sharded and its output
    q4jax.load_state_dict(tp, sd0, strict=False)
    y2 = jax.jit(lambda m, x: m(x))(tp, xs)
    out["reload_y"] = compare(y2, y0)
    out["reload_still_sharded"] = tp.up.sharding is not None and tp.down.sharding is not None
    return out


for _kind in [*CASES_4BIT, *CASES_INT8]:

    @check(f"tp-mlp-{_kind}")
    def _tp(kind=_kind):
        mesh = jax.make_mesh((DEVICES,), ("model",))
        return run_mlp_case(kind, mesh, None, (2, 6, D), P())


@check("tp-dp-mlp-nf4-bs64-nested")
def _tp_dp():
    """2 (data) x 4 (model) over a mesh built with Auto axes."""
    mesh = Mesh(np.array(jax.devices()).reshape(2, 4), ("data", "model"))
    return run_mlp_case("nf4-bs64-nested", mesh, "data", (8, D), P("data"))


@check("tp-dp-mlp-int8-t6")
def _tp_dp8():
    mesh = jax.make_mesh((2, 4), ("data", "model"))
    return run_mlp_case("int8-t6", mesh, "data", (4, 2, D), P("data"))


@check("row-layer")
def _row_layer():
    """A row-parallel layer alone: the forward sums S fp32 partials; the input
    gradient's sum over output features is not split."""
    mesh = jax.make_mesh((DEVICES,), ("model",))
    rng = np.random.default_rng(7)
    out = {}
    for kind, make in (
        ("nf4", lambda: q4jax.nn.Linear4bit(F, D, blocksize=64, compress_statistics=False, rngs=nnx.Rngs(1))),
        ("int8-t6", lambda: q4jax.nn.Linear8bit(F, D, threshold=6.0, rngs=nnx.Rngs(1))),
    ):
        ref = make()
        sharded = nnx.clone(ref).shard(q4jax.LinearSharding(mesh, "row", "model"))
        x = np.asarray(rng.standard_normal((6, F)), np.float32)
        x[:, 5] = 12.0  # an outlier column for the int8 layer
        x, g = jnp.asarray(x), rng_array(rng, (6, D))

        def fwd_bwd(layer, x, g=g):
            y, vjp = jax.vjp(lambda x: layer(x), x)
            return y, vjp(g)[0]

        y0, dx0 = jax.jit(fwd_bwd)(ref, x)
        y1, dx1 = jax.jit(fwd_bwd)(sharded, jax.device_put(x, NamedSharding(mesh, P(None, "model"))))
        out[kind] = {"y": compare(y1, y0), "dx": compare(dx1, dx0)}
    # control: row-parallel int8 where each shard quantizes x with its own row
    # statistics (no pmax) is not the single-device result
    cb, scb, bias = ref.weight.get_value(), ref.SCB.get_value(), ref.bias.get_value()
    kl = F // DEVICES
    naive = sum(q4jax.matmul_8bit(x[:, i : i + kl], cb[:, i : i + kl], scb, None, 6.0) for i in range(0, F, kl)) + bias
    out["int8-t6"]["naive_local_stats_control"] = compare(naive, y0)
    return out


@check("bf16")
def _bf16():
    """bf16 activations on a 2 (data) x 4 (model) mesh, column then row."""
    mesh = jax.make_mesh((2, 4), ("data", "model"))
    x = jnp.asarray(np.random.default_rng(8).standard_normal((4, D)), jnp.bfloat16)
    out = {}
    for kind in ("nf4-bs64-nested", "int8-t6"):
        ref = quantized_mlp(kind)
        tp = nnx.clone(ref)
        q4jax.shard_model(tp, mesh, {"up": "column", "down": "row"}, data_axis="data", unnest=True)
        y0 = jax.jit(lambda m, x: m(x))(ref, x)
        y1 = jax.jit(lambda m, x: m(x))(tp, jax.device_put(x, NamedSharding(mesh, P("data"))))
        out[kind] = compare(y1.astype(jnp.float32), y0.astype(jnp.float32))
        out[kind]["dtype"] = str(y1.dtype)
    return out


@check("remat")
def _remat():
    """Recompute: grads of the sharded MLP under jax.checkpoint (nothing
    saveable: the backward reruns the forward kernels on the shards) equal the
    grads without it, bit for bit."""
    mesh = jax.make_mesh((DEVICES,), ("model",))
    out = {}
    for kind in ("nf4-bs64-nested", "int8-t6"):
        model = quantized_mlp(kind)
        q4jax.shard_model(model, mesh, {"up": "column", "down": "row"}, unnest=True)
        graphdef, params, rest = nnx.split(model, nnx.Param, ...)
        x = mlp_input(kind, np.random.default_rng(9), (4, D))

        def loss(params, x, remat, graphdef=graphdef, rest=rest):
            def f(params, x):
                return jnp.sum(nnx.merge(graphdef, params, rest)(x) ** 2)

            f = jax.checkpoint(f, policy=jax.checkpoint_policies.nothing_saveable) if remat else f
            return f(params, x)

        grads = jax.jit(jax.grad(loss, argnums=(0, 1)), static_argnums=2)
        out[kind] = compare(grads(params, x, True), grads(params, x, False))
    return out


# ------------------------------------------------------------------ HLO


def hlo_facts(text: str, full_weight_elems: int) -> dict:
    """All-gathers of 8-bit (packed 4-bit / int8 / absmax code) arrays, the
    all-reduce count, and the element count of every q4 kernel's 8-bit operand."""
    gathers = [ln.strip()[:200] for ln in text.splitlines() if re.search(r"= [us]8\[[^=]* all-gather(-start)?\(", ln)]
    kernel_weight_elems = []
    for ln in text.splitlines():
        if 'custom_call_target="q4_' not in ln:
            continue
        m = re.search(r"operand_layout_constraints=\{(.*?)\}, api_version", ln)
        shapes = re.findall(r"\b[us]8\[([\d,]*)\]", m.group(1) if m else "")
        kernel_weight_elems += [int(np.prod([int(d) for d in s.split(",") if d])) for s in shapes]
    return {
        "weight_all_gathers": gathers,
        "all_reduces": len(re.findall(r" all-reduce(-start)?\(", text)),
        "kernel_weight_elems": kernel_weight_elems,
        "full_weight_elems": full_weight_elems,
    }


def layer_hlo(layer, x, train):
    graphdef, state = nnx.split(layer)

    def f(state, x):
        return jnp.sum(nnx.merge(graphdef, state)(x))

    fn = jax.grad(f, argnums=1) if train else f
    return jax.jit(fn).lower(state, x).compile().as_text()


@check("hlo-column-4bit")
def _hlo_column_4bit():
    mesh = jax.make_mesh((DEVICES,), ("model",))
    rng = np.random.default_rng(2)
    layer = q4jax.nn.Linear4bit(D, F, blocksize=64, compress_statistics=True, rngs=nnx.Rngs(0))
    x = jax.device_put(rng_array(rng, (4, D)), NamedSharding(mesh, P()))
    spec = q4jax.LinearSharding(mesh, "column", "model")
    layer.shard(spec)
    full = F * D // 2
    out = {
        "ours_forward": hlo_facts(layer_hlo(layer, x, False), full),
        "ours_backward": hlo_facts(layer_hlo(layer, x, True), full),
    }
    # control: the same placed arrays through the plain op (no partitioning rule)
    layer.sharding = None
    out["naive_forward"] = hlo_facts(layer_hlo(layer, x, False), full)
    return out


@check("hlo-column-int8")
def _hlo_column_int8():
    mesh = jax.make_mesh((DEVICES,), ("model",))
    rng = np.random.default_rng(3)
    layer = q4jax.nn.Linear8bit(D, F, threshold=6.0, rngs=nnx.Rngs(0))
    x = jax.device_put(rng_array(rng, (4, D)), NamedSharding(mesh, P()))
    layer.shard(q4jax.LinearSharding(mesh, "column", "model"))
    out = {"ours_forward": hlo_facts(layer_hlo(layer, x, False), F * D)}
    layer.sharding = None
    out["naive_forward"] = hlo_facts(layer_hlo(layer, x, False), F * D)
    return out


@check("hlo-tp-mlp-train")
def _hlo_mlp():
    mesh = jax.make_mesh((DEVICES,), ("model",))
    out = {}
    for kind in ("nf4-bs64-nested", "int8-t6"):
        model = quantized_mlp(kind)
        q4jax.shard_model(model, mesh, {"up": "column", "down": "row"}, unnest=True)
        graphdef, params, rest = nnx.split(model, nnx.Param, ...)
        x = jax.device_put(jnp.ones((4, D)), NamedSharding(mesh, P()))

        def f(params, rest, x, graphdef=graphdef):
            return jnp.sum(nnx.merge(graphdef, params, rest)(x) ** 2)

        text = jax.jit(jax.grad(f, argnums=(0, 2))).lower(params, rest, x).compile().as_text()
        out[kind] = hlo_facts(text, F * D // 2 if kind != "int8-t6" else F * D)
        # a row-parallel int8 shard carries one zero column per output (the row statistics' column)
        out[kind]["row_pad_elems"] = D if kind == "int8-t6" else 0
    return out


# ------------------------------------------------------------------ data parallel (QLoRA)


class QLoRA(nnx.Module):
    """Frozen 4-bit base layers (no bias) with trainable fp32 low-rank adapters."""

    def __init__(self, d, h, rank, quant_type, nested, *, rngs):
        rng = np.random.default_rng(4)
        kw = dict(use_bias=False, quant_type=quant_type, blocksize=64, compress_statistics=nested, rngs=rngs)
        self.base1 = q4jax.nn.Linear4bit(d, h, **kw)
        self.base2 = q4jax.nn.Linear4bit(h, d, **kw)
        self.a1 = nnx.Param(rng_array(rng, (d, rank), 0.05))
        self.b1 = nnx.Param(rng_array(rng, (rank, h), 0.05))
        self.a2 = nnx.Param(rng_array(rng, (h, rank), 0.05))
        self.b2 = nnx.Param(rng_array(rng, (rank, d), 0.05))

    def __call__(self, x):
        h = jax.nn.gelu(self.base1(x) + (x @ self.a1) @ self.b1)
        return self.base2(h) + (h @ self.a2) @ self.b2


def qlora_step(model, x, t, lr=0.1):
    """One SGD step on the adapters: loss, grads, updated adapters."""
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    @jax.jit
    def step(params, rest, x, t):
        def loss(params):
            y = nnx.merge(graphdef, params, rest)(x)
            return jnp.mean((y - t) ** 2)

        value, grads = jax.value_and_grad(loss)(params)
        new = jax.tree.map(lambda p, g: p - lr * g, params, grads)
        return value, grads, new

    return step(params, rest, x, t), step, (params, rest, x, t)


for _qt, _nested in (("nf4", True), ("fp4", False)):

    @check(f"dp-qlora-{_qt}-bs64{'-nested' if _nested else ''}")
    def _dp(qt=_qt, nested=_nested):
        mesh = jax.make_mesh((DEVICES,), ("data",))
        rng = np.random.default_rng(5)
        ref = QLoRA(D, F, 8, qt, nested, rngs=nnx.Rngs(0))
        dp = nnx.clone(ref)
        batch = 32
        x, t = rng_array(rng, (batch, D)), rng_array(rng, (batch, D))
        (l0, g0, n0), _, _ = qlora_step(ref, x, t)
        shardings = q4jax.shard_model(dp, mesh, data_axis="data")
        xs, ts = (jax.device_put(a, NamedSharding(mesh, P("data"))) for a in (x, t))
        (l1, g1, n1), step, args = qlora_step(dp, xs, ts)
        local_rows = batch // DEVICES
        facts = hlo_facts(step.lower(*args).compile().as_text(), F * D // 2)
        # control: the same placed model without the rule runs the kernel on the whole batch
        text_ours = step.lower(*args).compile().as_text()
        for layer in (dp.base1, dp.base2):
            layer.sharding = None
        _, naive_step, naive_args = qlora_step(dp, xs, ts)
        text_naive = naive_step.lower(*naive_args).compile().as_text()

        def kernel_x_rows(text):
            rows = []
            for ln in text.splitlines():
                if 'custom_call_target="q4_gemm_4bit"' in ln:
                    m = re.search(r"operand_layout_constraints=\{f32\[(\d+),", ln)
                    rows.append(int(m.group(1)) if m else -1)
            return rows

        return {
            "loss": compare(l1, l0),
            "grads": compare(g1, g0),
            "updated": compare(n1, n0),
            "grad_leaves": len(jax.tree.leaves(g0)),
            "base_params_frozen": all("base" not in str(p) for p in jax.tree_util.tree_flatten_with_path(g0)[0]),
            "adapter_sharding": str(shardings["a1"].get_value().spec),
            "kernel_x_rows": kernel_x_rows(text_ours),
            "naive_kernel_x_rows": kernel_x_rows(text_naive),
            "local_rows": local_rows,
            "batch": batch,
            "weight_all_gathers": facts["weight_all_gathers"],
        }


@check("dp-int8-t6-outliers")
def _dp_int8():
    """LLM.int8 picks outlier columns over the whole batch: one row's outlier
    must zero that column in every data shard, as on one device."""
    mesh = jax.make_mesh((DEVICES,), ("data",))
    rng = np.random.default_rng(6)
    layer = q4jax.nn.Linear8bit(D, 64, threshold=6.0, rngs=nnx.Rngs(0))
    x = np.asarray(rng.standard_normal((16, D)), np.float32)
    x[3, 10] = 25.0  # only in data shard 1
    x[14, 200] = -7.0  # only in data shard 7
    x = jnp.asarray(x)
    y0 = jax.jit(lambda m, x: m(x))(layer, x)
    cb, scb, bias = layer.weight.get_value(), layer.SCB.get_value(), layer.bias.get_value()
    per_shard = jnp.concatenate([q4jax.matmul_8bit(x[i : i + 2], cb, scb, bias, 6.0) for i in range(0, 16, 2)])
    sharded = nnx.clone(layer)
    sharded.shard(q4jax.LinearSharding(mesh, "replicated", data_axis="data"))
    y1 = jax.jit(lambda m, x: m(x))(sharded, jax.device_put(x, NamedSharding(mesh, P("data"))))
    return {"sharded": compare(y1, y0), "per_shard_control": compare(per_shard, y0)}


# ------------------------------------------------------------------ bad requests


def error_of(fn) -> dict:
    try:
        fn()
    except (ValueError, TypeError) as e:
        return {"type": type(e).__name__, "message": str(e)}
    return {"type": None, "message": "no error raised"}


@check("errors")
def _errors():
    mesh = jax.make_mesh((DEVICES,), ("model",))
    mesh2 = jax.make_mesh((2, 4), ("data", "model"))
    col = q4jax.LinearSharding(mesh, "column", "model")
    row = q4jax.LinearSharding(mesh, "row", "model")
    rngs = nnx.Rngs(0)
    out = {}

    def init(key, shape, dtype):
        return jnp.full(shape, 0.01, dtype)

    def l4(i, o, **kw):
        return q4jax.nn.Linear4bit(i, o, blocksize=64, kernel_init=init, rngs=rngs, **kw)

    def l8(i, o):
        return q4jax.nn.Linear8bit(i, o, kernel_init=init, rngs=rngs)

    out["column_block_boundary"] = error_of(lambda: l4(40, 16, compress_statistics=False).shard(col))
    out["row_block_boundary"] = error_of(lambda: l4(256, 8, compress_statistics=False).shard(row))
    out["column_out_not_divisible"] = error_of(lambda: l4(64, 100, compress_statistics=False).shard(col))
    out["row_in_not_divisible"] = error_of(lambda: l4(100, 64, compress_statistics=False).shard(row))
    out["int8_column_not_divisible"] = error_of(lambda: l8(64, 100).shard(col))
    out["int8_row_not_divisible"] = error_of(lambda: l8(100, 64).shard(row))
    out["nested_row"] = error_of(lambda: l4(2048, 8, compress_statistics=True).shard(row))
    out["nested_column"] = error_of(lambda: l4(256, 16, compress_statistics=True).shard(col))
    nested_ok = l4(2048, 8, compress_statistics=True).shard(q4jax.LinearSharding(mesh, "row", "model", unnest=True))
    out["nested_row_unnest_ok"] = {"nested": bool(nested_ok.quant_state.get_value().nested)}
    out["unknown_axis"] = error_of(lambda: q4jax.LinearSharding(mesh2, "column", "tensor"))
    out["unknown_data_axis"] = error_of(lambda: q4jax.LinearSharding(mesh2, "column", "model", data_axis="batch"))
    out["axis_is_data_axis"] = error_of(lambda: q4jax.LinearSharding(mesh2, "row", "data", data_axis="data"))
    dp = q4jax.LinearSharding(mesh2, "column", "model", data_axis="data")
    lyr = l4(256, 64, compress_statistics=False).shard(dp)
    out["batch_not_divisible"] = error_of(lambda: lyr(jnp.ones((3, 256))))
    # arrays in the wrong layout / placement for the requested sharding
    packed, state = q4jax.quantize_4bit(jnp.ones((64, 512)), 64, "nf4", False)
    out["row_layout_mismatch"] = error_of(lambda: q4jax.sharded_matmul_4bit(jnp.ones((2, 512)), packed, state, row))
    p_col, s_col = q4jax.shard_4bit(packed, state, col)
    rep = q4jax.LinearSharding(mesh, "replicated")
    out["placement_mismatch"] = error_of(lambda: q4jax.sharded_matmul_4bit(jnp.ones((2, 512)), p_col, s_col, rep))
    other = jax.make_mesh((4,), ("model",), devices=jax.devices()[:4])
    p_other, s_other = q4jax.shard_4bit(packed, state, q4jax.LinearSharding(other, "column", "model"))
    out["mesh_mismatch"] = error_of(lambda: q4jax.sharded_matmul_4bit(jnp.ones((2, 512)), p_other, s_other, col))
    # shard_model validates every layer before changing any
    model = MLP(64, 100, rngs=rngs)
    q4jax.quantize_model(model, "nf4", compress_statistics=False, skip=())
    out["shard_model_bad_layer"] = error_of(lambda: q4jax.shard_model(model, mesh, {"up": "column", "down": "row"}))
    out["shard_model_untouched"] = {
        "up": model.up.sharding is None,
        "down": model.down.sharding is None,
        "devices": len(model.up.weight.get_value().sharding.device_set),
    }
    out["shard_model_unmatched_rule"] = error_of(lambda: q4jax.shard_model(model, mesh, {"nope": "column"}))
    out["shard_model_bad_mode"] = error_of(lambda: q4jax.shard_model(model, mesh, {"up": "diagonal"}))
    out["shard_model_both_modes"] = error_of(lambda: q4jax.shard_model(model, mesh, {"up": "column", "u*": "row"}))
    out["shard_model_unknown_axis"] = error_of(
        lambda: q4jax.shard_model(model, mesh, {"up": "column"}, model_axis="tp")
    )
    return out


if __name__ == "__main__":
    if len(sys.argv) != 2:
        raise SystemExit(__doc__)
    if len(jax.devices()) != DEVICES:
        raise SystemExit(f"needs {DEVICES} devices, JAX has {jax.devices()}\n{__doc__}")
    t0 = time.perf_counter()
    run_checks()
    RESULTS["_meta"] = {"devices": len(jax.devices()), "jax": jax.__version__, "seconds": time.perf_counter() - t0}
    with open(sys.argv[1], "w") as f:
        json.dump(RESULTS, f, indent=1)
