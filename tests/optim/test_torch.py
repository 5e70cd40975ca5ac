"""q4torch.optim against bitsandbytes' own optimizers (the test peer) and the oracle:
same names and defaults, the same state bytes after the same steps, state_dicts
that load both ways, fp32 states where bitsandbytes keeps them, and bad input
named in the error."""

from __future__ import annotations

import bitsandbytes as bnb
import numpy as np
import pytest
import torch
from q4_testing.optim_cases import CASES, gradients

import q4torch
from q4torch import optim as qoptim

STATE_KEYS = ("state1", "absmax1", "state2", "absmax2", "qmap1", "qmap2")


def _pair(case, shape, rng, dtype=torch.float32, **extra):
    p0 = torch.from_numpy(rng.standard_normal(shape).astype(np.float32)).to(dtype)
    a, b = torch.nn.Parameter(p0.clone()), torch.nn.Parameter(p0.clone())
    kw = {**case.kwargs, **extra}
    return a, getattr(qoptim, case.cls)([a], **kw), b, getattr(bnb.optim, case.cls)([b], **kw)


def _grads(rng, shape, steps, dtype=torch.float32):
    return [torch.from_numpy(g).reshape(shape).to(dtype) for g in gradients(rng, int(np.prod(shape)), steps)]


def _assert_same_state(sa, sb):
    for key in STATE_KEYS:
        if key in sb:
            assert key in sa, key
            assert torch.equal(sa[key].view(torch.uint8), sb[key].view(torch.uint8)), key
    assert sa["step"] == sb["step"]


def _assert_close_params(case, a, b):
    if case.rule in ("adam", "rmsprop"):  # PyTorch's sqrt is not always correctly rounded
        a32, b32 = a.detach().float(), b.detach().float()
        assert (a32 - b32).abs().max() <= 8 * torch.finfo(torch.float32).eps * b32.abs().max()
    else:
        assert torch.equal(a.detach(), b.detach())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_same_state_bytes_as_bitsandbytes(case, dtype, rng):
    shape = (33, 70)  # 2310 elements: a partial last block
    a, qa, b, qb = _pair(case, shape, rng, dtype, min_8bit_size=0)
    for g in _grads(rng, shape, 3, dtype):
        a.grad, b.grad = g.clone(), g.clone()
        qa.step()
        qb.step()
        _assert_same_state(qa.state[a], qb.state[b])
        _assert_close_params(case, a, b)
    assert qa.state[a]["state1"].dtype == torch.uint8


@pytest.mark.parametrize("case", CASES[:3], ids=lambda c: c.id)
def test_state_dict_loads_both_ways(case, rng):
    shape = (64, 80)
    a, qa, b, qb = _pair(case, shape, rng)
    grads = _grads(rng, shape, 4)
    for g in grads[:2]:
        a.grad, b.grad = g.clone(), g.clone()
        qa.step()
        qb.step()
    # cross-load: q4 continues from bitsandbytes' state, bitsandbytes from q4's
    a2, b2 = torch.nn.Parameter(b.detach().clone()), torch.nn.Parameter(a.detach().clone())
    qa2 = getattr(qoptim, case.cls)([a2], **case.kwargs)
    qb2 = getattr(bnb.optim, case.cls)([b2], **case.kwargs)
    qa2.load_state_dict(qb.state_dict())
    qb2.load_state_dict(qa.state_dict())
    _assert_same_state(qa2.state[a2], qb.state[b])
    _assert_same_state(qb2.state[b2], qa.state[a])
    assert set(qa.state_dict()["state"][0]) == set(qb.state_dict()["state"][0])
    for g in grads[2:]:
        for p, o in ((a, qa), (b, qb), (a2, qa2), (b2, qb2)):
            p.grad = g.clone()
            o.step()
    _assert_same_state(qa2.state[a2], qb.state[b])
    _assert_same_state(qb2.state[b2], qa.state[a])


def test_small_parameters_and_optim_bits_32_keep_fp32_state_like_bitsandbytes(rng):
    small = CASES[0]
    a, qa, b, qb = _pair(small, (10, 10), rng)  # 100 < min_8bit_size 4096
    for g in _grads(rng, (10, 10), 2):
        a.grad, b.grad = g.clone(), g.clone()
        qa.step()
        qb.step()
    assert qa.state[a]["state1"].dtype == torch.float32
    _assert_same_state(qa.state[a], qb.state[b])
    assert torch.equal(a.detach(), b.detach())
    for cls in ("AdamW32bit", "Lion32bit", "RMSprop32bit"):
        pa, pb = torch.nn.Parameter(torch.ones(300, 20)), torch.nn.Parameter(torch.ones(300, 20))
        oa, ob = getattr(qoptim, cls)([pa], lr=1e-2), getattr(bnb.optim, cls)([pb], lr=1e-2)
        for g in _grads(rng, (300, 20), 2):
            pa.grad, pb.grad = g.clone(), g.clone()
            oa.step()
            ob.step()
        _assert_same_state(oa.state[pa], ob.state[pb])
        assert torch.equal(pa.detach(), pb.detach()), cls


