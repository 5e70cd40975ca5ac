"""q4/ is framework-neutral: importing it, its checkpoint API, `q4 parity`'s
module or the command loads no front end and no framework (each front end's
parity adapter is found by module name only when a check runs)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_q4_imports_no_front_end():
    code = (
        "import sys, q4, q4.checkpoint, q4.parity, q4.cli\n"
        "loaded = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'jax', 'flax', 'q4torch', 'q4jax'))\n"
        "print(loaded)\n"
        "sys.exit(1 if loaded else 0)\n"
    )
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=ROOT, timeout=120)
    assert r.returncode == 0, f"q4 loaded front-end modules: {r.stdout.strip()} {r.stderr[-2000:]}"


def test_parity_finds_each_front_ends_adapter():
    import q4.parity

    for name in q4.parity.ADAPTER_MODULES:
        assert q4.parity.adapter(name).name == name
    with pytest.raises(ValueError, match="tensorflow"):
        q4.parity.adapter("tensorflow")


def test_the_gptq_calibration_is_found_by_name():
    """`q4 quantize --method gptq` reaches the PyTorch calibration pass through
    its name only (q4/_src/plugins.py), as `q4 parity` reaches the adapters."""
    import q4.cli
    from q4._src import plugins

    assert callable(plugins.load(q4.cli.GPTQ_CALIBRATION))
    with pytest.raises(ValueError, match="module:attribute"):
        plugins.load("q4torch._src.replace")
