#!/usr/bin/env bash
# `make test` (and so CI's .ci/run): lint, types, then the tests, with the cluster suite's
# servers built beside them. The control plane (tests/cluster/build-k8s.sh), gpushare's DRA
# kubelet plugin (tests/cluster/build-dra.sh, after it: the same Go build cache) and the
# node's image (deploy/build-image.sh) take minutes the first time and seconds once cached:
# they build in the background, one after the other, at nice 10, while
# lint, mypy and every test outside tests/cluster run; the cluster tests run once both
# are built. A build that fails fails make test, with its last lines; one that cannot
# run here (no Go; not root, no apt-get: exit 3) lets the tests that need it skip, saying why.
#
#   BIN=.venv/bin PYTEST='.venv/bin/pytest -q' bash tests/make-test.sh   # as make test runs it
set -uo pipefail
cd "$(dirname "$0")/.."
BIN=${BIN:-.venv/bin}
read -r -a PYTEST <<<"${PYTEST:-$BIN/pytest -q}"
OUT=$(mktemp -d "${TMPDIR:-/tmp}/gpushare-make-test.XXXXXX")
say() { echo "make test: $*"; }

# Each build's last stdout line (a path, an image) to $OUT/NAME.out, its status to NAME.rc;
# its progress lines (a line at least every 30 s) on this terminal, prefixed by its name.
# setsid: the builds are a process group of their own, ended with this script.
setsid bash -c '
  nice -n 10 bash tests/cluster/build-k8s.sh >"$1/k8s.out"; echo $? >"$1/k8s.rc"
  nice -n 10 bash tests/cluster/build-dra.sh >"$1/dra.out"; echo $? >"$1/dra.rc"
  PYTHON="$2/python" nice -n 10 bash deploy/build-image.sh >"$1/image.out"; echo $? >"$1/image.rc"
' _ "$OUT" "$BIN" &
builds=$!
# its group exists once setsid has run: only then can the trap end every build process
for _ in $(seq 100); do
  [ "$(ps -o pgid= -p "$builds" 2>/dev/null | tr -d ' ')" = "$builds" ] && break
  sleep 0.05
done
trap 'kill -- -"$builds" 2>/dev/null; rm -rf "$OUT"' EXIT
trap 'exit 130' INT TERM
say "building the cluster tests' control plane, DRA plugin and image in the background (pid $builds)"

# Lint and types fail at once, as make's prerequisites did.
"${MAKE:-make}" --no-print-directory lint typecheck || exit 1

failed=()
say "the tests that need no cluster server (${PYTEST[*]} --ignore=tests/cluster)"
"${PYTEST[@]}" --ignore=tests/cluster || failed+=("the tests outside tests/cluster")

if [ ! -e "$OUT/image.rc" ]; then
  say "waiting for the control plane, DRA plugin and image builds to finish (their progress above)"
fi
wait "$builds"
for b in k8s dra image; do
  rc=$(cat "$OUT/$b.rc" 2>/dev/null || echo "none (the build was ended)")
  case "$rc" in
  0) say "$b: $(tail -n 1 "$OUT/$b.out")" ;;
  3) say "$b cannot be built here (see its line above): the tests that need it skip" ;;
  *)
    say "FAILED: the $b build exited $rc (its last lines are above)"
    failed+=("the $b build")
    ;;
  esac
done

say "the cluster tests (${PYTEST[*]} tests/cluster)"
"${PYTEST[@]}" tests/cluster || failed+=("tests/cluster")

if [ ${#failed[@]} -gt 0 ]; then
  for f in "${failed[@]}"; do say "FAILED: $f"; done
  exit 1
fi
say "all passed"
