#!/usr/bin/env bash
# Builds deploy/Dockerfile here, where no image registry can be reached: the Dockerfile's
# `FROM python:3.11-slim` is replaced by the same thing made from Debian's packages
# (debootstrap: Debian bookworm, its python3 3.11 and pip), and pip installs offline from
# wheels fetched beforehand with the host's own pip. Everything else is the Dockerfile's,
# run by buildah (vfs storage, chroot isolation: works as root without a daemon).
#
#   deploy/build-image.sh        # prints the image's name on its last line
#   deploy/build-image.sh --cached            # the same, only if built and up to date:
#                                             # else exit 4
#   deploy/build-image.sh --buildah-options   # buildah's global options for its storage,
#                                             # one a line (to run the image)
#
# Cached in ${GPUSHARE_CACHE:-~/.cache/gpushare}/image/: the base root filesystem (a tar),
# buildah's storage, and the image, named <version>-<hash of what goes into it>; a second
# run with nothing changed returns at once. Exit 3: cannot build here (not root or no
# apt-get); the image test then skips, saying why. Users with a registry build the
# Dockerfile as it is: docker build -f deploy/Dockerfile -t gpushare:VERSION .
set -euo pipefail

REPO=$(cd "$(dirname "$0")/.." && pwd)
CACHE="${GPUSHARE_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/gpushare}/image"
PYTHON="${PYTHON:-$REPO/.venv/bin/python}"  # whose pip fetches the wheels
exec 8>&2  # where log() writes, even in a step whose stderr goes to a log file
log() { echo "build-image: $*" >&8; }
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
B=(buildah --root "$CACHE/storage" --runroot "$CACHE/run" --storage-driver vfs)
if [ "${1:-}" = --buildah-options ]; then
  printf '%s\n' "${B[@]:1}"
  exit 0
fi

if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null 2>&1; then
  log "needs root and apt-get (Debian) for debootstrap and buildah"
  exit 3
fi
# debootstrap and buildah mount file systems: a container without CAP_SYS_ADMIN refuses.
probe=$(mktemp -d)
if ! unshare --mount sh -c "mount -t tmpfs gpushare-probe '$probe'" 2>/dev/null; then
  rmdir "$probe"
  log "cannot mount file systems here (a container without CAP_SYS_ADMIN?): debootstrap and buildah need to"
  exit 3
fi
rmdir "$probe"
mkdir -p "$CACHE"
exec 9>"$CACHE/lock"
flock 9  # one build at a time on this machine; the second finds the first's image

cached=false
[ "${1:-}" = --cached ] && cached=true
not_built() {
  log "not built, or out of date: run make image (or deploy/build-image.sh)"
  exit 4
}

