"""Front-end code that q4/ reaches by name only: q4/ imports neither front end
(tests/test_layering.py); the commands that need one -- ``q4 parity`` (each
front end's adapter, q4/parity.py) and ``q4 quantize --method gptq`` (the
calibration pass, q4/cli.py) -- name it as ``"module:attribute"`` and load it
on first use, so ``import q4`` and the other commands load no framework."""

from __future__ import annotations

import importlib


def load(entry: str):
    """The attribute named by ``entry`` ("package.module:attribute"), its module imported now."""
    module, sep, attribute = entry.partition(":")
    if not sep or not module or not attribute:
        raise ValueError(f"a front-end entry is 'module:attribute', got {entry!r}")
    return getattr(importlib.import_module(module), attribute)
