#!/usr/bin/env bash
# Makes sure a Bazel that can build offline is installed (Debian's
# bazel-bootstrap, with its mock repositories). Installs it with apt-get when
# running as root; otherwise says what to install and fails.
set -euo pipefail
if command -v bazel >/dev/null 2>&1 && [[ -d /usr/src/bazel-bootstrap/mock_repos ]]; then
  exit 0
fi
if [[ $(id -u) -eq 0 ]] && command -v apt-get >/dev/null 2>&1; then
  # a system package install is never silent: say what runs, and let apt-get show its work
  echo "== ensure_bazel.sh: Bazel is not installed; running as root, so installing Debian's bazel-bootstrap:" >&2
  echo "   apt-get update && apt-get install -y bazel-bootstrap bazel-bootstrap-source" >&2
  apt-get update -q
  DEBIAN_FRONTEND=noninteractive apt-get install -y -q bazel-bootstrap bazel-bootstrap-source
  exit 0
fi
echo "ensure_bazel.sh: error: Bazel is needed for 'make test' (the Bazel build is tested too)." >&2
echo "  install it: sudo apt-get install bazel-bootstrap bazel-bootstrap-source" >&2
exit 1
