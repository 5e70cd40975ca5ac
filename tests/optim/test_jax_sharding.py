"""q4jax.optim with a parameter sharded over a 2-device mesh (run in a subprocess by
sharding_worker.py): the state is sharded like the parameter (codes like it, absmax along
the block axis), and the sharded steps give the one-device bytes; a shard that would split
a block of 256 is refused, named."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

WORKER = Path(__file__).with_name("sharding_worker.py")
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("optim_sharding") / "results.json"
    env = dict(os.environ)
    env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=2").strip()
    env["JAX_PLATFORMS"] = "cpu"
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    proc = subprocess.run(
        [sys.executable, str(WORKER), str(out)], env=env, capture_output=True, text=True, timeout=300, cwd=ROOT
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    res = json.loads(out.read_text())
    assert "error" not in res, res["error"]
    return res


@pytest.mark.parametrize("name", ["adamw", "lion"])
def test_sharded_state_follows_the_parameter_and_gives_the_same_bytes(results, name):
    r = results[name]
    assert r["same_state"] and r["same_params"], r
    assert r["state1_spec"] == "P('x', None)" and r["absmax1_spec"] == "P('x',)", r
    assert r["skipped"] == 1


def test_a_shard_splitting_a_block_is_refused(results):
    assert "must hold whole blocks of 256 elements (got 100 elements per shard)" in results["bad_blocks"]
