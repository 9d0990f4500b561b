#!/usr/bin/env bash
# Builds a real kube-apiserver for the cluster tests, once, from Debian's `kubernetes`
# source package (upstream's tree with vendor/) with Debian's Go, and installs etcd from
# Debian's `etcd-server`. No registry here ships kube-apiserver binaries and the Go
# module proxy may be unreachable: this needs only the Debian mirror apt already uses.
#
#   tests/cluster/build-apiserver.sh            # prints the binary's path on its last line
#   tests/cluster/build-apiserver.sh --cached   # the same, only if built: else exit 4
#
# The binary is cached in ${GPUSHARE_CACHE:-~/.cache/gpushare}/k8s/ and named by the
# source version; a second run returns at once. Exit 3: cannot build here (not root or no
# apt-get); the cluster tests then skip, saying why.
set -euo pipefail

CACHE="${GPUSHARE_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/gpushare}/k8s"
mkdir -p "$CACHE"
exec 8>&2  # where log() writes, even in a step whose stderr goes to a log file
log() { echo "build-apiserver: $*" >&8; }
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

exec 9>"$CACHE/lock"
flock 9  # one build at a time on this machine; the second finds the first's binary
REV=2  # bump when this recipe changes: the cached binary is then rebuilt
existing=$(ls -1 "$CACHE"/kube-apiserver-*-r$REV 2>/dev/null | head -n 1 || true)
if [ -n "$existing" ] && [ -x "$existing" ] && command -v etcd >/dev/null && command -v openssl >/dev/null; then
  echo "$existing"
  exit 0
fi
if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null 2>&1; then
  log "needs root and apt-get (Debian) to build kube-apiserver and install etcd"
  exit 3
fi
if [ "${1:-}" = --cached ]; then
  log "not built yet: run make cluster-deps (or tests/cluster/build-apiserver.sh)"
  exit 4
fi

export DEBIAN_FRONTEND=noninteractive
# Other jobs on the machine may hold apt's lock for a while: wait for it.
APT=(-o DPkg::Lock::Timeout=600)
need=()
for p in golang-go golang-github-modern-go-reflect2-dev etcd-server rsync dpkg-dev make openssl; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed' || need+=("$p")
done
if [ ${#need[@]} -gt 0 ]; then
  step "apt-get update" apt-get "${APT[@]}" update -qq
  step "installing ${need[*]} (Debian packages)" \
    apt-get "${APT[@]}" install -y -qq --no-install-recommends "${need[@]}" >/dev/null
fi
if [ -n "$existing" ] && [ -x "$existing" ]; then echo "$existing"; exit 0; fi

WORK=$(mktemp -d "$CACHE/build.XXXXXX")
trap 'rm -rf "$WORK"' EXIT
start=$(date +%s)

[ -n "$(apt-get indextargets)" ] || apt-get "${APT[@]}" update -qq
# A private apt configuration with deb-src entries for the mirrors apt already uses, so
# the machine's own apt state is left as it was.
A="$WORK/apt"
mkdir -p "$A/lists/partial" "$A/cache/archives/partial" "$A/sources.list.d"
apt-get indextargets --format '$(REPO_URI) $(RELEASE) $(COMPONENT)' 'Created-By: Packages' |
  sort -u | while read -r uri release component; do
    echo "deb-src $uri $release $component"
  done >"$A/sources.list"
[ -s "$A/sources.list" ] || { log "apt knows no mirror (run apt-get update first)"; exit 1; }
APTSRC=(-o "Dir::Etc::SourceList=$A/sources.list" -o "Dir::Etc::SourceParts=$A/sources.list.d"
  -o "Dir::State::Lists=$A/lists" -o "Dir::Cache=$A/cache" -o "APT::Sandbox::User=root")
fetch_source() {  # && throughout: set -e does not reach into a step
  apt-get "${APTSRC[@]}" update -qq &&
    (cd "$WORK" && apt-get "${APTSRC[@]}" source --download-only -qq kubernetes >/dev/null)
}
step "fetching the kubernetes source package" fetch_source
dsc=$(ls "$WORK"/kubernetes_*.dsc)
version=$(sed -n 's/^Version: //p' "$dsc")
step "unpacking $(basename "$dsc")" sh -c 'cd "$1" && dpkg-source --no-check -x "$2" src >/dev/null' \
  _ "$WORK" "$dsc"

# GOPATH mode: the vendored tree as k8s.io/kubernetes.
GOPATH="$WORK/gopath"
mkdir -p "$GOPATH/src/k8s.io"
mv "$WORK/src" "$GOPATH/src/k8s.io/kubernetes"
K="$GOPATH/src/k8s.io/kubernetes"
# The vendored reflect2 1.0.1 crashes under Go >= 1.18 (SIGSEGV in UnsafeMapType.UnsafeIterate
# on the first custom-resource request); Debian's 1.0.2 is the fix.
rm -rf "$K/vendor/github.com/modern-go/reflect2"
cp -r /usr/share/gocode/src/github.com/modern-go/reflect2 "$K/vendor/github.com/modern-go/reflect2"

export GOPATH GO111MODULE=off CGO_ENABLED=0 GOFLAGS= GOCACHE="$WORK/gocache" GOTOOLCHAIN=local
gen_openapi() { (cd "$K" && make gen_openapi >"$WORK/gen.log" 2>&1); }
step "generating OpenAPI definitions" gen_openapi || { tail -n 30 "$WORK/gen.log" >&2; exit 1; }
upstream=$(echo "$version" | sed -E 's/^([0-9.]+\+really)?([0-9.]+).*/\2/')
minor=$(echo "$upstream" | cut -d. -f2)
# The version the server reports (/version, kubectl's skew check), as upstream's
# hack/lib/version.sh sets it: in both packages that hold it.
ldflags="-s -w"
for V in k8s.io/kubernetes/vendor/k8s.io/component-base/version \
  k8s.io/kubernetes/vendor/k8s.io/client-go/pkg/version; do
  ldflags="$ldflags -X $V.gitVersion=v$upstream -X $V.gitMajor=1 -X $V.gitMinor=$minor"
  ldflags="$ldflags -X $V.gitTreeState=clean -X $V.buildDate=1970-01-01T00:00:00Z"
done
go_build() {
  (cd "$K" && go build -tags selinux,notest -ldflags "$ldflags" -o "$WORK/kube-apiserver" ./cmd/kube-apiserver)
}
step "building kube-apiserver $upstream (Debian $version) with $(go version | cut -d' ' -f3)" go_build
out="$CACHE/kube-apiserver-$upstream-r$REV"
rm -f "$CACHE"/kube-apiserver-*  # earlier recipes' binaries
mv "$WORK/kube-apiserver" "$out"
log "built $out in $(($(date +%s) - start)) s"
echo "$out"
