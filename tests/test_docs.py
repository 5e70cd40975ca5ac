"""The documentation runs: every fenced ```python block of README.md and docs/**/*.md is
executed, a file's blocks in order in one namespace (a later block may use an earlier
one's names), in a scratch directory with the repository on sys.path; and every path
the contributor guide's layout names exists."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PAGES = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]
FENCE = re.compile(r"^```python\n(.*?)^```", re.S | re.M)


def python_blocks(page: Path) -> list[str]:
    return FENCE.findall(page.read_text(encoding="utf-8"))


@pytest.mark.parametrize("page", [p for p in PAGES if python_blocks(p)], ids=lambda p: str(p.relative_to(REPO)))
def test_every_python_block_runs(page, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(REPO))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    namespace: dict = {"__name__": f"doc_{page.stem}"}
    for i, block in enumerate(python_blocks(page)):
        code = compile(block, f"{page.relative_to(REPO)} block {i + 1}", "exec")
        exec(code, namespace)  # a failure names the page and the block


def _tracked_names() -> set[str]:
    names = set()
    for _root, dirs, files in os.walk(REPO):
        dirs[:] = [d for d in dirs if not d.startswith((".", "build", "bazel-")) and d != "__pycache__"]
        names.update(files)
    return names


def test_the_layout_names_only_paths_that_exist():
    """Each folder of the contributor guide's layout exists, and each file it names
    (nf4.h, projection.py, ...) exists somewhere in the tree."""
    layout = (REPO / "docs" / "contributing.md").read_text(encoding="utf-8").split("```")[1]
    folders = [line[:22].strip() for line in layout.splitlines() if line[:22].strip()]
    missing = [f for f in folders if not (REPO / f).exists()]
    files = set(re.findall(r"([\w-]+\.(?:py|h|cc|cu|inc|md))\b", layout))
    missing += sorted(files - _tracked_names())
    assert folders and files and missing == []


def test_readme_is_for_users():
    """At most 400 lines; no dated machine narrative (dates appear only beside the speed
    table's one run)."""
    text = (REPO / "README.md").read_text(encoding="utf-8")
    assert len(text.splitlines()) <= 400
    dated = [line for line in text.splitlines() if re.search(r"2026-1[12]-\d\d", line)]
    assert len(dated) <= 1, dated
    assert "make demo" in text and "make test" in text
    assert os.path.exists(REPO / "docs" / "index.md")


API_MODULES = ["q4", "q4.checkpoint", "q4torch", "q4torch.nn", "q4torch.functional", "q4torch.hf", "q4torch.peft",
               "q4torch.optim", "q4jax", "q4jax.nn", "q4jax.optim"]  # fmt: skip


@pytest.mark.parametrize("module", API_MODULES)
def test_every_public_name_has_a_docstring(module):
    """The API reference (docs/api/, rendered by mkdocstrings from each module's __all__)
    shows every public class and function with its docstring."""
    import importlib
    import inspect

    mod = importlib.import_module(module)
    assert mod.__all__, module
    bare = [n for n in mod.__all__ if callable(getattr(mod, n)) and not inspect.getdoc(getattr(mod, n))]
    assert bare == []
    pages = " ".join(p.read_text(encoding="utf-8") for p in (REPO / "docs" / "api").glob("*.md"))
    assert f"::: {module}\n" in pages
