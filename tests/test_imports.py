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


def test_test_modules_import_each_other_only_through_unambiguous_names():
    """Tests share code through packages of their own with names no installed distribution
    uses (q4_reference, ...), or through conftest; never through a folder name such as
    `kernels` or `torch`, which an installed package (Hugging Face's `kernels`, pulled in by
    transformers) shadows. Every top-level name a test imports that lives under tests/
    must start with `q4_` or be conftest; `examples` is the repo's own regular package
    (examples/__init__.py), first on sys.path (conftest), as the examples import it."""
    import ast
    from pathlib import Path

    tests = Path(__file__).resolve().parent
    local = {p.stem for p in tests.glob("*.py")} | {p.name for p in tests.iterdir() if p.is_dir()}
    bad = []
    for path in tests.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            else:
                continue
            for name in names:
                top = name.split(".")[0]
                if top in local and not (top.startswith("q4_") or top == "conftest"):
                    bad.append(f"{path.relative_to(tests)}:{node.lineno}: import of {name}")
    # torch, jax: folders named after the frameworks; importing the name means the framework
    assert [b for b in bad if b.split("import of ")[1].split(".")[0] not in ("torch", "jax", "examples")] == []
    assert (tests.parent / "examples" / "__init__.py").is_file()
