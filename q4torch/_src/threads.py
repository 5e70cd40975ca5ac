"""q4's CPU kernels on PyTorch's own OpenMP threads.

PyTorch runs its CPU ops on an OpenMP team whose threads keep spinning for a
while after each op. A second thread pool (q4's own) then competes with them
for the cores: on a 2-core machine a model that interleaves torch ops and q4
layers ran its q4 layers at about half speed. Handing the OpenMP runtime's
fork-join entry point (GOMP_parallel, which GNU and LLVM/Intel OpenMP both
export) to the kernel library makes q4's threads the ones already spinning.

The kernels stay framework-free: the library takes a C function pointer.
Set Q4_TORCH_OPENMP=0 to keep q4's own pool.
"""

from __future__ import annotations

import ctypes
import logging
import os
from pathlib import Path

import torch

from q4._src import native

logger = logging.getLogger("q4torch")

_RUNTIMES = ("libgomp", "libiomp5", "libomp")


def _loaded_openmp_runtime() -> Path | None:
    """The OpenMP runtime mapped into this process, preferring PyTorch's own copy."""
    try:
        maps = Path("/proc/self/maps").read_text().splitlines()
    except OSError:
        return None
    found = []
    for line in maps:
        path = line.split()[-1] if len(line.split()) >= 6 else ""
        if any(Path(path).name.startswith(r) for r in _RUNTIMES) and path not in found:
            found.append(path)
    torch_lib = str(Path(torch.__file__).parent)
    found.sort(key=lambda p: not p.startswith(torch_lib))
    return Path(found[0]) if found else None


def use_torch_openmp() -> bool:
    """Route q4's CPU threads through PyTorch's OpenMP runtime; returns
    whether it is in use (False: q4's own pool)."""
    if os.environ.get("Q4_TORCH_OPENMP", "1") == "0" or not torch.backends.openmp.is_available():
        return False
    runtime = _loaded_openmp_runtime()
    if runtime is None:
        return False
    try:
        entry = ctypes.CDLL(str(runtime)).GOMP_parallel
    except (OSError, AttributeError):
        logger.info("q4torch: %s has no GOMP_parallel; q4 keeps its own thread pool", runtime)
        return False
    native.set_fork_join(ctypes.cast(entry, ctypes.c_void_p).value)
    logger.info("q4torch: q4's CPU kernels run on PyTorch's OpenMP threads (%s)", runtime.name)
    return True
