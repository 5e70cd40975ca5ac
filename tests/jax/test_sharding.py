"""q4jax over a device mesh (SPMD): column- and row-parallel, data-parallel.

The multi-device checks need 8 host CPU devices, which this process cannot
have (JAX is already initialised with one): sharding_worker.py runs them all
once, in a subprocess with --xla_force_host_platform_device_count=8, against
the same computation on one device, and writes its measurements as JSON; the
tests below assert on them. A check that raised in the worker fails its test
with the worker's traceback.

Tolerance. A sharded result that is not bit-exact differs from one device only
in the order of fp32 sums: the S = 8 partial outputs of a row-parallel layer
(psum), the S partial input gradients of a column-parallel layer, a gradient
summed over S batch shards, and the 4-bit kernel's blocking of its k-loop,
which depends on its batch size (a data-split batch is a smaller local batch).
Reordering a sum changes it by at most about (terms - 1) * eps * sum|terms|;
for these random inputs sum|terms| is within a small factor of max|result|,
so we allow 64 ulps of the largest reference value:
max|diff| <= 64 * 2**-23 * max|ref| (7.6e-6 relative). Measured: at most
1.2e-6 relative (about 10 ulps). A scalar loss is a sum over all outputs, so
its scale is sum|terms| rather than |loss|. The failure modes this guards
against are orders of magnitude larger: per-shard int8 row statistics or
outlier columns (controls below) differ by 5e-4 to 7e-3 relative, a missing
or doubled psum by O(1).
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

import q4jax

WORKER = Path(__file__).with_name("sharding_worker.py")
ROOT = Path(__file__).resolve().parents[2]
DEVICES = 8
REORDER_TOL = 64 * 2.0**-23

TP_CASES = ["nf4-bs64", "nf4-bs64-nested", "fp4-bs64", "fp4-bs64-nested", "int8-t0", "int8-t6"]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("sharding") / "results.json"
    env = dict(os.environ)
    env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={DEVICES}").strip()
    env["JAX_PLATFORMS"] = "cpu"
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    proc = subprocess.run(
        [sys.executable, str(WORKER), str(out)], env=env, capture_output=True, text=True, timeout=600, cwd=ROOT
    )
    assert proc.returncode == 0, f"sharding worker exited with {proc.returncode}:\n{proc.stderr[-6000:]}"
    return json.loads(out.read_text())


def result(results, name):
    assert name in results, f"the worker recorded no result for {name!r} (has {sorted(results)})"
    r = results[name]
    if "error" in r:
        pytest.fail(f"worker check {name!r} raised:\n{r['error']}")
    return r


def assert_exact(c, what):
    assert c["exact"], f"{what}: expected bit-exact, max |diff| = {c['max_abs']:.3g} (reference max {c['ref_max']:.3g})"


def assert_close(c, what, scale=None):
    scale = c["ref_max"] if scale is None else scale
    assert c["max_abs"] <= REORDER_TOL * scale, (
        f"{what}: max |diff| = {c['max_abs']:.3g} > {REORDER_TOL:.3g} x {scale:.4g} (fp32 reordering tolerance)"
    )


def test_worker_has_8_devices(results):
    assert results["_meta"]["devices"] == DEVICES, results["_meta"]


# ------------------------------------------------------------------ tensor parallel


@pytest.mark.parametrize("kind", TP_CASES)
def test_tensor_parallel_mlp_equals_one_device(results, kind):
    """Megatron MLP (up column-parallel, gelu, down row-parallel) over 8
    devices vs one device: forward, input gradient, bias gradients."""
    r = result(results, f"tp-mlp-{kind}")
    assert (r["up_sharding"], r["down_sharding"], r["model_axis_size"]) == ("column", "row", DEVICES)
    # the batch is not split: the column-parallel forward is the same kernel sum per output
    assert_exact(r["up_forward"], "column-parallel forward")
    assert_exact(r["d_bias_down"], "row-parallel bias gradient (a sum over the unsplit batch)")
    assert_close(r["y"], "MLP output (row-parallel psum of 8 partials)")
    assert_close(r["dx"], "input gradient (column-parallel psum of 8 partials)")
    assert_close(r["d_bias_up"], "column-parallel bias gradient")
    assert_close(r["loss"], "loss", scale=r["loss_terms"])
    assert r["y_sharding"] == str(P(None, None, None)), "the MLP output should be replicated"
    assert r["shardings_cover_state"]


@pytest.mark.parametrize("kind", ["nf4-bs64-nested", "int8-t6"])
def test_data_and_tensor_parallel_mlp(results, kind):
    """2 (data) x 4 (model): the batch split too (nf4 on a mesh with Auto axes,
    int8 on Explicit axes with a 3-D input)."""
    r = result(results, f"tp-dp-mlp-{kind}")
    assert r["model_axis_size"] == 4
    assert r["y_sharding"].startswith("P('data'"), r["y_sharding"]
    if kind.startswith("int8"):
        # int32 accumulation: the batch split does not change an int8 output,
        # since outlier columns are taken over the whole batch
        assert_exact(r["up_forward"], "int8 column-parallel forward, batch split")
    else:
        assert_close(r["up_forward"], "4-bit column-parallel forward, batch split (kernel blocking)")
    for key in ("y", "dx", "d_bias_up", "d_bias_down"):
        assert_close(r[key], key)
    assert_close(r["loss"], "loss", scale=r["loss_terms"])


@pytest.mark.parametrize("kind", [k for k in TP_CASES if not k.startswith("int8")])
def test_nested_statistics_layouts(results, kind):
    """Nested groups are kept where shard boundaries fall on them (up: 256
    blocks per shard) and decoded exactly where they do not (down: 1 block per
    row slice, with unnest=True); the dequantized weights are unchanged."""
    r = result(results, f"tp-mlp-{kind}")
    nested = kind.endswith("nested")
    assert r["up_nested_kept"] == nested
    assert r["down_nested_kept"] is False
    assert r["decoded_layers"] == (["down."] if nested else [])
    assert r["dequantized_equal"], "sharding changed the dequantized weight"
    # row-parallel packed bytes live as [out, in/2] split on axis 1: 512/8 inputs -> 32 bytes per row
    assert r["down_packed_local_shape"] == [256, 32]


@pytest.mark.parametrize("kind", TP_CASES)
def test_checkpoint_of_sharded_model(results, kind):
    """state_dict of a sharded model is the canonical format (equal to the
    unsharded model's, except decoded nested statistics); loading a checkpoint
    into it keeps it sharded and its output."""
    r = result(results, f"tp-mlp-{kind}")
    assert r["state_dict_equal"]
    assert r["reload_still_sharded"]
    assert_close(r["reload_y"], "output after load_state_dict")


def test_row_parallel_layer(results):
    """Row-parallel alone: the input gradient is bit-exact (its sum over
    outputs is not split); the forward sums 8 fp32 partials. int8 takes a pmax
    of the row statistics: a control that quantizes each shard with its own
    statistics is far off."""
    r = result(results, "row-layer")
    for kind in ("nf4", "int8-t6"):
        assert_exact(r[kind]["dx"], f"{kind} row-parallel input gradient")
        assert_close(r[kind]["y"], f"{kind} row-parallel output")
    control = r["int8-t6"]["naive_local_stats_control"]
    assert control["max_abs"] > 100 * REORDER_TOL * control["ref_max"], control


@pytest.mark.parametrize("kind", ["nf4-bs64-nested", "int8-t6"])
def test_remat_recomputes_on_the_shards(results, kind):
    assert_exact(result(results, "remat")[kind], "gradients under jax.checkpoint(nothing_saveable)")


def test_bf16_activations(results):
    """bf16 in and out: partial sums stay fp32 and are rounded once, as on one device."""
    r = result(results, "bf16")
    for kind in ("nf4-bs64-nested", "int8-t6"):
        assert r[kind]["dtype"] == "bfloat16"
        # one bf16 rounding of values that agree to fp32 reordering: at most one bf16 ulp
        assert r[kind]["max_abs"] <= 2.0**-7 * r[kind]["ref_max"], r[kind]


# ------------------------------------------------------------------ compiled HLO


@pytest.mark.parametrize("name", ["hlo-column-4bit", "hlo-column-int8"])
def test_column_parallel_hlo_keeps_weight_sharded(results, name):
    """No all-gather of the packed / int8 weight; every q4 kernel gets 1/8 of
    it. The control (the same placed arrays through the plain op, no
    partitioning rule) all-gathers and runs the kernel on the full weight, so
    this check can fail."""
    r = result(results, name)
    for key in [k for k in r if k.startswith("ours")]:
        facts = r[key]
        assert facts["weight_all_gathers"] == [], f"{key}: {facts['weight_all_gathers']}"
        assert facts["kernel_weight_elems"], f"{key}: no q4 kernel in the HLO"
        assert max(facts["kernel_weight_elems"]) <= facts["full_weight_elems"] // DEVICES, facts
    naive = r["naive_forward"]
    assert naive["weight_all_gathers"], "control: the plain op should all-gather the sharded weight"
    assert max(naive["kernel_weight_elems"]) == naive["full_weight_elems"], naive


@pytest.mark.parametrize("kind", ["nf4-bs64-nested", "int8-t6"])
def test_mlp_train_step_hlo(results, kind):
    """Forward + backward of the column/row MLP: no weight all-gather, every
    kernel on a shard, and only the collectives Megatron needs: the forward
    psum and the backward psum (+ the int8 row-statistics pmax)."""
    facts = result(results, "hlo-tp-mlp-train")[kind]
    assert facts["weight_all_gathers"] == [], facts["weight_all_gathers"]
    assert max(facts["kernel_weight_elems"]) <= facts["full_weight_elems"] // DEVICES + facts["row_pad_elems"], facts
    assert facts["all_reduces"] == (3 if kind.startswith("int8") else 2), facts


# ------------------------------------------------------------------ data parallel


@pytest.mark.parametrize("name", ["dp-qlora-nf4-bs64-nested", "dp-qlora-fp4-bs64"])
def test_data_parallel_qlora_step(results, name):
    """A QLoRA SGD step (frozen Linear4bit bases, fp32 adapters) with the batch
    of 32 split over 8 devices on 'data': same loss, adapter gradients and
    updated adapters as one device. Each kernel runs on the local 4 rows; the
    control without the rule runs it on all 32 (XLA gathers the batch)."""
    r = result(results, name)
    assert_close(r["loss"], "loss (a mean of squares: positive terms)")
    assert_close(r["grads"], "adapter gradients (summed over 8 batch shards)")
    assert_close(r["updated"], "updated adapters")
    assert r["grad_leaves"] == 4 and r["base_params_frozen"], "only the four adapters are trainable"
    assert r["adapter_sharding"] == str(P())
    assert r["kernel_x_rows"] and set(r["kernel_x_rows"]) == {r["local_rows"]}, r["kernel_x_rows"]
    assert set(r["naive_kernel_x_rows"]) == {r["batch"]}, r["naive_kernel_x_rows"]
    assert r["weight_all_gathers"] == []


def test_data_parallel_int8_outlier_columns(results):
    """LLM.int8 threshold 6 with outliers in single rows of different data
    shards: bit-exact with one device; quantizing each shard on its own (the
    control) is not."""
    r = result(results, "dp-int8-t6-outliers")
    assert_exact(r["sharded"], "data-parallel int8 forward")
    control = r["per_shard_control"]
    assert control["max_abs"] > 10 * REORDER_TOL * control["ref_max"], control


# ------------------------------------------------------------------ bad requests

ERRORS = {
    "column_block_boundary": ("ValueError", ["shard boundary inside a block", "80 elements", "blocksize 64"]),
    "row_block_boundary": ("ValueError", ["shard boundary inside a block", "32 elements", "blocksize 64"]),
    "column_out_not_divisible": ("ValueError", ["out_features 100", "'model'"]),
    "row_in_not_divisible": ("ValueError", ["in_features 100", "'model'"]),
    "int8_column_not_divisible": ("ValueError", ["out_features 100"]),
    "int8_row_not_divisible": ("ValueError", ["in_features 100"]),
    "nested_row": ("ValueError", ["nested statistics", "4 blocks", "256-block", "unnest=True"]),
    "nested_column": ("ValueError", ["nested statistics", "8 blocks", "256-block", "unnest=True"]),
    "unknown_axis": ("ValueError", ["unknown mesh axis 'tensor'", "('data', 'model')"]),
    "unknown_data_axis": ("ValueError", ["unknown data axis 'batch'"]),
    "axis_is_data_axis": ("ValueError", ["'data'", "both the features"]),
    "batch_not_divisible": ("ValueError", ["is 3, not divisible by 2"]),
    "row_layout_mismatch": ("ValueError", ["packed has shape (16384, 1)", "(64, 256)", "shard_4bit"]),
    "placement_mismatch": ("ValueError", ["placed as P('model', None)", "P(None, None)"]),
    "mesh_mismatch": ("ValueError", ["{'model': 4}", "{'model': 8}"]),
    "shard_model_bad_layer": ("ValueError", ["down: in_features 100", "up: out_features 100"]),
    "shard_model_unmatched_rule": ("ValueError", ["['nope']", "match no"]),
    "shard_model_bad_mode": ("ValueError", ["'diagonal'"]),
    "shard_model_both_modes": ("ValueError", ["up:", "both column and row"]),
    "shard_model_unknown_axis": ("ValueError", ["unknown mesh axis 'tp'"]),
}


@pytest.mark.parametrize("case", sorted(ERRORS))
def test_bad_sharding_request(results, case):
    want_type, parts = ERRORS[case]
    got = result(results, "errors")[case]
    assert got["type"] == want_type, f"{case}: expected {want_type}, got {got}"
    for part in parts:
        assert part in got["message"], f"{case}: {part!r} not in {got['message']!r}"


def test_failed_shard_model_changes_nothing_and_unnest_decodes(results):
    r = result(results, "errors")
    assert r["shard_model_untouched"] == {"up": True, "down": True, "devices": 1}
    assert r["nested_row_unnest_ok"] == {"nested": False}


# ------------------------------------------------------------------ in this process (one device)


def _mesh1():
    return jax.make_mesh((1, 1), ("data", "model"))


def test_linear_sharding_validates_axes():
    mesh = _mesh1()
    with pytest.raises(ValueError, match="unknown mesh axis 'tensor'"):
        q4jax.LinearSharding(mesh, "column", "tensor")
    with pytest.raises(ValueError, match="mode must be one of"):
        q4jax.LinearSharding(mesh, "diagonal", "model")
    with pytest.raises(ValueError, match="needs a mesh axis"):
        q4jax.LinearSharding(mesh, "row")
    with pytest.raises(ValueError, match="has no tensor-parallel axis, got axis='model'"):
        q4jax.LinearSharding(mesh, "replicated", "model")
    with pytest.raises(ValueError, match="cannot split both"):
        q4jax.LinearSharding(mesh, "column", "model", data_axis=("data", "model"))
    with pytest.raises(TypeError, match="jax.sharding.Mesh"):
        q4jax.LinearSharding("mesh", "column", "model")
    a = q4jax.LinearSharding(mesh, "column", "model", data_axis="data")
    assert a == q4jax.LinearSharding(mesh, "column", "model", data_axis=("data",))
    assert hash(a) == hash(q4jax.LinearSharding(mesh, "column", "model", data_axis=("data",)))


def test_one_device_mesh_round_trip(rng):
    """A tensor axis of size 1 splits nothing: column / row over it use the
    replicated layout (so nested statistics need no decoding), and the sharded
    MLP equals the plain one bit for bit; shard(None) restores the original."""
    mesh = _mesh1()
    model = nnx.Sequential(nnx.Linear(64, 128, rngs=nnx.Rngs(0)), nnx.Linear(128, 64, rngs=nnx.Rngs(1)))
    q4jax.quantize_model(model, "nf4", skip=())
    ref = nnx.clone(model)
    shardings = q4jax.shard_model(model, mesh, {"layers.0": "column", "layers.1": "row"}, data_axis="data")
    assert len(jax.tree.leaves(shardings)) == len(jax.tree.leaves(nnx.state(model)))
    x = jnp.asarray(rng.standard_normal((3, 64)), jnp.float32)
    y0 = jax.jit(lambda m, x: m(x))(ref, x)
    y1 = jax.jit(lambda m, x: m(x))(model, x)
    assert np.array_equal(np.asarray(y0), np.asarray(y1))
    assert [layer.sharding.layout for layer in model.layers] == ["replicated", "replicated"]
    assert model.layers[1].quant_state.get_value().nested
    for layer in model.layers:
        layer.shard(None)
    assert model.layers[1].sharding is None
    sd0, sd1 = q4jax.state_dict(ref), q4jax.state_dict(model)
    assert sorted(sd0) == sorted(sd1) and all(np.array_equal(sd0[k], sd1[k]) for k in sd0)
