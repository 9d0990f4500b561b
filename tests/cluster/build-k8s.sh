#!/usr/bin/env bash
# Builds the cluster tests' control plane once, from Go modules, with the machine's Go:
# kube-apiserver, kube-controller-manager, kube-scheduler and kubelet from
# k8s.io/kubernetes (tests/cluster/modules/kubernetes/go.mod pins the release and its staging
# modules), and etcd from go.etcd.io/etcd/server/v3 (tests/cluster/modules/etcd/go.mod). No
# registry here ships these binaries; the Go module proxy serves their source.
#
#   tests/cluster/build-k8s.sh            # prints the binaries' folder on its last line
#   tests/cluster/build-k8s.sh --cached   # the same, only if built: else exit 4
#
# Cached in ${GPUSHARE_CACHE:-~/.cache/gpushare}/k8s/<release>-etcd-<release>-r<REV>/; a
# second run returns at once. Exit 3: cannot build here (no Go); the cluster tests then
# skip, saying why.
set -euo pipefail

HERE=$(cd "$(dirname "$0")" && pwd)
ROOT="${GPUSHARE_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/gpushare}/k8s"
mkdir -p "$ROOT"
exec 8>&2 # where log() writes, even in a step whose stderr goes to a log file
log() { echo "build-k8s: $*" >&8; }
# One long step: says what it is, then every ${GPUSHARE_PROGRESS_S:-30} s that it still
# runs and for how long (a build of many minutes is never silent); the command's status.
step() {
  local what=$1 t0 ticker status=0
  shift
  t0=$(date +%s)
  log "$what"
  # the ticker's sleep holds no pipe open, and the ticker ends with this script
  (while sleep "${GPUSHARE_PROGRESS_S:-30}" </dev/null >/dev/null 2>&1 && kill -0 $$ 2>/dev/null; do
    e=$(($(date +%s) - t0))
    log "  ... $what: $((e / 60)) min $((e % 60)) s so far"
  done) &
  ticker=$!
  "$@" || status=$?
  kill "$ticker" 2>/dev/null || true
  wait "$ticker" 2>/dev/null || true
  [ "$status" = 0 ] && log "  $what: done in $(($(date +%s) - t0)) s"
  return "$status"
}

# The releases, read from the modules that pin them (one place to change them).
release() { awk -v m="$1" '($1 == m || ($1 == "require" && $2 == m)) { print ($1 == m ? $2 : $3); exit }' "$2"; }
K8S=$(release k8s.io/kubernetes "$HERE/modules/kubernetes/go.mod")
ETCD=$(release go.etcd.io/etcd/server/v3 "$HERE/modules/etcd/go.mod")
[ -n "$K8S" ] && [ -n "$ETCD" ] || { log "cannot read the releases from the go.mod files"; exit 1; }
REV=1 # bump when this recipe changes: the binaries are then rebuilt
OUT="$ROOT/$K8S-etcd-$ETCD-r$REV"
BINARIES=(kube-apiserver kube-controller-manager kube-scheduler kubelet etcd)

built() {
  for b in "${BINARIES[@]}"; do [ -x "$OUT/$b" ] || return 1; done
  command -v openssl >/dev/null
}
if built; then
  echo "$OUT"
  exit 0
fi
if [ "${1:-}" = --cached ]; then
  log "not built yet: run make cluster-deps (or tests/cluster/build-k8s.sh)"
  exit 4
fi
if ! command -v go >/dev/null 2>&1; then
  log "needs Go (1.26 or newer) on PATH to build Kubernetes $K8S and etcd $ETCD"
  exit 3
fi

exec 9>"$ROOT/lock"
flock 9 # one build at a time on this machine; the second finds the first's binaries
if built; then
  echo "$OUT"
  exit 0
fi
if ! command -v openssl >/dev/null 2>&1; then # the test cluster's service-account key
  if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null 2>&1; then
    log "needs openssl (the cluster's keys): install it, or run as root with apt-get"
    exit 3
  fi
  step "installing openssl (Debian package)" sh -c \
    'apt-get -o DPkg::Lock::Timeout=600 update -qq &&
     DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=600 install -y -qq \
       --no-install-recommends openssl >/dev/null'
fi

start=$(date +%s)
WORK=$(mktemp -d "$ROOT/build.XXXXXX")
trap 'rm -rf "$WORK"' EXIT
# The machine's Go and its own module and build caches (a recipe change rebuilds in
# seconds), whatever GOFLAGS the caller has; static binaries, as upstream ships them.
export GOFLAGS=-mod=mod CGO_ENABLED=0
log "$(go version | cut -d' ' -f3-): Kubernetes $K8S, etcd $ETCD, into $OUT"

minor=$(echo "$K8S" | cut -d. -f2)
# The version the binaries report (/version, kubectl's skew check), as upstream's
# hack/lib/version.sh sets it, in both packages that hold it.
ldflags="-s -w"
for V in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
  ldflags="$ldflags -X $V.gitVersion=$K8S -X $V.gitMajor=1 -X $V.gitMinor=$minor"
  ldflags="$ldflags -X $V.gitTreeState=clean -X $V.buildDate=1970-01-01T00:00:00Z"
done
fetch() { (cd "$HERE/modules/$1" && go mod download >"$WORK/$1-download.log" 2>&1) || {
  tail -n 20 "$WORK/$1-download.log" >&2
  return 1
}; }
step "fetching Kubernetes $K8S's modules (Go module proxy)" fetch kubernetes
step "fetching etcd $ETCD's modules" fetch etcd
k8s_build() {
  (cd "$HERE/modules/kubernetes" && go build -trimpath -ldflags "$ldflags" -o "$WORK/" \
    k8s.io/kubernetes/cmd/kube-apiserver k8s.io/kubernetes/cmd/kube-controller-manager \
    k8s.io/kubernetes/cmd/kube-scheduler k8s.io/kubernetes/cmd/kubelet \
    >"$WORK/k8s.log" 2>&1) || {
    tail -n 30 "$WORK/k8s.log" >&2
    return 1
  }
}
step "building kube-apiserver, kube-controller-manager, kube-scheduler, kubelet $K8S" k8s_build
etcd_build() {
  (cd "$HERE/modules/etcd" && go build -trimpath -ldflags "-s -w" -o "$WORK/etcd" \
    go.etcd.io/etcd/server/v3 >"$WORK/etcd.log" 2>&1) || {
    tail -n 30 "$WORK/etcd.log" >&2
    return 1
  }
}
step "building etcd $ETCD" etcd_build
mkdir -p "$OUT"
for b in "${BINARIES[@]}"; do mv "$WORK/$b" "$OUT/$b"; done
# earlier recipes' and releases' binaries (the caches stay)
for d in "$ROOT"/v*-r*; do [ "$d" = "$OUT" ] || rm -rf "$d"; done
rm -f "$ROOT"/kube-apiserver-* # the retired Debian build's binary
log "built in $(($(date +%s) - start)) s: $("$OUT/kube-apiserver" --version), etcd $("$OUT/etcd" --version | sed -n 's/^etcd Version: //p')"
echo "$OUT"
