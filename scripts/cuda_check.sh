#!/usr/bin/env bash
# Compiles the CUDA kernels alone (the q4_cuda object target), without a GPU:
#
#   scripts/cuda_check.sh PYTHON
#
# `make test` builds the library CPU-only where no GPU is present; CI runs this
# (`make cuda-check`) so that a CUDA compile error still fails CI. PYTHON's jaxlib
# provides the XLA FFI headers (xla_ffi_cuda.cu is compiled too). Builds in
# build/cuda-check, incrementally; the full log is build/cuda-check.log.
set -euo pipefail
[[ $# -eq 1 ]] || { echo "usage: $0 PYTHON" >&2; exit 2; }
command -v nvcc >/dev/null || { echo "cuda_check.sh: nvcc not found: install the CUDA toolkit" >&2; exit 1; }
python=$(cd "$(dirname "$1")" && pwd)/$(basename "$1")
export PATH="$(dirname "$python"):$PATH" # the venv's ninja
dir=build/cuda-check
log=build/cuda-check.log
mkdir -p build
if ! cmake -S . -B "$dir" -G Ninja -DQ4_CUDA=ON -DPython_EXECUTABLE="$python" >"$log" 2>&1; then
  tail -n 40 "$log" >&2
  exit 1
fi
grep -q "q4: CUDA kernels enabled" "$log" || { echo "cuda_check.sh: CMake did not enable CUDA (see $log)" >&2; exit 1; }
status=0
cmake --build "$dir" --target q4_cuda >>"$log" 2>&1 &
pid=$!
tail -n 0 -F --pid="$pid" "$log" 2>/dev/null | grep --line-buffered -E '^\[[0-9]+/[0-9]+\] ' | sed -u 's/^/   /'
wait "$pid" || status=$?
if [[ $status -ne 0 ]]; then
  echo "cuda_check.sh: the CUDA kernels did not compile; the end of $log:" >&2
  tail -n 60 "$log" >&2
fi
exit "$status"
