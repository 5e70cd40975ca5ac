#!/usr/bin/env bash
# Installs the project into a venv with its native library built by CMake,
# showing the build's progress instead of minutes of silence:
#
#   scripts/pip_install.sh PYTHON EXTRA
#
# PYTHON is the venv's python; EXTRA the optional-dependency set (demo, test).
# The CUDA kernels are compiled when Q4_CUDA=1, or when Q4_CUDA is unset and a
# GPU is present (`nvidia-smi -L` lists one); Q4_CUDA=0 never compiles them.
# CI sets Q4_CUDA=1, so a CUDA compile error fails CI even without a GPU.
# The full pip/CMake log goes to build/pip-EXTRA.log; its compile lines
# ("[n/N] Building CXX object ...") are echoed as they come, and the log's
# tail is printed if the install fails.
set -uo pipefail
[[ $# -eq 2 ]] || { echo "usage: $0 PYTHON EXTRA" >&2; exit 2; }
python=$1
extra=$2
cuda=${Q4_CUDA:-}
if [[ -z $cuda ]]; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L 2>/dev/null | grep -q '^GPU'; then cuda=1; else cuda=0; fi
fi
case $cuda in
  1 | ON | on | yes) cuda=ON ;;
  0 | OFF | off | no) cuda=OFF ;;
  *) echo "pip_install.sh: Q4_CUDA must be 1 or 0, got '$cuda'" >&2; exit 2 ;;
esac
echo "   CUDA kernels: $cuda (Q4_CUDA=1 compiles them, Q4_CUDA=0 never; default: only when a GPU is present)"
mkdir -p build
log=build/pip-$extra.log
SKBUILD_CMAKE_DEFINE="Q4_CUDA=$cuda" "$python" -m pip install -v --no-build-isolation ".[$extra]" >"$log" 2>&1 &
pid=$!
# Echo compile progress and what pip is fetching, nothing else.
tail -n +1 -F --pid="$pid" "$log" 2>/dev/null |
  grep --line-buffered -E '^\s*\[[0-9]+/[0-9]+\] |^Collecting |^Successfully installed' |
  sed -u -E 's/^\s+//; s/^(Successfully installed).*/\1 (see '"${log//\//\\/}"')/; s/^/   /'
wait "$pid"
status=$?
if [[ $status -ne 0 ]]; then
  echo "pip_install.sh: pip install '.[$extra]' failed (status $status); the end of $log:" >&2
  tail -n 60 "$log" >&2
fi
exit "$status"
