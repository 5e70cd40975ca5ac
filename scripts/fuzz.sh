#!/usr/bin/env bash
# The seeded, bounded fuzz campaign: every tests/fuzz/fuzz_*.py target under
# atheris (libFuzzer), one after the other.
#
#   scripts/fuzz.sh [TARGET.py ...]      (default: every tests/fuzz/fuzz_*.py)
#
# Each target fuzz_NAME.py runs for Q4_FUZZ_SECONDS (default 15) with
# libFuzzer's -seed=Q4_FUZZ_SEED (default 1), starting from
# tests/fuzz/corpus/NAME/ and tests/fuzz/regressions/NAME/ (both read only:
# new corpus units go to a scratch directory that is removed afterwards).
# A crash input (an escaped exception, a timeout of Q4_FUZZ_TIMEOUT seconds,
# default 20, or a run past 4 GB of memory) is written to
# tests/fuzz/regressions/NAME/ -- commit it: tests/fuzz/test_fuzz_regressions.py
# (and, for the C ABI, tests/kernels/test_sizes.py) replay every file there in
# the normal test run, so it fails until the bug is fixed.
#
# The campaign is guided by atheris' coverage of the Python code it
# instruments (q4's loaders, the targets' validity rules). A target with the
# line "# q4-fuzz: asan" in its first 30 lines is also checked under the
# AddressSanitizer + UBSan build of libq4 (scripts/asan_run.sh), as a replay:
# the guided campaign runs against the normal build, then every unit of its
# grown corpus (seeds, regressions, the new units) runs once under the
# sanitizers (libFuzzer -runs=0). (Fuzzing under the sanitizer preload itself is
# blind: gcc's ASan runtime, loaded first, takes the coverage callbacks that
# atheris registers with libFuzzer, so no input ever looks new.)
#
# Prints, per target, the cases run, the corpus growth (seed units + new
# units; a guided run that found none is flagged) and the crashes found, then
# a total; the exit status is 1 if any target crashed or failed, 2 if the
# campaign cannot run at all (atheris not installed: never a silent skip).
#
# Environment: PYTHON (default: .venv/bin/python, else python3),
# Q4_FUZZ_SECONDS, Q4_FUZZ_SEED, Q4_FUZZ_TIMEOUT, Q4_FUZZ_LOG_DIR (keep each
# target's libFuzzer log there; default: print its tail on failure only).
set -euo pipefail

die() {
  echo "fuzz.sh: error: $*" >&2
  exit 2
}

repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd -P)
seconds=${Q4_FUZZ_SECONDS:-15}
seed=${Q4_FUZZ_SEED:-1}
per_input=${Q4_FUZZ_TIMEOUT:-20}
[[ $seconds =~ ^[0-9]+$ && $seconds -gt 0 ]] || die "Q4_FUZZ_SECONDS must be a positive integer, got '$seconds'"
[[ $seed =~ ^[0-9]+$ ]] || die "Q4_FUZZ_SEED must be a non-negative integer, got '$seed'"
[[ $per_input =~ ^[0-9]+$ && $per_input -gt 0 ]] || die "Q4_FUZZ_TIMEOUT must be a positive integer, got '$per_input'"

python=${PYTHON:-}
if [[ -z $python ]]; then
  if [[ -x $repo/.venv/bin/python ]]; then python=$repo/.venv/bin/python; else python=python3; fi
fi
command -v "$python" >/dev/null 2>&1 || die "python '$python' not found"
"$python" -c "import atheris" 2>/dev/null ||
  die "atheris is not installed for $python (pip install atheris); the fuzz campaign cannot run"

