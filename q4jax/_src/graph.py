"""Walking and editing a flax.nnx module graph: the helpers shared by
quantize_model (model.py), add_lora (lora.py), state_dict / load_state_dict
(checkpoint.py) and shard_model (model_sharding.py)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from flax import nnx
from flax.nnx import graphlib


def graph_children(node) -> Iterator[tuple[Any, Any]]:
    impl = graphlib.get_node_impl(node)
    if impl is None:
        return
    for key, child in impl.node_dict(node).items():
        if isinstance(key, str) and key.startswith("_"):
            continue  # nnx internals (_pytree__state, _length, ...)
        yield key, child


def graph_edges(root) -> Iterator[tuple[tuple, Any, Any, Any]]:
    """(path, parent, key, child) for every edge to a Module below root, in
    attribute order; a module reachable by several paths is yielded once per
    path (as torch's state_dict does), but its subtree is walked once per path
    only while no cycle is formed."""

    def walk(node, path, on_stack):
        for key, child in graph_children(node):
            if isinstance(child, nnx.Variable) or not graphlib.is_node(child):
                continue
            if id(child) in on_stack:
                continue
            p = (*path, key)
            if isinstance(child, nnx.Module):
                yield p, node, key, child
            yield from walk(child, p, on_stack | {id(child)})

    yield from walk(root, (), frozenset({id(root)}))


def path_name(path: tuple) -> str:
    return ".".join(str(k) for k in path)


def set_child(parent, key, value) -> None:
    if isinstance(parent, (nnx.List, nnx.Dict, list, dict)):
        parent[key] = value
    else:
        setattr(parent, key, value)


def check_graph_root(module, what: str) -> None:
    if not isinstance(module, nnx.Module):
        raise TypeError(f"{what} expects an nnx.Module, got {type(module).__name__}")
