#!/usr/bin/env bash
# bitsandbytes' own test files, run against q4torch through a stand-in
# `bitsandbytes` package (scripts/bnb_compat/) that forwards its names to
# q4torch. Nothing is fetched: point BNB_TESTS at the tests/ directory of a
# bitsandbytes checkout you have. The files are copied to a temporary
# directory (so the checkout's own package is not importable) and run there
# on the CPU (BNB_TEST_DEVICE=cpu).
#
#   BNB_TESTS=/path/to/bitsandbytes/tests scripts/bnb_tests.sh [pytest args, e.g. tests/test_linear4bit.py]
#
# BNB_REAL=1 runs the same files against the installed bitsandbytes instead
# (the reference counts). README "bitsandbytes API -> q4" lists the results.
set -euo pipefail
src=${BNB_TESTS:?set BNB_TESTS to the tests/ directory of a bitsandbytes checkout}
here=$(cd "$(dirname "$0")" && pwd)
root=$(dirname "$here")
python=${PYTHON:-$root/.venv/bin/python}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cp -r "$src" "$work/tests"
cd "$work"
if [ "${BNB_REAL:-0}" = 1 ]; then
  path="$work"
else
  path="$here/bnb_compat:$root:$work"
fi
PYTHONPATH="$path${PYTHONPATH:+:$PYTHONPATH}" BNB_TEST_DEVICE=cpu "$python" -m pytest -q -p no:cacheprovider \
  --rootdir "$work" "${@:-tests}"
