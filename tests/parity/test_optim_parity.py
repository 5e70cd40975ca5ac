"""The same 8-bit optimizer steps in PyTorch (q4torch.optim) and JAX (q4jax.optim, under
jit, through optax.apply_updates) give the same state bytes and the same parameters."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import pytest
import torch
from q4_testing.optim_cases import check_applied_params, gradients

from q4jax import optim as joptim
from q4torch import optim as toptim

# (torch class and kwargs, jax factory and kwargs)
PAIRS = {
    "adamw": (("AdamW8bit", dict(lr=1e-3, weight_decay=1e-2)), (joptim.adamw_8bit, dict(learning_rate=1e-3))),
    "adam": (
        ("Adam8bit", dict(lr=2e-3, betas=(0.8, 0.99))),
        (joptim.adam_8bit, dict(learning_rate=2e-3, b1=0.8, b2=0.99)),
    ),
    "lion": (
        ("Lion8bit", dict(lr=1e-4, weight_decay=0.1)),
        (joptim.lion_8bit, dict(learning_rate=1e-4, weight_decay=0.1)),
    ),
    "sgd": (
        ("SGD8bit", dict(lr=1e-2, momentum=0.9, weight_decay=1e-3)),
        (joptim.sgd_8bit, dict(learning_rate=1e-2, momentum=0.9, weight_decay=1e-3)),
    ),
    "rmsprop": (
        ("RMSprop8bit", dict(lr=1e-2, alpha=0.95, weight_decay=1e-3)),
        (joptim.rmsprop_8bit, dict(learning_rate=1e-2, decay=0.95, weight_decay=1e-3)),
    ),
}
DTYPES = {"fp32": (torch.float32, jnp.float32, np.float32), "bf16": (torch.bfloat16, jnp.bfloat16, ml_dtypes.bfloat16)}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", PAIRS)
def test_torch_and_jax_give_the_same_bytes(name, dtype, rng):
    (tcls, tkw), (jfactory, jkw) = PAIRS[name]
    tdt, jdt, ndt = DTYPES[dtype]
    shapes = {"w": (48, 100), "b": (40,)}  # w: 8-bit state (with a partial block); b: fp32 state
    p0 = {k: rng.standard_normal(s).astype(np.float32).astype(ndt) for k, s in shapes.items()}
    grads = [
        {
            k: g.reshape(shapes[k]).astype(ndt)
            for k, g in zip(shapes, (gradients(rng, int(np.prod(s)), 1)[0] for s in shapes.values()), strict=True)
        }
        for _ in range(3)
    ]
    tp = {k: torch.nn.Parameter(torch.from_numpy(v.astype(np.float32)).to(tdt)) for k, v in p0.items()}
    topt = getattr(toptim, tcls)(list(tp.values()), **tkw, min_8bit_size=1000)
    tx = jfactory(**jkw, min_8bit_size=1000)
    jp = {k: jnp.asarray(v, jdt) for k, v in p0.items()}
    state = tx.init(jp)

    @jax.jit
    def jstep(params, state, g):
        updates, state = tx.update(g, state, params)
        return optax.apply_updates(params, updates), state

    for g in grads:
        before = np.asarray(jp["w"]).astype(np.float32)
        for k, t in tp.items():
            t.grad = torch.from_numpy(g[k].astype(np.float32)).to(tdt)
        topt.step()
        jp, state = jstep(jp, state, {k: jnp.asarray(v, jdt) for k, v in g.items()})
        ts = topt.state[tp["w"]]
        np.testing.assert_array_equal(np.asarray(state.state1["w"]), ts["state1"].numpy())
        np.testing.assert_array_equal(np.asarray(state.absmax1["w"]), ts["absmax1"].numpy())
        if "state2" in ts:
            np.testing.assert_array_equal(np.asarray(state.state2["w"]), ts["state2"].numpy())
            np.testing.assert_array_equal(np.asarray(state.absmax2["w"]), ts["absmax2"].numpy())
        check_applied_params(before, np.asarray(jp["w"]), tp["w"].detach().float().numpy())
        # the next step starts from the same parameter in both (an element within an ulp would
        # otherwise stay apart)
        jp["w"] = jnp.asarray(tp["w"].detach().float().numpy().copy(), jdt)  # a copy: torch steps in place
    assert state.state1["w"].dtype == jnp.uint8 and state.state1["b"].dtype == jnp.float32
    assert int(state.step) == 3 and int(state.skipped_blocks) == 0
    # the fp32-state leaf: bitsandbytes' 32-bit arithmetic in jnp and in torch, within rounding
    np.testing.assert_allclose(
        np.asarray(jp["b"]).astype(np.float32), tp["b"].detach().float().numpy(), rtol=1e-5, atol=1e-6
    )
