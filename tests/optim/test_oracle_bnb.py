"""The optimizer oracle against bitsandbytes 0.50.2's own CPU 8-bit optimizers:
the same steps on the same gradients give the same state bytes (state1 /
state2 codes and absmax), and the same parameters when the oracle takes
PyTorch's square root (PyTorch's CPU sqrt is not always correctly rounded;
the oracle's own sqrt is)."""

from __future__ import annotations

import bitsandbytes as bnb
import ml_dtypes
import numpy as np
import pytest
import torch
from q4_reference import optim8
from q4_reference.oracle import dynamic_map
from q4_testing.optim_cases import CASES, gradients, oracle_steps


def torch_sqrt(x):
    return torch.sqrt(torch.from_numpy(np.ascontiguousarray(x, np.float32))).numpy()


def test_maps_match_bitsandbytes():
    # the oracle evaluates linspace exactly; bitsandbytes in fp32: within 2 ulp
    for ours, signed in ((dynamic_map(), True), (optim8.unsigned_dynamic_map(), False)):
        theirs = bnb.functional.create_dynamic_map(signed=signed).numpy()
        np.testing.assert_array_max_ulp(ours, theirs, maxulp=2)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_oracle_matches_bitsandbytes(case, dtype, rng):
    n = 256 * 9 + 77  # a partial last block
    p0 = rng.standard_normal(n).astype(np.float32)
    tdtype = getattr(torch, dtype)
    p0 = torch.from_numpy(p0).to(tdtype).float().numpy()
    grads = [torch.from_numpy(g).to(tdtype).float().numpy() for g in gradients(rng, n, 4)]
    param = torch.nn.Parameter(torch.from_numpy(p0.copy()).to(tdtype))
    opt = getattr(bnb.optim, case.cls)([param], **case.kwargs, min_8bit_size=0)
    qmap1 = bnb.functional.create_dynamic_map(signed=True).numpy()
    qmap2 = bnb.functional.create_dynamic_map(signed=False).numpy()

    def round_param(p):
        return p.astype(ml_dtypes.bfloat16).astype(np.float32) if dtype == "bfloat16" else p

    with torch.no_grad():
        for g, (p, s1, a1, s2, a2) in zip(
            grads, oracle_steps(case, p0, grads, torch_sqrt, qmap1, qmap2, round_param), strict=True
        ):
            param.grad = torch.from_numpy(g).to(tdtype)
            opt.step()
            st = opt.state[param]
            np.testing.assert_array_equal(st["state1"].numpy(), s1)
            np.testing.assert_array_equal(st["absmax1"].numpy().view(np.uint32), a1.view(np.uint32))
            if s2 is not None:
                np.testing.assert_array_equal(st["state2"].numpy(), s2)
                np.testing.assert_array_equal(st["absmax2"].numpy().view(np.uint32), a2.view(np.uint32))
            np.testing.assert_array_equal(param.detach().float().numpy().view(np.uint32), p.view(np.uint32))


@pytest.mark.parametrize("case", [c for c in CASES if c.rule in ("adam", "rmsprop")], ids=lambda c: c.id)
def test_correct_sqrt_changes_only_last_bits_of_the_parameter(case, rng):
    """With its own (correctly rounded) sqrt the oracle's state is unchanged and
    the parameter differs from the torch-sqrt run in the last bits only: a
    denominator one ulp off moves each step's update by about an ulp of the
    update, so over 3 steps |difference| <= 8 ulp of the largest |parameter|."""
    n = 256 * 4
    p0 = rng.standard_normal(n).astype(np.float32)
    grads = gradients(rng, n, 3)
    ours = list(oracle_steps(case, p0, grads))
    theirs = list(oracle_steps(case, p0, grads, torch_sqrt))
    for a, b in zip(ours, theirs, strict=True):
        for x, y in zip(a[1:], b[1:], strict=True):
            if x is not None:
                np.testing.assert_array_equal(x, y)
        assert np.abs(a[0] - b[0]).max() <= 8 * np.spacing(np.abs(b[0]).max())