if [[ $# -gt 0 ]]; then
  targets=("$@")
else
  shopt -s nullglob
  targets=("$repo"/tests/fuzz/fuzz_*.py)
  shopt -u nullglob
fi
[[ ${#targets[@]} -gt 0 ]] || die "no fuzz targets (tests/fuzz/fuzz_*.py)"

base=${TMPDIR:-/tmp}
[[ -d /dev/shm && -w /dev/shm ]] && base=/dev/shm # the targets write a file per case
scratch=$(mktemp -d "$base/q4-fuzz.XXXXXX")
trap 'rm -rf "$scratch"' EXIT
logs=${Q4_FUZZ_LOG_DIR:-$scratch/logs}
mkdir -p "$logs"

artifacts() { # artifacts DIR: the crash inputs libFuzzer wrote there, one name a line
  find "$1" -maxdepth 1 -type f \( -name 'crash-*' -o -name 'timeout-*' -o -name 'oom-*' -o -name 'leak-*' \) \
    -printf '%f\n' | sort
}

units() { # units DIR...: the number of corpus files in the existing DIRs
  local n=0 d
  for d in "$@"; do
    [[ -d $d ]] && n=$((n + $(find "$d" -maxdepth 1 -type f ! -name 'README*' ! -name '.*' ! -name 'crash-*' \
      ! -name 'timeout-*' ! -name 'oom-*' ! -name 'leak-*' | wc -l)))
  done
  echo "$n"
}

executed() { # executed LOG: the units libFuzzer ran
  local n
  n=$(sed -n 's/^stat::number_of_executed_units: *\([0-9]*\).*/\1/p' "$1" | tail -n 1)
  [[ -n $n ]] || n=$(sed -n 's/^#\([0-9][0-9]*\)[[:space:]].*/\1/p' "$1" | tail -n 1)
  echo "${n:-0}"
}

failed=0 total_cases=0 total_crashes=0 total_new=0 total_replayed=0
for target in "${targets[@]}"; do
  [[ -f $target ]] || die "no such fuzz target: $target"
  target=$(cd "$(dirname "$target")" && pwd -P)/$(basename "$target")
  name=$(basename "$target" .py)
  name=${name#fuzz_}
  corpus=$repo/tests/fuzz/corpus/$name
  regress=$repo/tests/fuzz/regressions/$name
  work=$scratch/corpus-$name
  log=$logs/$name.log
  mkdir -p "$regress" "$work"
  dirs=("$work")
  [[ -d $corpus ]] && dirs+=("$corpus")
  dirs+=("$regress")
  asan=0
  if head -n 30 "$target" | grep -q '# q4-fuzz: asan'; then
    [[ -x $repo/scripts/asan_run.sh ]] || die "$name needs the sanitizer build, but scripts/asan_run.sh is missing"
    asan=1
  fi
  seeds=$(units "${dirs[@]}")
  before=$(artifacts "$regress")
  note=""
  [[ $asan == 1 ]] && note=", then a replay of the corpus under AddressSanitizer + UBSan"
  echo "== fuzz $name: ${seconds} s, seed $seed, from $seeds corpus units$note" >&2
  rc=0
  Q4_FUZZ_SCRATCH=$scratch PYTHON=$python PYTHONPATH="$repo${PYTHONPATH:+:$PYTHONPATH}" "$python" "$target" \
    -seed="$seed" -max_total_time="$seconds" -timeout="$per_input" -rss_limit_mb=4096 \
    -report_slow_units="$per_input" -print_final_stats=1 -artifact_prefix="$regress/" \
    "${dirs[@]}" >"$log" 2>&1 || rc=$?
  cases=$(executed "$log")
  new=$(units "$work")
  replay=""
  if [[ $asan == 1 && $rc -eq 0 ]]; then
    # every unit of the grown corpus once, under the sanitizers (no mutation: -runs=0)
    Q4_FUZZ_SCRATCH=$scratch PYTHON=$python "$repo/scripts/asan_run.sh" "$python" "$target" \
      -runs=0 -timeout="$per_input" -rss_limit_mb=4096 -print_final_stats=1 -artifact_prefix="$regress/" \
      "${dirs[@]}" >>"$log" 2>&1 || rc=$?
    replayed=$(units "${dirs[@]}")
    total_replayed=$((total_replayed + replayed))
    replay=", $replayed units replayed under AddressSanitizer + UBSan"
  fi
  found=$(comm -13 <(echo "$before") <(artifacts "$regress") | sed '/^$/d')
  crashes=$(printf '%s' "$found" | grep -c . || true)
  total_cases=$((total_cases + cases))
  total_crashes=$((total_crashes + crashes))
  total_new=$((total_new + new))
  echo "fuzz $name: $cases cases run, corpus $seeds -> $((seeds + new)) units (+$new new)$replay, $crashes crashes found (exit status $rc)"
  if [[ $new -eq 0 && $rc -eq 0 ]]; then
    echo "fuzz $name: warning: no new corpus unit in $cases cases -- is the coverage guidance reaching libFuzzer?" >&2
  fi
  if [[ $crashes -gt 0 || $rc -ne 0 ]]; then
    failed=1
    for f in $found; do echo "  crash input: tests/fuzz/regressions/$name/$f"; done
    echo "---- last lines of the libFuzzer log${Q4_FUZZ_LOG_DIR:+ ($log)}:" >&2
    tail -n 40 "$log" >&2
  fi
done
echo "fuzz: ${#targets[@]} targets, $total_cases cases run, $total_new new corpus units, $total_replayed units replayed under the sanitizers, $total_crashes crashes found"
exit $failed
