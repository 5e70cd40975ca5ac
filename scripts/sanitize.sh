#!/usr/bin/env bash
# Runs the kernel and reference tests plus a torch and a JAX slice against the
# AddressSanitizer + UBSan build of libq4.so (scripts/asan_run.sh builds it in
# build/asan). Any sanitizer report aborts the test process, so this fails.
#
#   scripts/sanitize.sh [PYTEST ARGS...]
#
# Extra arguments go to pytest. PYTHON as for asan_run.sh (default:
# .venv/bin/python). The slice (2-4 minutes on 2 cores, build included)
# covers every C ABI entry point (tests/kernels), the numpy oracle comparisons
# (tests/q4_reference), the torch custom ops, layers and their OpenMP executor,
# and every XLA FFI handler, batched (vmap, nnx.scan) included, on XLA's
# intra-op pool.
set -euo pipefail

repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd -P)
cd "$repo"
python=${PYTHON:-}
if [[ -z $python ]]; then
  if [[ -x .venv/bin/python ]]; then python=.venv/bin/python; else python=python3; fi
fi

tests=(
  tests/kernels
  tests/q4_reference
  tests/torch/test_functional.py
  tests/torch/test_matmul.py
  tests/torch/test_int8.py
  tests/torch/test_threads.py
  tests/torch/test_linear4bit.py
  tests/torch/test_linear8bit.py
  tests/jax/test_functional.py
  tests/jax/test_matmul.py
  tests/jax/test_int8.py
  tests/jax/test_nn.py
  tests/jax/test_nn_scan.py
  tests/jax/test_flax_models.py
)

# --capture=sys: pytest's default fd capture would swallow the sanitizer's
# report when it aborts the process; this way it reaches stderr.
cmd=("$python" -m pytest -q -p no:cacheprovider --capture=sys "${tests[@]}" "$@")
echo "== sanitize: ASan + UBSan build of libq4.so (build/asan), CPU kernels only"
echo "== sanitize: scripts/asan_run.sh ${cmd[*]}"
start=$SECONDS
status=0
PYTHON=$python scripts/asan_run.sh "${cmd[@]}" || status=$?
elapsed=$((SECONDS - start))
if [[ $status -eq 0 ]]; then
  echo "== sanitize: passed, no sanitizer reports (${elapsed}s, build included)"
else
  echo "== sanitize: FAILED with status $status after ${elapsed}s (134 = a sanitizer report aborted the run; see its stack above)" >&2
fi
exit "$status"
