"""The import graph of q4, q4torch and q4jax has no circles, and q4/ sits below
both front ends.

Every module is parsed with ast and every import collected at any depth: one
inside a function (a lazy import) still ties the two modules together, and a
circle of them hides a definition that belongs in a lower module. Relative
imports are resolved; ``from package import name`` counts as an import of the
submodule when ``name`` is one. The circles are the strongly connected
components of that graph (Tarjan)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("q4", "q4torch", "q4jax")
FRONT_ENDS = ("q4torch", "q4jax")


def _modules() -> dict[str, Path]:
    out = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join(parts)] = path
    return out


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The modules of ``modules`` that module ``name`` imports, anywhere in its body."""
    is_package = path.name == "__init__.py"
    found: set[str] = set()

    def add(target: str) -> None:
        # the module itself, or the longest prefix that is one of ours (import a.b.c of a non-module c)
        while target and target not in modules:
            target = target.rpartition(".")[0]
        if target and target != name:
            found.add(target)

    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                add(alias.name)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".") if is_package else name.split(".")[:-1]
                base = base[: len(base) - (node.level - 1)]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            for alias in node.names:
                sub = f"{module}.{alias.name}"
                add(sub if sub in modules else module)
    return found


def import_graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(name, path, modules) for name, path in modules.items()}


def circles(graph: dict[str, set[str]]) -> list[frozenset[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[frozenset[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.add(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(frozenset(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_the_cycle_finder_finds_a_lazy_circle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert circles(graph) == [frozenset({"a", "b", "c"})]
    tree = ast.parse("def f():\n    from . import b\n")
    assert any(isinstance(n, ast.ImportFrom) and n.level == 1 for n in ast.walk(tree))


def test_no_import_circles():
    """No module of q4, q4torch or q4jax reaches itself through imports, lazy ones
    (inside functions) included: a circle hides a definition in the wrong module."""
    found = sorted(sorted(c) for c in circles(import_graph()))
    assert found == [], f"import circles (move the shared definition into a lower module): {found}"


def test_q4_imports_no_front_end():
    """q4/ is below both front ends: no module of it imports q4torch or q4jax,
    at module level or inside a function. Front-end code that a command needs
    is named by string and loaded on first use (q4/parity.py's ADAPTER_MODULES,
    q4/_src/plugins.py)."""
    graph = import_graph()
    bad = sorted(
        f"{name} imports {target}"
        for name, targets in graph.items()
        if name.split(".")[0] == "q4"
        for target in targets
        if target.split(".")[0] in FRONT_ENDS
    )
    assert bad == []


# Source files over 700 lines, each with the one concern its header states (the
# words below appear in its first lines). A file that grows past 700 lines joins
# this list with its concern, or is split; a listed file that shrinks leaves it.
LONG_FILES = {
    "q4jax/_src/sharding.py": "Quantized matmuls over a device mesh",
    "kernels/cpu/x86/avx512/gemm4_tiled.cc": "AVX-512 fp32 fused 4-bit matmuls for more than one row",
    "kernels/cpu/x86/avx512_bf16/gemm4.cc": "AVX512_BF16 kernels of the fused 4-bit matmuls",
}
LONG = 700


def test_long_files_state_their_one_concern():
    sources = [
        p
        for d in (*PACKAGES, "kernels")
        for p in sorted((ROOT / d).rglob("*"))
        if p.suffix in {".py", ".h", ".cc", ".cu", ".cuh", ".inc"}
    ]
    long = {p.relative_to(ROOT).as_posix(): p for p in sources if len(p.read_text().splitlines()) > LONG}
    assert sorted(long) == sorted(LONG_FILES), "files over 700 lines: list each with its concern, or split it"
    for name, concern in LONG_FILES.items():
        head = " ".join(line.strip('/#*" ') for line in long[name].read_text().splitlines()[:4])
        assert concern in head, f"{name}: its header does not state {concern!r}"