export DEBIAN_FRONTEND=noninteractive
need=()
for p in buildah debootstrap; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed' || need+=("$p")
done
if [ ${#need[@]} -gt 0 ]; then
  $cached && not_built
  step "apt-get update" apt-get -o DPkg::Lock::Timeout=600 update -qq
  step "installing ${need[*]} (Debian packages)" \
    apt-get -o DPkg::Lock::Timeout=600 install -y -qq --no-install-recommends "${need[@]}" >/dev/null
fi

WORK=$(mktemp -d "$CACHE/work.XXXXXX")
trap 'rm -rf "$WORK"' EXIT
start=$(date +%s)

# --- the base: python:3.11-slim's equivalent from Debian's packages --------------------
. /etc/os-release
SUITE="${VERSION_CODENAME:-bookworm}"
PKGS="python3,python3-pip,ca-certificates"
BASE_KEY=$(echo "1 $SUITE $PKGS" | sha256sum | cut -c1-12)  # bump 1 when the recipe changes
BASE="localhost/gpushare-base:$SUITE-$BASE_KEY"
ROOTFS="$CACHE/rootfs-$SUITE-$BASE_KEY.tar"
if ! "${B[@]}" inspect --type image "$BASE" >/dev/null 2>&1; then
  $cached && not_built
  if [ ! -s "$ROOTFS" ]; then
    [ -n "$(apt-get indextargets)" ] || apt-get -o DPkg::Lock::Timeout=600 update -qq
    mirror=$(apt-get indextargets --format '$(REPO_URI) $(RELEASE)' 'Created-By: Packages' |
      awk -v s="$SUITE" '$2 == s { print $1; exit }')
    [ -n "$mirror" ] || { log "apt knows no mirror for $SUITE (run apt-get update)"; exit 1; }
    t=$(date +%s)
    step "debootstrap $SUITE ($PKGS) from $mirror" \
      debootstrap --variant=minbase --include="$PKGS" "$SUITE" "$WORK/rootfs" "$mirror" \
      >"$WORK/debootstrap.log" 2>&1 || { tail -n 30 "$WORK/debootstrap.log" >&2; exit 1; }
    r="$WORK/rootfs"
    # As python:3.11-slim: pip installs into the system, `python` and `pip` exist, no caches.
    rm -f "$r"/usr/lib/python3*/EXTERNALLY-MANAGED
    ln -sf python3 "$r/usr/bin/python"
    [ -e "$r/usr/bin/pip" ] || ln -s pip3 "$r/usr/bin/pip"
    rm -rf "$r"/var/lib/apt/lists/* "$r"/var/cache/apt/* "$r"/var/log/* "$r"/tmp/*
    tar --numeric-owner -C "$r" -cf "$ROOTFS.tmp" . && mv "$ROOTFS.tmp" "$ROOTFS"
    rm -rf "$r"
    log "base root filesystem in $(($(date +%s) - t)) s: $ROOTFS ($(du -m "$ROOTFS" | cut -f1) MiB)"
  fi
  c=$("${B[@]}" from scratch)
  step "the base image from $(basename "$ROOTFS")" "${B[@]}" add "$c" "$ROOTFS" / >/dev/null
  "${B[@]}" config --env LANG=C.UTF-8 --env PATH=/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
    --cmd python3 "$c"
  "${B[@]}" commit -q --rm "$c" "$BASE" >/dev/null
fi

# --- the image: deploy/Dockerfile on that base ---------------------------------------
version=$(sed -n 's/^__version__ = "\(.*\)"$/\1/p' "$REPO/src/gpushare/_version.py")
key=$(
  cd "$REPO"
  {
    "${B[@]}" inspect --type image --format '{{.FromImageID}}' "$BASE"
    find deploy/Dockerfile deploy/build-image.sh pyproject.toml README.md src -type f \
      ! -path '*/__pycache__/*' ! -path '*.egg-info/*' -print0 | sort -z | xargs -0 sha256sum
  } | sha256sum | cut -c1-12
)
IMAGE="localhost/gpushare:$version-$key"
if ! "${B[@]}" inspect --type image "$IMAGE" >/dev/null 2>&1; then
  $cached && not_built
  t=$(date +%s)
  # The wheels for the image's Python, fetched by the host's pip (its index, its proxy).
  c=$("${B[@]}" from -q "$BASE")
  pyver=$("${B[@]}" run --isolation chroot "$c" -- \
    python3 -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')
  "${B[@]}" rm "$c" >/dev/null
  "$PYTHON" - "$REPO/pyproject.toml" >"$WORK/requirements.txt" <<'EOF'
import sys, tomllib
p = tomllib.load(open(sys.argv[1], "rb"))
extras = p["project"]["optional-dependencies"]
for r in [*p["build-system"]["requires"], *p["project"]["dependencies"],
          *extras["node"], *extras["nvml"], *extras["k8s"], "wheel"]:
    print(r)
EOF
  step "fetching the image's wheels (Python $pyver)" \
    "$PYTHON" -m pip download -q --disable-pip-version-check --only-binary=:all: \
    --python-version "$pyver" -d "$WORK/wheels" -r "$WORK/requirements.txt" \
    >"$WORK/pip.log" 2>&1 || { tail -n 30 "$WORK/pip.log" >&2; exit 1; }
  printf '[global]\nno-index = true\nfind-links = /wheels\n' >"$WORK/pip.conf"
  step "building $IMAGE from deploy/Dockerfile on $BASE" \
    "${B[@]}" build -q --isolation chroot --from "$BASE" \
    --volume "$WORK/wheels:/wheels:ro" --volume "$WORK/pip.conf:/etc/pip.conf:ro" \
    -f "$REPO/deploy/Dockerfile" -t "$IMAGE" "$REPO" >"$WORK/build.log" 2>&1 ||
    { tail -n 40 "$WORK/build.log" >&2; exit 1; }
  log "image built in $(($(date +%s) - t)) s"
  # Older builds of this image go (vfs keeps a full copy of each); one in use stays.
  "${B[@]}" images --format '{{.Name}}:{{.Tag}}' | grep '^localhost/gpushare:' |
    grep -vx "$IMAGE" | xargs -r "${B[@]}" rmi >/dev/null 2>&1 || true
fi
$cached || log "ready in $(($(date +%s) - start)) s"
echo "$IMAGE"
