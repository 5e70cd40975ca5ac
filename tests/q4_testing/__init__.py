"""Helpers the test modules share (front-end adapters, fuzz-target loading).

Test modules import shared code only from packages named q4_* (this one,
q4_reference) or from conftest, never from each other by folder name: an
installed distribution with a folder's name (Hugging Face's `kernels`, say)
would shadow it (tests/test_imports.py checks this)."""
