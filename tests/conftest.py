"""Shared fixtures: seeded inputs, the device fixture, the reference oracle on sys.path."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

# tests/ (the shared q4_reference / q4_testing packages) and the repo root (the `examples`
# package), ahead of site-packages so that no installed package shadows either
sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1])]

import q4  # noqa: E402
from q4._src import native  # noqa: E402


def pytest_report_header(config):
    return [f"q4 library: {q4.library_path()} (isa {q4.cpu_isa()}, {q4.num_threads()} threads, cuda={q4.has_cuda()})"]


@pytest.fixture
def spawn():
    """subprocess.Popen for a test, each child in a session of its own: whatever the test
    started (and their children) is killed and reaped when it ends, passed or failed, so
    no process outlives its test to disturb another."""
    started: list[subprocess.Popen] = []

    def start(*args, **kwargs) -> subprocess.Popen:
        p = subprocess.Popen(*args, start_new_session=True, **kwargs)
        started.append(p)
        return p

    yield start
    for p in started:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(p.pid, signal.SIGKILL)
        p.communicate(timeout=60)


@pytest.fixture
def rng():
    return np.random.default_rng(1234)


def available_devices() -> list[str]:
    """'cpu', plus 'cuda' when a GPU is present and the library has CUDA kernels.
    Q4_TEST_DEVICES=cpu,cuda overrides."""
    env = os.environ.get("Q4_TEST_DEVICES")
    if env:
        return env.split(",")
    return ["cpu"] + (["cuda"] if q4.cuda_device_count() > 0 else [])


@pytest.fixture(params=available_devices())
def device(request):
    return request.param


def _use_isa(name):
    if not native.cpu_has_isa(name):
        pytest.skip(f"not run: the processor lacks {name} ({q4.cpu_features()['features']})")
    before = q4.cpu_isa()
    q4.set_cpu_isa(name)
    return before


@contextlib.contextmanager
def on_isa(name):
    """Run on CPU level `name` (a level the processor lacks: not run, named),
    then restore the previous level and the default thread count."""
    before = _use_isa(name)
    try:
        yield name
    finally:
        q4.set_cpu_isa(before)
        q4.set_num_threads(0)


@pytest.fixture(params=["avx2", "scalar"])
def isa(request):
    """Run a test once per CPU path (a path the processor lacks is skipped)."""
    with on_isa(request.param) as name:
        yield name


@pytest.fixture(params=list(reversed(native.isa_names().values())))  # the library's levels, highest first
def isa_all(request):
    """As `isa`, plus the AVX-512 levels (their kernels: kernels/cpu/dispatch.h)."""
    with on_isa(request.param) as name:
        yield name


@pytest.fixture
def module_isa(request):
    """Every test of a module on the CPU level named by its `ISA` constant
    (``pytestmark = pytest.mark.usefixtures("module_isa")``)."""
    with on_isa(request.module.ISA) as name:
        yield name


@pytest.fixture
def bitsandbytes_backend():
    """transformers' "bitsandbytes" method served by bitsandbytes itself for one
    test, whether or not q4torch.hf (which makes q4 serve it) was imported."""
    hf = sys.modules.get("q4torch._src.hf")
    if hf is None:
        yield
        return
    hf.restore_bitsandbytes()
    try:
        yield
    finally:
        hf.use_for_bitsandbytes()
