"""A stand-in `bitsandbytes` package that forwards to q4torch, so that
bitsandbytes' own test files can run against q4 (scripts/bnb_tests.sh).
Repository tooling, not part of the q4 distribution."""

from q4torch import MatmulLtState, functional, matmul, matmul_4bit, nn  # noqa: F401

__version__ = "0.50.2"
