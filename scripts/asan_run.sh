#!/usr/bin/env bash
# Runs CMD ARGS... against the AddressSanitizer + UBSan build of libq4.so:
#
#   scripts/asan_run.sh CMD ARGS...
#
# Builds the library first (CMake, -DQ4_SANITIZE=ON: CPU kernels only, no
# CUDA) in build/asan, incrementally, so a stale library is rebuilt and an
# up-to-date one costs a second. Then runs CMD with
#   Q4_LIBRARY   build/asan/lib/libq4.so (the library q4 loads)
#   LD_PRELOAD   gcc's libasan and libstdc++, so that a python process (and
#                jaxlib in it) loads under ASan: the runtime must come first
#   ASAN_OPTIONS / UBSAN_OPTIONS   any report aborts the process
#   PYTHONPATH   the checkout first, so the source-tree q4 is the one used
# and exits with CMD's status (a sanitizer report: SIGABRT, status 134).
# Build output goes to stderr; CMD's stdout is left alone.
#
# Environment: PYTHON (default: .venv/bin/python, else python3; its jaxlib
# provides the XLA FFI headers), Q4_ASAN_BUILD_DIR (default: build/asan).
# ASAN_OPTIONS / UBSAN_OPTIONS already set are appended to ours (so win).
set -euo pipefail

die() {
  echo "asan_run.sh: error: $*" >&2
  exit 2
}

[[ $# -ge 1 ]] || die "usage: $0 CMD ARGS..."

repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd -P)
build=${Q4_ASAN_BUILD_DIR:-$repo/build/asan}
lib=$build/lib/libq4.so

python=${PYTHON:-}
if [[ -z $python ]]; then
  if [[ -x $repo/.venv/bin/python ]]; then python=$repo/.venv/bin/python; else python=python3; fi
fi
command -v "$python" >/dev/null 2>&1 || die "python '$python' not found"
python=$(command -v "$python")
# Absolute, but not through symlinks (a venv's python is a link to the base one).
[[ $python == /* ]] || python=$(cd "$(dirname "$python")" && pwd)/$(basename "$python")
command -v cmake >/dev/null 2>&1 || die "cmake not found"

cxx=${CXX:-g++}
runtime() { # runtime NAME: the real file of gcc's NAME, or die
  local f
  f=$("$cxx" -print-file-name="$1")
  [[ $f == /* && -e $f ]] || die "'$cxx -print-file-name=$1' found no $1 (is gcc's sanitizer runtime installed?)"
  readlink -f "$f"
}
libasan=$(runtime libasan.so)
libstdcxx=$(runtime libstdc++.so)

# Build (configure once; afterwards cmake --build re-runs CMake itself when
# CMakeLists.txt changed). One build at a time in this directory.
mkdir -p "$build"
{
  flock 9
  if [[ ! -f $build/CMakeCache.txt ]]; then
    generator=()
    command -v ninja >/dev/null 2>&1 && generator=(-G Ninja)
    cmake -S "$repo" -B "$build" "${generator[@]}" \
      -DCMAKE_BUILD_TYPE=RelWithDebInfo \
      -DCMAKE_CXX_COMPILER="$cxx" \
      -DQ4_SANITIZE=ON -DQ4_CUDA=OFF \
      -DPython_EXECUTABLE="$python" >&2
  fi
  cmake --build "$build" --parallel "$(nproc 2>/dev/null || echo 2)" >&2
} 9>"$build/.lock"
[[ -f $lib ]] || die "the build finished but $lib does not exist"

export Q4_LIBRARY=$lib
export LD_PRELOAD="$libasan $libstdcxx${LD_PRELOAD:+ $LD_PRELOAD}"
# abort_on_error: a report ends the process with SIGABRT (never exit 0);
# detect_leaks=0: CPython and the frameworks keep their allocations to exit.
export ASAN_OPTIONS="detect_leaks=0:abort_on_error=1:halt_on_error=1:symbolize=1:detect_stack_use_after_return=0${ASAN_OPTIONS:+:$ASAN_OPTIONS}"
export UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1:abort_on_error=1${UBSAN_OPTIONS:+:$UBSAN_OPTIONS}"
export PYTHONPATH="$repo${PYTHONPATH:+:$PYTHONPATH}"
exec "$@"
