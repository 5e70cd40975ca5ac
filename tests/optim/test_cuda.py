"""The CUDA optimizer step against the CPU one (same contract, same bytes): q4torch.optim
on CUDA tensors and on CPU copies of them, state bytes and parameter bits equal after
the same steps; the update output and non-finite gradients too. Runs only where a GPU
is present and the library has the CUDA kernels."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from q4_testing.optim_cases import CASES, gradients

import q4
from q4._src import optim8
from q4torch import optim as qoptim

pytestmark = pytest.mark.skipif(q4.cuda_device_count() == 0, reason="needs a GPU and the CUDA kernels")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_cuda_step_gives_the_cpu_bytes(case, dtype, rng):
    shape = (37, 300)  # a partial last block
    p0 = torch.from_numpy(rng.standard_normal(shape).astype(np.float32)).to(dtype)
    a, b = torch.nn.Parameter(p0.clone()), torch.nn.Parameter(p0.clone().cuda())
    oa = getattr(qoptim, case.cls)([a], **case.kwargs, min_8bit_size=0)
    ob = getattr(qoptim, case.cls)([b], **case.kwargs, min_8bit_size=0)
    for g in gradients(rng, a.numel(), 3):
        g = torch.from_numpy(g).reshape(shape).to(dtype)
        a.grad, b.grad = g.clone(), g.clone().cuda()
        oa.step()
        ob.step()
        for key in ("state1", "absmax1", "state2", "absmax2"):
            if key in oa.state[a]:
                x, y = oa.state[a][key], ob.state[b][key].cpu()
                assert torch.equal(x.view(torch.uint8), y.view(torch.uint8)), key
        assert torch.equal(a.detach().view(torch.int16 if dtype == torch.bfloat16 else torch.int32),
                           b.detach().cpu().view(torch.int16 if dtype == torch.bfloat16 else torch.int32))  # fmt: skip


def test_cuda_update_output_and_nonfinite_blocks(rng):
    n = 256 * 6 + 5
    p = torch.from_numpy(rng.standard_normal(n).astype(np.float32) * 0.01)
    g = torch.from_numpy(gradients(rng, n, 1)[0])
    g[300] = float("nan")
    out = {}
    for dev in ("cpu", "cuda"):
        pp, gg = p.clone().to(dev), g.clone().to(dev)
        s1, s2 = torch.zeros(n, dtype=torch.uint8, device=dev), torch.zeros(n, dtype=torch.uint8, device=dev)
        a1, a2 = (torch.zeros(optim8.num_blocks(n), device=dev) for _ in range(2))
        q1 = torch.from_numpy(optim8.qmap(True).copy()).to(dev)
        q2 = torch.from_numpy(optim8.qmap(False).copy()).to(dev)
        u = torch.empty(n, device=dev)
        skipped = torch.zeros(1, dtype=torch.int32, device=dev)
        stream = torch.cuda.current_stream().cuda_stream if dev == "cuda" else None
        optim8.update_8bit_ptr(
            "adam", pp.data_ptr(), 0, gg.data_ptr(), 0, n, s1.data_ptr(), a1.data_ptr(), q1.data_ptr(),
            s2.data_ptr(), a2.data_ptr(), q2.data_ptr(), 1, 1e-3, 0.9, 0.999, 1e-8, 0.01, 1.0,
            skipped.data_ptr(), stream, update=u.data_ptr(),
        )  # fmt: skip
        out[dev] = [t.cpu() for t in (pp, s1, a1, s2, a2, u, skipped)]
    for x, y in zip(out["cpu"], out["cuda"], strict=True):
        assert torch.equal(x.view(torch.uint8), y.view(torch.uint8))
    assert int(out["cuda"][-1]) == 1
