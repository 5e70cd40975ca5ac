"""Run the benchmarks: all of them, or the named ones, in one process (the
machine description and the measured bandwidth / peak figures are printed at
the top of each and measured once per run). Each prints its tables and writes
JSON under $Q4_BENCH_DIR (default ./bench-results).

    .venv/bin/python benchmarks/run.py [kernels|matmul|layers|jax|w4a8|shapes ...]

This directory is repository tooling, not part of the q4 distribution: run
it from a source checkout (q4 installed, or PYTHONPATH=. with Q4_LIBRARY set
to a built libq4.so). Needs bitsandbytes 0.50.2 (q4[test]) and, for the JAX
peers, qwix 0.1.8 (q4[bench]).
"""

from __future__ import annotations

import argparse
import importlib
import sys
import time
from pathlib import Path

BENCHES = {
    # not "kernels.py": bitsandbytes imports the `kernels` package (Hugging Face's kernel hub) if present
    "kernels": "quant_kernels",
    "matmul": "matmul",
    "layers": "layers",
    "jax": "jax_layers",
    "w4a8": "w4a8",
    "shapes": "shapes",
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], prog="benchmarks/run.py")
    parser.add_argument("which", nargs="*", metavar="NAME", help=f"any of: {', '.join(BENCHES)} (default: all)")
    args = parser.parse_args(argv)
    unknown = [n for n in args.which if n not in BENCHES]
    if unknown:
        parser.error(f"unknown benchmark {unknown[0]!r}; choose from {', '.join(BENCHES)}")
    here = str(Path(__file__).resolve().parent)
    if here not in sys.path:
        sys.path.insert(0, here)
    for name in args.which or list(BENCHES):
        t0 = time.perf_counter()
        print(f"\n########## benchmark {name}", flush=True)
        importlib.import_module(BENCHES[name]).main()
        print(f"########## {name} took {time.perf_counter() - t0:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