@pytest.fixture
def manager():
    mng = qoptim.GlobalOptimManager.get_instance()
    yield mng
    mng.initialize()  # the manager is process-global: drop this test's overrides


def test_global_optim_manager_override_and_stable_embedding(manager, rng):
    mng = manager
    model = torch.nn.Sequential(torch.nn.Linear(128, 128), torch.nn.Linear(128, 128))
    mng.override_config(model[0].weight, "optim_bits", 32)
    emb = q4torch.nn.StableEmbedding(64, 128)
    opt = qoptim.AdamW8bit([*model.parameters(), emb.weight], min_8bit_size=0)
    for p in [*model.parameters(), emb.weight]:
        p.grad = torch.ones_like(p)
    opt.step()
    assert opt.state[model[0].weight]["state1"].dtype == torch.float32
    assert opt.state[model[1].weight]["state1"].dtype == torch.uint8
    assert opt.state[emb.weight]["state1"].dtype == torch.float32


def test_paged_is_the_same_optimizer(rng):
    case = CASES[0]
    p0 = torch.randn(40, 100)
    a, b = torch.nn.Parameter(p0.clone()), torch.nn.Parameter(p0.clone())
    oa, ob = qoptim.PagedAdamW8bit([a], min_8bit_size=0), qoptim.AdamW8bit([b], min_8bit_size=0)
    for g in _grads(rng, (40, 100), 2):
        a.grad, b.grad = g.clone(), g.clone()
        oa.step()
        ob.step()
    _assert_same_state(oa.state[a], ob.state[b])
    assert torch.equal(a, b) and case.cls == "AdamW8bit"


def test_percentile_clipping_and_block_wise_arguments(rng):
    # bitsandbytes' (pre-0.50) percentile clipping: the squared gradient norms of the last
    # 100 steps (a window that starts as zeros), the gradient scaled down to the norm at the
    # given percentile of the window: while fewer than 100 - percentile steps were taken that
    # norm is 0 and the step moves nothing; percentile 100 never clips.
    p = torch.nn.Parameter(torch.randn(64, 64))
    opt = qoptim.Adam8bit([p], percentile_clipping=5, min_8bit_size=0)
    before = p.detach().clone()
    grads = _grads(rng, (64, 64), 3)
    for g in grads:
        p.grad = g
        opt.step()
    norms = torch.stack([g.pow(2).sum() for g in grads])
    torch.testing.assert_close(opt.state[p]["gnorm_vec"][1:4], norms)
    assert torch.equal(p, before)
    with pytest.raises(ValueError, match="block_wise=False"):
        qoptim.Adam8bit([p], block_wise=False)
    with pytest.raises(ValueError, match="percentile_clipping must be in \\(0, 100\\], got 0"):
        qoptim.Adam8bit([p], percentile_clipping=0)
    with pytest.raises(ValueError, match="AdamW8bit only supports optim_bits=32"):
        qoptim.AdamW8bit([p], optim_bits=8)
    with pytest.raises(ValueError, match="does not support amsgrad"):
        qoptim.AdamW8bit([p], amsgrad=True)


def test_nonfinite_gradient_raises_and_leaves_those_blocks_unchanged(rng):
    p = torch.nn.Parameter(torch.randn(1024))
    opt = qoptim.AdamW8bit([p], min_8bit_size=0)
    p.grad = torch.randn(1024)
    opt.step()
    state = {k: v.clone() for k, v in opt.state[p].items() if isinstance(v, torch.Tensor)}
    before = p.detach().clone()
    g = torch.randn(1024)
    g[5] = float("nan")
    p.grad = g
    with pytest.raises(FloatingPointError, match="group 0 parameter 0 \\(shape \\(1024,\\)\\): 1 of 4 blocks"):
        opt.step()
    assert torch.equal(p[:256], before[:256]) and not torch.equal(p[256:], before[256:])
    assert torch.equal(opt.state[p]["state1"][:256], state["state1"][:256])
    assert torch.equal(opt.state[p]["absmax2"][0], state["absmax2"][0])


