"""Linear4bit under FSDP2 (torch.distributed.fsdp.fully_shard), 2 processes on CPU (gloo).

One run of fsdp_worker.py (2 ranks, every check on both) writes a JSON report;
each test below asserts one property from it. Packed weights are stored as
bf16/fp16/fp32 (``quant_storage``), so ~0.4% of bf16 words (3% of fp16) are
NaN bit patterns; all comparisons of packed bytes are on integer views.

Why the exact results are exact:
- forward and input gradients: every rank computes with bit-identical packed
  bytes and QuantState and the same (all-gathered) float parameters, through
  the same kernels on the same batch shapes as the unsharded model;
- parameter gradients: FSDP2 over gloo multiplies each rank's gradient by 1/2
  (exact) and adds the two (one fp32 addition, commutative), so the sharded
  gradient equals (g0 + g1) / 2 of the unsharded model run on each rank's half
  bit for bit. Against the unsharded model on the whole batch only the fp32
  summation order over the batch differs: within RTOL of fsdp_worker.py.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from q4torch import QuantState
from q4torch.nn import Linear4bit

WORKER = Path(__file__).with_name("fsdp_worker.py")
REPO = Path(__file__).resolve().parents[2]
TIMEOUT_S = 300  # the run takes ~10 s; a hang fails instead of blocking CI

pytestmark = pytest.mark.skipif(
    not (dist.is_available() and dist.is_gloo_available()), reason="torch.distributed with gloo is not available"
)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """(report, workdir) of one 2-rank worker run."""
    workdir = tmp_path_factory.mktemp("fsdp")
    report_path = workdir / "report.json"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    # own session: on a timeout the whole group (the worker and its ranks) is killed
    proc = subprocess.Popen(
        [sys.executable, str(WORKER), str(report_path), str(workdir)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        output, _ = proc.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        pytest.fail(f"fsdp_worker.py did not finish in {TIMEOUT_S} s:\n{output[-5000:]}")
    assert proc.returncode == 0 and report_path.exists(), f"fsdp_worker.py failed:\n{output[-5000:]}"
    return json.loads(report_path.read_text()), workdir


@pytest.fixture(scope="module")
def report(run):
    return run[0]


def assert_checks(report, *names):
    failed = {n: report["checks"].get(n, "missing") for n in names if not report["checks"].get(n, {}).get("ok")}
    assert not failed, json.dumps(failed, indent=1)[:6000]


def facts(report, name):
    """A measured value, which must be the same on both ranks."""
    values = [f[name] for f in report["facts"]]
    assert all(v == values[0] for v in values), (name, values)
    return values[0]


STORAGES = ["bf16", "fp16", "fp32"]


def test_every_phase_ran_and_no_warnings(report):
    phases = ["lora_forward_backward", "mixed_precision_allowed", "refusals", "cast_damage", "patterns"]
    assert_checks(report, *[f"{p}_ran" for p in phases])
    assert report["warnings"] == []


def test_quant_state_follows_weight_through_sharding(report):
    # whole on every rank, attached to the DTensor weight; the local shard holds the right rows
    assert_checks(
        report,
        *[f"{k}_{b}" for k in ("quant_state_after_shard", "local_shard_bits") for b in ("block1", "block2")],
        "unsharded_param_carries_quant_state",
    )
    rows = [d["local_rows"] for d in report["checks"]["local_shard_bits_block1"]["detail"]]
    assert rows == [463, 462], "925 packed bf16 rows: uneven shards"


def test_forward_backward_same_batch_bit_exact(report):
    assert_checks(
        report,
        "same_batch_output_bit_exact",
        "same_batch_input_grad_bit_exact",
        "same_batch_param_grads_bit_exact",
        "frozen_packed_weights_have_no_grad",
    )
    params = report["checks"]["same_batch_param_grads_bit_exact"]["detail"][0]["params"]
    assert "block1.lora_a.weight" in params and "block1.base.bias" in params and "head.weight" in params


def test_forward_backward_data_parallel(report):
    assert_checks(
        report,
        "dp_output_bit_exact",
        "dp_input_grad_bit_exact",
        "dp_param_grads_equal_mean_of_per_rank_grads_bit_exact",
        "dp_param_grads_close_to_full_batch",
    )


def test_mixed_precision_that_casts_no_packed_weight(report):
    # param_dtype=bf16 with bf16 storage (block1) and uint8 storage (block2)
    assert_checks(
        report,
        "mp_bf16_output_equals_bf16_unsharded_bit_exact",
        "mp_bf16_all_gathered_bits_block1",
        "mp_bf16_all_gathered_bits_block2",
    )
    storages = [d["storage"] for d in report["checks"]["mp_bf16_all_gathered_bits_block2"]["detail"]]
    assert storages == ["torch.uint8"] * 2


def test_pattern_layers_enumerate_all_16bit_words(report):
    for s in STORAGES:
        assert facts(report, f"pattern_{s}_distinct_16bit_words") == 65536
        assert facts(report, f"pattern_{s}_rows") % 2 == 1, "odd row count: FSDP pads the last shard"
    assert facts(report, "pattern_bf16_nan_elements") >= 254  # every bf16 NaN pattern, plus random extra bytes
    assert facts(report, "pattern_fp16_nan_elements") >= 2046
    assert facts(report, "pattern_fp32_nan_elements") > 0


@pytest.mark.parametrize("storage", STORAGES)
@pytest.mark.parametrize("stage", ["sharded", "reloaded"])
def test_all_16bit_patterns_round_trip(report, stage, storage):
    """shard -> all-gather (full_tensor and FSDP's own unshard, and what the forward
    sees) -> DCP save -> DCP load into a fresh sharded model: bytes, QuantState and
    outputs unchanged."""
    checks = [
        "local_shard_bits",
        "full_tensor_bits",
        "unsharded_param_bits",
        "quant_state",
        "forward_sees_original_bits",
        "output_bit_exact",
    ]
    assert_checks(report, *[f"{stage}_{storage}_{c}" for c in checks])


def test_dcp_reload_into_fresh_model(report):
    saved, fresh = facts(report, "json_entry_length_saved_vs_fresh")
    assert saved != fresh, "the fresh model must exercise a quant-state JSON entry of another length"
    assert_checks(
        report,
        "state_dict_has_quant_state_entries",
        "fresh_model_differs_before_load",
        "default_planner_refuses_other_json_length",
        "load_state_dict_clean",
        "get_model_state_dict_resolves_quant_entries",
        "whole_checkpoint_into_sharded_model",
    )


@pytest.mark.parametrize(
    "name",
    [
        "refuse_param_dtype_fp32_for_bf16_storage",
        "refuse_param_dtype_fp16_for_bf16_storage",
        "refuse_param_dtype_bf16_for_fp32_storage",
        "refuse_shard_dim_1",
        "refuse_unquantized_layer",
        "refused_call_left_layer_alone",
        "forward_refuses_fp32_cast_weight",
        "forward_refuses_dtensor_shard",
        "refuse_float_checkpoint_into_sharded_layer",
        "refuse_plain_tensor_into_sharded_layer",
    ],
)
def test_bad_sharding_requests_raise_clear_errors(report, name):
    assert_checks(report, name)


def test_what_a_param_dtype_cast_would_do(report):
    """Why param_dtype is refused: FSDP casts floating-point parameters before the
    all-gather. bf16 -> fp32 widens exactly, but the layer would read fp32 bytes,
    and any cast back canonicalises NaN payloads; bf16 -> fp16 rounds most words."""
    assert_checks(report, "cast_damage_measured")
    assert facts(report, "param_dtype_float32_all_gathered_dtype") == "torch.float32"
    assert facts(report, "param_dtype_float32_widening_exact") is True
    assert facts(report, "param_dtype_float32_patterns_changed_after_cast_back") > 0
    assert facts(report, "param_dtype_float16_patterns_changed_after_cast_back") > 0


def test_dcp_checkpoint_converts_to_the_unsharded_format(run):
    """The sharded DCP checkpoint, gathered into one file, holds exactly the
    unsharded layers' state dict (bitsandbytes keys) and loads into plain layers."""
    _, workdir = run
    converted = torch.load(workdir / "patterns_converted.pt", weights_only=True)["model"]
    original = torch.load(workdir / "patterns_original.pt", weights_only=True)
    assert sorted(converted) == sorted(original)
    for key, value in original.items():
        got = converted[key]
        assert got.dtype == value.dtype and got.shape == value.shape, key
        assert torch.equal(got.contiguous().view(torch.uint8), value.contiguous().view(torch.uint8)), key
    for name in STORAGES:
        sd = {k[len(name) + 1 :]: v for k, v in converted.items() if k.startswith(name + ".")}
        n, k = QuantState.from_dict({q: v for q, v in sd.items() if q not in ("weight", "bias")}, device="cpu").shape
        layer = Linear4bit(k, n, quant_type="fp4")  # type, storage and state all come from the checkpoint
        layer.load_state_dict(sd, strict=True)
        assert layer.weight.dtype == original[f"{name}.weight"].dtype
        assert torch.equal(layer.weight.data.view(torch.uint8), original[f"{name}.weight"].view(torch.uint8))
