"""The native 8-bit optimizer step (q4/_src/optim8.py over the C ABI) against
the numpy oracle, at every ISA level: the same state bytes and parameter bits,
for fp32 / bf16 parameters and gradients, partial last blocks, any thread count;
blocks with a non-finite gradient left unchanged and counted; bad arguments
named in the error."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from q4_reference import optim8 as oracle
from q4_testing.optim_cases import CASES, gradients

import q4
from q4._src import optim8
from q4._src.native import KernelError

BF16 = ml_dtypes.bfloat16


def _run(case, p0, grads, dtype, gdtype):
    n = p0.size
    p = p0.astype(dtype)
    s1, a1, s2, a2 = oracle.initial_state(n, case.rule)
    out = []
    for step, g in enumerate(grads, 1):
        skipped = optim8.update_8bit(
            case.rule, p, g.astype(gdtype), s1, a1, s2, a2, step=step, lr=case.lr, beta1=case.beta1,
            beta2=case.beta2, eps=case.eps, weight_decay=case.weight_decay,
        )  # fmt: skip
        assert skipped == 0
        second = (None, None) if s2 is None else (s2.copy(), a2.copy())
        out.append((p.astype(np.float32), s1.copy(), a1.copy(), *second))
    return out


@pytest.mark.parametrize("dtypes", [("float32", "float32"), ("bfloat16", "bfloat16"), ("float32", "bfloat16")])
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_step_matches_oracle(case, dtypes, isa_all, rng):
    pdt, gdt = (np.float32 if d == "float32" else BF16 for d in dtypes)
    n = 256 * 7 + 45
    p0 = rng.standard_normal(n).astype(np.float32).astype(pdt).astype(np.float32)
    grads = [g.astype(gdt).astype(np.float32) for g in gradients(rng, n, 3)]

    def round_param(p):
        return p.astype(pdt).astype(np.float32)

    want = list(_steps(case, p0, grads, round_param))
    got = _run(case, p0, grads, pdt, gdt)
    for (gp, gs1, ga1, gs2, ga2), (wp, ws1, wa1, ws2, wa2) in zip(got, want, strict=True):
        np.testing.assert_array_equal(gs1, ws1)
        np.testing.assert_array_equal(ga1.view(np.uint32), wa1.view(np.uint32))
        if ws2 is not None:
            np.testing.assert_array_equal(gs2, ws2)
            np.testing.assert_array_equal(ga2.view(np.uint32), wa2.view(np.uint32))
        np.testing.assert_array_equal(gp.view(np.uint32), wp.view(np.uint32))


def _steps(case, p0, grads, round_param):
    from q4_testing.optim_cases import oracle_steps

    # the library's maps (bit-equal to bitsandbytes': test_library_maps_are_bitsandbytes_maps);
    # the oracle's own are within 2 ulp of them
    return oracle_steps(case, p0, grads, qmap1=optim8.qmap(True), qmap2=optim8.qmap(False), round_param=round_param)


def test_same_bytes_for_any_thread_count(rng):
    case = CASES[0]
    n = 256 * 300 + 7
    p0 = rng.standard_normal(n).astype(np.float32)
    grads = gradients(rng, n, 2)
    before = q4.num_threads()
    try:
        q4.set_num_threads(1)
        one = _run(case, p0, grads, np.float32, np.float32)
        q4.set_num_threads(2)
        two = _run(case, p0, grads, np.float32, np.float32)
    finally:
        q4.set_num_threads(before)
    for a, b in zip(one, two, strict=True):
        for x, y in zip(a, b, strict=True):
            np.testing.assert_array_equal(x, y)


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_nonfinite_gradient_blocks_are_left_unchanged(bad, isa_all, rng):
    n = 256 * 4
    p = rng.standard_normal(n).astype(np.float32)
    s1, a1, s2, a2 = oracle.initial_state(n, "adam")
    g = rng.standard_normal(n).astype(np.float32)
    optim8.update_8bit("adam", p, g, s1, a1, s2, a2, step=1, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8)
    before = [x.copy() for x in (p, s1, a1, s2, a2)]
    g2 = rng.standard_normal(n).astype(np.float32)
    g2[300] = bad  # block 1
    g2[1000] = bad  # block 3
    maps = dict(qmap1=optim8.qmap(True), qmap2=optim8.qmap(False))
    want = list(oracle.update("adam", g2, p, s1, a1, s2, a2, step=2, lr=1e-3, beta1=0.9, beta2=0.999, **maps))
    skipped = optim8.update_8bit("adam", p, g2, s1, a1, s2, a2, step=2, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8)
    assert skipped == 2
    for blk in (1, 3):
        sl = slice(blk * 256, (blk + 1) * 256)
        np.testing.assert_array_equal(p[sl], before[0][sl])
        np.testing.assert_array_equal(s1[sl], before[1][sl])
        np.testing.assert_array_equal(s2[sl], before[3][sl])
        assert a1[blk] == before[2][blk] and a2[blk] == before[4][blk]
    for blk in (0, 2):  # the finite blocks took the step
        sl = slice(blk * 256, (blk + 1) * 256)
        np.testing.assert_array_equal(p[sl], want[0][sl])
        np.testing.assert_array_equal(s1[sl], want[1][sl])


def test_bad_arguments_are_named():
    n = 300
    p, g = np.zeros(n, np.float32), np.zeros(n, np.float32)
    s1, a1 = np.zeros(n, np.uint8), np.zeros(2, np.float32)
    kw = dict(step=1, lr=1e-3, beta1=0.9)
    with pytest.raises(KernelError, match="step must be >= 1, got 0"):
        optim8.update_8bit("momentum", p, g, s1, a1, **{**kw, "step": 0})
    with pytest.raises(KernelError, match="beta1 must be in \\[0, 1\\), got 1.5"):
        optim8.update_8bit("momentum", p, g, s1, a1, **{**kw, "beta1": 1.5})
    with pytest.raises(KernelError, match="lr must be finite and >= 0, got -1"):
        optim8.update_8bit("momentum", p, g, s1, a1, **{**kw, "lr": -1.0})
    with pytest.raises(KernelError, match="state2 is a null pointer"):
        optim8.update_8bit("adam", p, g, s1, a1, None, None, **kw)
    with pytest.raises(KernelError, match="code book must be sorted"):
        optim8.update_8bit("momentum", p, g, s1, a1, **kw, qmap1=optim8.qmap(True)[::-1].copy())
    with pytest.raises(ValueError, match="optimizer must be one of"):
        optim8.update_8bit("adagrad", p, g, s1, a1, **kw)


def test_library_maps_are_bitsandbytes_maps():
    import bitsandbytes.functional as bnbf

    for signed in (True, False):
        want = bnbf.create_dynamic_map(signed=signed).numpy()
        np.testing.assert_array_equal(optim8.qmap(signed).view(np.uint32), want.view(np.uint32))


@pytest.mark.parametrize("pdt", [np.float32, BF16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_update_output_reproduces_the_in_place_step(case, pdt, isa_all, rng):
    """With an update buffer the parameter is only read, the states are the in-place
    step's, and fp32(p + u) rounded to the parameter's dtype is the in-place parameter
    (check_applied_params: where such a u exists; bf16 always)."""
    from q4_testing.optim_cases import check_applied_params

    n = 256 * 5 + 3
    p0 = rng.standard_normal(n).astype(np.float32).astype(pdt) * pdt(0.01)  # small: some cross zero
    g = gradients(rng, n, 1)[0]
    kw = dict(step=1, lr=case.lr, beta1=case.beta1, beta2=case.beta2, eps=case.eps, weight_decay=case.weight_decay)
    a, b = p0.copy(), p0.copy()
    sa, sb = oracle.initial_state(n, case.rule), oracle.initial_state(n, case.rule)
    optim8.update_8bit(case.rule, a, g, *sa, **kw)
    u = np.empty(n, np.float32)
    optim8.update_8bit(case.rule, b, g, *sb, **kw, update=u)
    np.testing.assert_array_equal(b.view(np.uint8), p0.view(np.uint8))  # untouched
    for x, y in zip(sa, sb, strict=True):
        if x is not None:
            np.testing.assert_array_equal(x, y)
    applied = (p0.astype(np.float32) + u).astype(pdt).astype(np.float32)
    if pdt is BF16:
        np.testing.assert_array_equal(applied, a.astype(np.float32))
    else:
        check_applied_params(p0, applied, a)
