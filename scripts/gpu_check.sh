#!/usr/bin/env bash
# One command for a lent GPU machine (CUDA, e.g. the H200): build libq4 with
# the CUDA kernels, run the CUDA tests and the GPU half of the torch and JAX
# tests, then the GPU benchmark (benchmarks/gpu.py). Sized to finish in under
# 8 minutes on an H200 from a bare machine. Uses the machine's own python3
# (its torch / jax / pytest), never the network.
#
#   scripts/gpu_check.sh [OUT_DIR]        (default: $OUT, else ./gpu-results)
#
# Writes build.log, tests-*.log, gpu_bench.json and summary.txt into OUT_DIR.
# Exit status: 0 when every step passed; 2 when there is no GPU (checked
# first, in seconds); 1 when a step failed (the summary names it).
set -u
OUT_DIR=${1:-${OUT:-gpu-results}}
PY=${PYTHON:-python3}
mkdir -p "$OUT_DIR"
SUMMARY="$OUT_DIR/summary.txt"
: >"$SUMMARY"
say() { echo "gpu_check: $*" | tee -a "$SUMMARY"; }

# 1. a GPU, or a clean refusal (no hang: every probe is time-limited)
if ! command -v nvidia-smi >/dev/null 2>&1; then
  say "no GPU: nvidia-smi not found"
  exit 2
fi
if ! timeout 60 nvidia-smi -L >"$OUT_DIR/nvidia-smi.txt" 2>&1 || ! grep -q "GPU 0" "$OUT_DIR/nvidia-smi.txt"; then
  say "no GPU: nvidia-smi -L lists none ($(head -c 200 "$OUT_DIR/nvidia-smi.txt"))"
  exit 2
fi
say "$(head -1 "$OUT_DIR/nvidia-smi.txt")"
if ! command -v nvcc >/dev/null 2>&1; then
  say "no nvcc on this machine: cannot build the CUDA kernels"
  exit 1
fi

status=0
step() {  # step NAME LOG TIMEOUT_S COMMAND...
  local name=$1 log=$2 limit=$3
  shift 3
  local t0=$SECONDS
  if timeout "$limit" "$@" >"$OUT_DIR/$log" 2>&1; then
    say "$name: ok ($((SECONDS - t0)) s)"
  else
    say "$name: FAILED (rc $?, $((SECONDS - t0)) s; last lines of $log below)"
    tail -15 "$OUT_DIR/$log" | sed 's/^/    /' | tee -a "$SUMMARY"
    status=1
  fi
}

# 2. build: the CUDA kernels for this GPU's architecture, the XLA FFI handlers
#    against the machine's jaxlib
ARCH=$(timeout 60 nvidia-smi --query-gpu=compute_cap --format=csv,noheader 2>/dev/null | head -1 | tr -d ' .')
ARCH=${ARCH:-90}
BUILD=build/gpu-sm$ARCH
step "build (sm_$ARCH)" build.log 300 bash -c \
  "cmake -S . -B $BUILD -G Ninja -DCMAKE_BUILD_TYPE=Release -DQ4_CUDA=ON -DQ4_CUDA_ARCHITECTURES=$ARCH \
   -DPython_EXECUTABLE=$(command -v "$PY") && cmake --build $BUILD -j \$(nproc)"
LIB=$PWD/$BUILD/libq4.so
if [ ! -f "$LIB" ]; then
  say "no library built: stopping"
  exit 1
fi
export Q4_LIBRARY=$LIB PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
"$PY" -c "import q4; assert q4.has_cuda() and q4.cuda_device_count() > 0, 'library without a usable CUDA device'; print(q4.cpu_features()['isa'])" \
  >"$OUT_DIR/library.txt" 2>&1 || { say "the built library sees no CUDA device: $(tail -2 "$OUT_DIR/library.txt")"; exit 1; }

# 3. tests: the CUDA kernel tests (CUDA = CPU bytes, fused matmul within the
#    oracle's bound), then the torch tests on the cuda device fixture and the
#    JAX tests with JAX's default device on the GPU (the same tests as on CPU)
PYTEST=("$PY" -m pytest -q -p no:cacheprovider -x --timeout=300)
"$PY" -c "import pytest_timeout" 2>/dev/null || PYTEST=("$PY" -m pytest -q -p no:cacheprovider -x)
step "tests: CUDA kernels" tests-cuda.log 240 "${PYTEST[@]}" tests/kernels/test_cuda.py tests/kernels/test_cuda_matmul.py
step "tests: torch on cuda" tests-torch.log 180 env Q4_TEST_DEVICES=cuda "${PYTEST[@]}" \
  tests/torch/test_functional.py tests/torch/test_matmul.py tests/torch/test_linear8bit.py
step "tests: JAX on the GPU" tests-jax.log 180 env JAX_PLATFORMS=cuda,cpu "${PYTEST[@]}" \
  tests/jax/test_functional.py tests/jax/test_matmul.py tests/jax/test_int8.py tests/jax/test_int8_weight.py

# 4. benchmark (bitsandbytes' CUDA kernels too where its wheel imports)
step "benchmark" bench.log 240 "$PY" benchmarks/gpu.py --out "$OUT_DIR/gpu_bench.json"
tail -40 "$OUT_DIR/bench.log" >>"$SUMMARY"
say "done: status $status"
exit $status
