"""Where the CPU kernels' threads come from: q4's own pool, PyTorch's OpenMP
team (installed by `import q4torch`), or XLA's intra-op pool (inside the JAX
custom calls). The bytes and values never depend on it."""

from __future__ import annotations

import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import q4
import q4jax
import q4torch  # noqa: F401  (installs PyTorch's OpenMP fork-join)
from q4._src import native


def _work(seed: int = 0) -> dict[str, bytes]:
    """Kernels whose work is split across threads (several chunks each)."""
    rng = np.random.default_rng(seed)
    w = (rng.standard_normal((300, 512)) * 0.05).astype(np.float32)
    x = rng.standard_normal((37, 512)).astype(np.float32)
    packed, absmax = q4.quantize_4bit(w, 64, "nf4")
    state = q4.QuantState("nf4", 64, w.shape, "float32", absmax)
    y = q4.gemm_4bit(x, packed, state)
    g = q4.gemm_4bit_grad_input(rng.standard_normal((37, 300)).astype(np.float32), packed, state)
    codes, absmax2, offset = q4.quantize_nested(np.abs(rng.standard_normal(70000)).astype(np.float32))
    q, stats, _ = q4.int8_quantize_rows(x, 0.0)
    return {
        k: np.asarray(v).tobytes()
        for k, v in dict(
            packed=packed,
            absmax=absmax,
            y=y,
            g=g,
            codes=codes,
            absmax2=absmax2,
            offset=np.float32(offset),
            q=q,
            stats=stats,
        ).items()
    }


def test_import_q4torch_uses_pytorch_openmp():
    assert native.fork_join() is not None
    code = "import q4torch; from q4._src import native; print(native.fork_join())"
    env = {**os.environ, "Q4_TORCH_OPENMP": "0"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    assert out.stdout.strip() == "None", out.stderr


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_same_bytes_on_every_backend(threads):
    entry = native.fork_join()
    native.set_num_threads(threads)
    try:
        on_openmp = _work()
        native.set_fork_join(None)
        on_own_pool = _work()
    finally:
        native.set_fork_join(entry)
        native.set_num_threads(0)
    assert on_openmp == on_own_pool


_FORK_CHECK = """
import multiprocessing, sys
import numpy as np
import q4, q4torch
from q4._src import native

def work():
    rng = np.random.default_rng(0)
    w = (rng.standard_normal((300, 512)) * 0.05).astype(np.float32)
    x = rng.standard_normal((37, 512)).astype(np.float32)
    packed, absmax = q4.quantize_4bit(w, 64, "nf4")
    return q4.gemm_4bit(x, packed, q4.QuantState("nf4", 64, w.shape, "float32", absmax)).tobytes()

def child(queue):
    queue.put(work())

assert native.fork_join() is not None
want = work()  # the parent's OpenMP team exists now
ctx = multiprocessing.get_context("fork")
queue = ctx.Queue()
proc = ctx.Process(target=child, args=(queue,), daemon=True)
proc.start()
got = queue.get(timeout=60)  # before join: the child exits once its result is read
proc.join(timeout=30)
sys.exit(0 if proc.exitcode == 0 and got == want else 3)
"""


def test_forked_child_does_not_use_the_parents_openmp_team():
    """An OpenMP team does not survive fork(); a child falls back to q4's own
    pool instead of hanging (DataLoader workers fork). Run in a process of its
    own: this one has JAX's threads, which must not be forked."""
    try:
        r = subprocess.run([sys.executable, "-c", _FORK_CHECK], capture_output=True, text=True, timeout=120)
    except subprocess.TimeoutExpired:
        pytest.fail("a q4 kernel in a forked child hung")
    assert r.returncode == 0, r.stderr[-2000:]


def test_xla_pool_gives_the_same_results():
    """Inside a jitted JAX call the kernels run on XLA's intra-op pool."""
    rng = np.random.default_rng(1)
    w = (rng.standard_normal((300, 512)) * 0.05).astype(np.float32)
    x = rng.standard_normal((37, 512)).astype(np.float32)
    packed, state = q4jax.quantize_4bit(jnp.asarray(w), 64, "nf4", compress_statistics=False)
    y = jax.jit(q4jax.matmul_4bit)(jnp.asarray(x), packed, state)
    np_packed, np_absmax = q4.quantize_4bit(w, 64, "nf4")
    want = q4.gemm_4bit(x, np_packed, q4.QuantState("nf4", 64, w.shape, "float32", np_absmax))
    assert np.asarray(packed).tobytes() == np_packed.tobytes()
    assert np.asarray(y).tobytes() == want.tobytes()
