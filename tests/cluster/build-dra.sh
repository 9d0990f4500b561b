#!/usr/bin/env bash
# Builds gpushare's DRA kubelet plugin, gpushare-dra, from deploy/dra (its own go.mod),
# with the machine's Go, as build-k8s.sh builds the control plane: CGO_ENABLED=0,
# -trimpath, so the k8s.io packages already in Go's build cache are reused.
#
#   tests/cluster/build-dra.sh            # prints the binary's path on its last line
#   tests/cluster/build-dra.sh --cached   # the same, only if built: else exit 4
#
# Cached in ${GPUSHARE_CACHE:-~/.cache/gpushare}/dra/<hash of the sources>/: a change to
# deploy/dra rebuilds it. Exit 3: no Go here; the tests that need it then skip.
set -euo pipefail

SRC=$(cd "$(dirname "$0")/../../deploy/dra" && pwd)
ROOT="${GPUSHARE_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/gpushare}/dra"
# the binary's sources: its tests (*_test.go) change no byte of it
HASH=$(cd "$SRC" && cat go.mod go.sum $(ls ./*.go | grep -v '_test\.go$') | sha256sum | cut -c1-16)
OUT="$ROOT/$HASH"
if [ -x "$OUT/gpushare-dra" ]; then
  echo "$OUT/gpushare-dra"
  exit 0
fi
if [ "${1:-}" = --cached ]; then
  echo "build-dra: not built yet: run tests/cluster/build-dra.sh" >&2
  exit 4
fi
command -v go >/dev/null || { echo "build-dra: no Go on this machine" >&2; exit 3; }
mkdir -p "$OUT"
echo "build-dra: building gpushare-dra (minutes the first time)" >&2
(cd "$SRC" && CGO_ENABLED=0 go build -trimpath -o "$OUT/gpushare-dra.tmp" .)
mv "$OUT/gpushare-dra.tmp" "$OUT/gpushare-dra"
echo "$OUT/gpushare-dra"
