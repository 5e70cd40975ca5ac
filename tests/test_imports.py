"""Each front end works without the other framework installed."""

import subprocess
import sys

import pytest

SCRIPTS = {
    "torch-only": (
        "jax",
        "import torch, q4torch.functional as F\n"
        "p, s = F.quantize_4bit(torch.ones(64, 64), quant_type='nf4', compress_statistics=True)\n"
        "assert F.dequantize_4bit(p, s).shape == (64, 64)\n",
    ),
    "jax-only": (
        "torch",
        "import jax.numpy as jnp, q4jax\n"
        "p, s = q4jax.quantize_4bit(jnp.ones((64, 64)), 64, 'nf4', True)\n"
        "assert q4jax.dequantize_4bit(p, s).shape == (64, 64)\n",
    ),
}


@pytest.mark.parametrize("name", sorted(SCRIPTS))
def test_front_end_without_the_other_framework(name):
    blocked, body = SCRIPTS[name]
    # a None entry in sys.modules makes `import <blocked>` raise ImportError
    code = f"import sys\nsys.modules[{blocked!r}] = None\n{body}assert {blocked!r} not in [m.split('.')[0] for m in sys.modules if sys.modules[m] is not None]\n"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
