"""Shared optimizer cases: bitsandbytes' class, the oracle's update name and the
hyperparameters as both sides take them."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass(frozen=True)
class Case:
    id: str
    cls: str  # class name in bitsandbytes.optim and q4torch.optim
    rule: str  # the oracle's update rule
    kwargs: dict = field(default_factory=dict)  # constructor arguments
    beta1: float = 0.9
    beta2: float = 0.0
    eps: float = 0.0
    lr: float = 1e-3
    weight_decay: float = 0.0


CASES = (
    Case("adamw", "AdamW8bit", "adam", dict(lr=1e-3, weight_decay=1e-2), 0.9, 0.999, 1e-8, 1e-3, 1e-2),
    Case("adam", "Adam8bit", "adam", dict(lr=2e-3, betas=(0.8, 0.99)), 0.8, 0.99, 1e-8, 2e-3, 0.0),
    Case("lion", "Lion8bit", "lion", dict(lr=1e-4, weight_decay=0.1), 0.9, 0.99, 0.0, 1e-4, 0.1),
    Case("sgd", "SGD8bit", "momentum", dict(lr=1e-2, momentum=0.9, weight_decay=1e-3), 0.9, 0.0, 0.0, 1e-2, 1e-3),
    Case("rmsprop", "RMSprop8bit", "rmsprop", dict(lr=1e-2, alpha=0.99), 0.99, 0.0, 1e-8, 1e-2, 0.0),
)


def gradients(rng: np.random.Generator, n: int, steps: int) -> list[np.ndarray]:
    """Normal gradients at a different scale each step (1e-3 .. 10)."""
    return [(rng.standard_normal(n) * 10.0 ** rng.integers(-3, 2)).astype(np.float32) for _ in range(steps)]


def oracle_steps(case: Case, p0: np.ndarray, grads, sqrt=np.sqrt, qmap1=None, qmap2=None, round_param=None):
    """Run the oracle for len(grads) steps from a fresh state; yields the state after each."""
    from q4_reference import optim8

    p = np.asarray(p0, np.float32).reshape(-1).copy()
    s1, a1, s2, a2 = optim8.initial_state(p.size, case.rule)
    for step, g in enumerate(grads, 1):
        p, s1, a1, s2, a2 = optim8.update(
            case.rule,
            g,
            p,
            s1,
            a1,
            s2,
            a2,
            step=step,
            lr=case.lr,
            beta1=case.beta1,
            beta2=case.beta2,
            eps=case.eps,
            weight_decay=case.weight_decay,
            qmap1=qmap1,
            qmap2=qmap2,
            sqrt=sqrt,
        )
        if round_param is not None:
            p = round_param(p)
        yield p, s1, a1, s2, a2


def exact_update_exists(p: np.float32, new: np.float32) -> bool:
    """Whether some fp32 u has fp32(p + u) == new (optax applies p + u): u = new - p
    or one of its neighbours within 4 ulp."""
    u = np.float32(new - p)
    for k in range(-4, 5):
        c = u
        for _ in range(abs(k)):
            c = np.nextafter(c, np.float32(np.inf if k > 0 else -np.inf))
        if np.float32(p + c) == new:
            return True
    return False


def check_applied_params(before, got, want):
    """A parameter applied by optax (p + u) against the kernel's: equal bits, but where no fp32 update reproduces the new value through p + u (an
    update larger than the new value, e.g. one that crosses zero): there within an ulp of
    the update."""
    got32 = got.astype(np.float32)
    for idx in np.argwhere(got32 != want):
        i = tuple(idx)
        assert not exact_update_exists(before[i], want[i]), (i, before[i], got32[i], want[i])
        assert abs(got32[i] - want[i]) <= np.spacing(np.abs(want[i] - before[i])), i
