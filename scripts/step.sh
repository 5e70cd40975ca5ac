#!/usr/bin/env bash
# Runs one named step of `make demo` / `make test` and says how long it took:
#
#   scripts/step.sh NAME CMD ARGS...
#
# Prints "== NAME ..." before and "== NAME: done in Ns" (or "FAILED (status S)
# after Ns") after, so a long run shows where it is and where the time went.
set -uo pipefail
[[ $# -ge 2 ]] || { echo "usage: $0 NAME CMD ARGS..." >&2; exit 2; }
name=$1
shift
echo "== $name ..."
start=$SECONDS
"$@"
status=$?
elapsed=$((SECONDS - start))
if [[ $status -eq 0 ]]; then
  echo "== $name: done in ${elapsed}s"
else
  echo "== $name: FAILED (status $status) after ${elapsed}s" >&2
fi
exit "$status"
