"""The fuzz targets (tests/fuzz/fuzz_NAME.py, run by scripts/fuzz.sh) as modules, for
the tests that replay their corpus and saved crash inputs."""

from __future__ import annotations

import functools
import importlib.util
import sys
from pathlib import Path
from types import ModuleType

FUZZ_DIR = Path(__file__).resolve().parents[1] / "fuzz"


@functools.cache
def fuzz_target(name: str) -> ModuleType:
    """tests/fuzz/fuzz_<name>.py, imported once as q4_fuzz_<name>."""
    spec = importlib.util.spec_from_file_location(f"q4_fuzz_{name}", FUZZ_DIR / f"fuzz_{name}.py")
    assert spec is not None and spec.loader is not None, name
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module
