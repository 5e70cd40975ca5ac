#!/usr/bin/env bash
# Builds libq4.so (CPU kernels, C ABI, XLA FFI handlers; no CUDA) with Bazel
# and copies it to OUTDIR/libq4.so. The CMake build is the primary one; this is
# the Bazel equivalent, made to work offline with Debian's bazel-bootstrap:
#
#   apt-get install bazel-bootstrap bazel-bootstrap-source
#   scripts/bazel_build.sh .venv/bin/python build/bazel-lib
#
# PYTHON must have jaxlib installed: its XLA FFI headers (jax.ffi.include_dir())
# become the external repository @xla_ffi_headers. Every external repository
# Debian ships a mock of (/usr/src/bazel-bootstrap/mock_repos/*, listed at run
# time) is overridden to it, so nothing is downloaded. Bazel's output base and
# install base live under build/bazel/ (git-ignored), not in $HOME; the Bazel
# server stays up for Q4_BAZEL_MAX_IDLE_SECS (default 900) so that a second
# run is quick.
#
# Environment: BAZEL (default: bazel), Q4_BAZEL_MOCK_REPOS (default:
# /usr/src/bazel-bootstrap/mock_repos; an empty or missing directory means no
# overrides, for a Bazel that may download), Q4_BAZEL_MAX_IDLE_SECS.
set -euo pipefail

die() {
  echo "bazel_build.sh: error: $*" >&2
  exit 1
}

[[ $# -eq 2 ]] || die "usage: $0 PYTHON OUTDIR"
python=$1
outdir=$2
[[ -n $outdir ]] || die "OUTDIR is empty"

bazel=${BAZEL:-bazel}
command -v "$bazel" >/dev/null 2>&1 ||
  die "'$bazel' not found. Install Debian's Bazel: apt-get install bazel-bootstrap bazel-bootstrap-source (or set BAZEL=/path/to/bazel)"

repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd -P)
# OUTDIR may be relative to the caller's directory; Bazel runs in the repo.
mkdir -p "$outdir"
outdir=$(cd "$outdir" && pwd -P)

# The jaxlib XLA FFI headers, staged as a local repository.
command -v "$python" >/dev/null 2>&1 || die "python '$python' not found"
ffi_include=$("$python" -c 'import jax.ffi; print(jax.ffi.include_dir())') ||
  die "'$python' cannot import jax.ffi (is jaxlib installed?); it provides the XLA FFI headers"
[[ -f $ffi_include/xla/ffi/api/ffi.h ]] ||
  die "no xla/ffi/api/ffi.h under jax.ffi.include_dir() = $ffi_include"

state=$repo/build/bazel
ffi_repo=$state/xla_ffi_headers
mkdir -p "$ffi_repo"
[[ -f $ffi_repo/WORKSPACE ]] || echo 'workspace(name = "xla_ffi_headers")' >"$ffi_repo/WORKSPACE"
link() { # link TARGET NAME, left alone when already right
  [[ -L $2 && $(readlink "$2") == "$1" ]] || ln -sfn "$1" "$2"
}
link "$repo/third_party/xla_ffi_headers.BUILD" "$ffi_repo/BUILD.bazel"
link "$ffi_include/xla" "$ffi_repo/xla"

startup_flags=(
  "--output_user_root=$state/root"
  "--output_base=$state/out"
  "--max_idle_secs=${Q4_BAZEL_MAX_IDLE_SECS:-900}"
)
build_flags=("--override_repository=xla_ffi_headers=$ffi_repo")
mock_repos=${Q4_BAZEL_MOCK_REPOS-/usr/src/bazel-bootstrap/mock_repos}
if [[ -n $mock_repos && -d $mock_repos ]]; then
  shopt -s nullglob
  for dir in "$mock_repos"/*/; do
    dir=${dir%/}
    build_flags+=("--override_repository=$(basename "$dir")=$dir")
  done
else
  echo "bazel_build.sh: note: no mock repositories at '$mock_repos'; Bazel may try to download its dependencies" >&2
fi

cd "$repo"
# --symlink_prefix: the convenience links go to build/bazel/q4-{bin,out,...}
# (.bazelrc turns them off for other builds); q4-bin locates the library.
"$bazel" "${startup_flags[@]}" build "${build_flags[@]}" \
  "--symlink_prefix=build/bazel/q4-" //:libq4.so
lib=$state/q4-bin/libq4.so
[[ -f $lib ]] || die "Bazel reported success but $lib does not exist"

if ! cmp -s "$lib" "$outdir/libq4.so"; then
  # Replace, never rewrite in place: a process may have the old library mapped.
  tmp=$(mktemp "$outdir/.libq4.so.XXXXXX")
  trap 'rm -f "$tmp"' EXIT
  cp "$lib" "$tmp"
  chmod 0755 "$tmp"
  mv -f "$tmp" "$outdir/libq4.so"
fi
echo "bazel_build.sh: $outdir/libq4.so"
