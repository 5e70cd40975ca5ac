"""Runs q4jax.optim on a 2-device CPU mesh and on one device, and writes whether the state
bytes, parameters and shardings agree as JSON (test_jax_sharding.py; the pytest process
has one device already).

usage: XLA_FLAGS=--xla_force_host_platform_device_count=2 python sharding_worker.py OUT.json
"""

from __future__ import annotations

import json
import sys
import traceback

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from q4jax import optim as joptim


def run(tx, params, grads):
    state = tx.init(params)

    @jax.jit
    def step(params, state, g):
        updates, state = tx.update(g, state, params)
        return optax.apply_updates(params, updates), state

    for g in grads:
        params, state = step(params, state, g)
    return params, state


def main(out: str) -> None:
    results: dict = {}
    try:
        assert len(jax.devices()) == 2, jax.devices()
        mesh = jax.make_mesh((2,), ("x",), axis_types=(jax.sharding.AxisType.Auto,))
        rng = np.random.default_rng(0)
        p0 = rng.standard_normal((64, 96)).astype(np.float32)  # 3072 per shard: 12 blocks each
        grads = [rng.standard_normal((64, 96)).astype(np.float32) for _ in range(3)]
        grads[2][40, 5] = np.nan  # a skipped block on the second shard, in the last step
        for name, make in (("adamw", joptim.adamw_8bit), ("lion", joptim.lion_8bit)):
            one_p, one_s = run(make(min_8bit_size=0), {"w": jnp.asarray(p0)}, [{"w": jnp.asarray(g)} for g in grads])
            sh = NamedSharding(mesh, P("x", None))
            sp, ss = run(
                make(min_8bit_size=0),
                {"w": jax.device_put(p0, sh)},
                [{"w": jax.device_put(g, sh)} for g in grads],
            )
            same = all(
                np.array_equal(np.asarray(a), np.asarray(b))
                for a, b in zip(jax.tree.leaves(one_s), jax.tree.leaves(ss), strict=True)
            )
            results[name] = {
                "same_state": bool(same),
                "same_params": bool(np.array_equal(np.asarray(one_p["w"]), np.asarray(sp["w"]))),
                "state1_spec": str(ss.state1["w"].sharding.spec),
                "absmax1_spec": str(ss.absmax1["w"].sharding.spec),
                "skipped": int(ss.skipped_blocks),
            }
        try:
            joptim.adamw_8bit(min_8bit_size=0).init({"w": jax.device_put(np.zeros((2, 100), np.float32), sh)})
            results["bad_blocks"] = "no error"
        except ValueError as e:
            results["bad_blocks"] = str(e)
    except Exception:
        results["error"] = traceback.format_exc()
    with open(out, "w") as f:
        json.dump(results, f)


if __name__ == "__main__":
    main(sys.argv[1])