def test_bad_state_dicts_are_named(rng):
    p = torch.nn.Parameter(torch.randn(300, 20))
    opt = qoptim.AdamW8bit([p])
    p.grad = torch.randn(300, 20)
    opt.step()
    good = opt.state_dict()

    def broken(key, value):
        sd = {"state": {0: dict(good["state"][0])}, "param_groups": good["param_groups"]}
        sd["state"][0]["__bnb_optimizer_quant_state__"] = {
            **good["state"][0]["__bnb_optimizer_quant_state__"],
            key: value,
        }
        return sd

    fresh = qoptim.AdamW8bit([torch.nn.Parameter(torch.randn(300, 20))])
    with pytest.raises(ValueError, match="group 0 parameter 0: state1 must be torch.uint8 of the parameter's shape"):
        fresh.load_state_dict(broken("state1", torch.zeros(20, 300, dtype=torch.uint8)))
    with pytest.raises(ValueError, match="absmax2 must be float32 with 24 blocks of 256, got torch.float32 \\(23,\\)"):
        fresh.load_state_dict(broken("absmax2", torch.zeros(23)))
    with pytest.raises(ValueError, match="qmap1 must be sorted ascending"):
        fresh.load_state_dict(broken("qmap1", good["state"][0]["__bnb_optimizer_quant_state__"]["qmap1"].flip(0)))
    with pytest.raises(ValueError, match="qmap2 must be 256 float32 values, got torch.float16"):
        fresh.load_state_dict(broken("qmap2", torch.zeros(256, dtype=torch.float16)))
    wrong_param = qoptim.AdamW8bit([torch.nn.Parameter(torch.randn(30, 20))])
    with pytest.raises(ValueError, match="state1 must be torch.uint8 of the parameter's shape \\(30, 20\\)"):
        wrong_param.load_state_dict(good)
    fresh.load_state_dict(good)  # the good one loads
    _assert_same_state(fresh.state[fresh.param_groups[0]["params"][0]], opt.state[p])


@pytest.mark.parametrize("name", [n for n in qoptim.__all__ if n not in ("GlobalOptimManager", "Optimizer8bit")])
def test_names_arguments_and_defaults_are_bitsandbytes(name):
    """Every q4torch.optim class exists in bitsandbytes.optim, and takes each of its
    arguments under the same name with the same default (q4 adds keyword-only ones)."""
    import inspect

    theirs = inspect.signature(getattr(bnb.optim, name)).parameters
    ours = inspect.signature(getattr(qoptim, name)).parameters
    for pname, param in theirs.items():
        assert pname in ours, (name, pname)
        assert ours[pname].default == param.default, (name, pname, ours[pname].default, param.default)
    assert [p for p in ours if p in theirs] == list(theirs), name  # the same positional order


def test_optim_bits_selects_the_state_of_the_generic_classes(rng):
    for cls, kw in (("Adam", {}), ("AdamW", {}), ("Lion", {}), ("SGD", {"lr": 1e-2, "momentum": 0.9}), ("RMSprop", {})):
        for bits, dtype in ((8, torch.uint8), (32, torch.float32)):
            p = torch.nn.Parameter(torch.randn(64, 80))
            opt = getattr(qoptim, cls)([p], optim_bits=bits, min_8bit_size=0, **kw)
            p.grad = torch.randn(64, 80)
            opt.step()
            assert opt.state[p]["state1"].dtype == dtype, (cls, bits)
    with pytest.raises(ValueError, match="optim_bits must be 8 or 32, got 4"):
        qoptim.Adam([torch.nn.Parameter(torch.randn(4))], optim_bits=4)


def test_nonfinite_gradient_leaves_an_fp32_state_parameter_unchanged():
    small = torch.nn.Parameter(torch.randn(10, 10))  # below min_8bit_size: fp32 state
    opt = qoptim.AdamW8bit([small])
    small.grad = torch.randn(10, 10)
    opt.step()
    before = small.detach().clone(), opt.state[small]["state1"].clone()
    small.grad = torch.full((10, 10), float("inf"))
    with pytest.raises(FloatingPointError, match="shape \\(10, 10\\)\\): all of it \\(fp32 state\\)"):
        opt.step()
    assert torch.equal(small, before[0]) and torch.equal(opt.state[small]["state1"], before[1])
    assert opt.state[small]["step"] == 1


def test_empty_parameters_take_fp32_state_and_step():
    e = torch.nn.Parameter(torch.zeros(0, 16))
    opt = qoptim.AdamW8bit([e], min_8bit_size=0)
    e.grad = torch.zeros(0, 16)
    opt.step()
    assert opt.state[e]["state1"].dtype == torch.float32 and opt.state[e]["state1"].shape == (0, 16)
