#!/bin/sh
# Makes the folder the GPU run carries to the lent machine (.gpu-carry, ignored by git),
# here, where packages can be fetched; nothing is fetched there. From a clean clone:
#
#   sh benchmarks/gpu_prepare.sh        # then, on the device: sh benchmarks/gpu_check.sh
#
# In it: the wheels for CPython 3.12 on x86-64 of what gpushare needs and the lent
# machine lacks (msgspec, tomli-w; torch-memory-saver for the anchor part): pytest,
# hypothesis, prometheus-client, nvidia-ml-py and PyTorch are there already (KINDS.md);
# and gpushare's allocator library built with this machine's cc (the library dlopens
# libcuda: it needs no CUDA header), used there if it has no C compiler. The folder and
# the working tree must stay under the device tool's 64 MiB: both are checked here.
#
# PYTHON (default python3, any version: pip downloads for 3.12), CARRY (default
# .gpu-carry), PYVER (default 3.12).
set -eu
cd "$(dirname "$0")/.."
py=${PYTHON:-python3}
carry=${CARRY:-.gpu-carry}
pyver=${PYVER:-3.12}
abi="cp$(echo "$pyver" | tr -d .)"
rm -rf "$carry"
mkdir -p "$carry"
# The packages' own needs: msgspec and tomli-w need nothing; torch-memory-saver needs
# PyTorch (there). One version of each.
$py -m pip download --quiet --no-deps --only-binary=:all: --python-version "$pyver" \
    --implementation cp --abi "$abi" --abi abi3 --abi none \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 -d "$carry" \
    'msgspec>=0.18' 'tomli-w>=1.0' torch-memory-saver
cc=${CC:-$(command -v cc || command -v gcc || true)}
if [ -z "$cc" ]; then
    echo "gpu_prepare: no C compiler here: install gcc, or the device builds the library itself if it has one" >&2
    exit 1
fi
"$cc" -O2 -shared -fPIC -o "$carry/libgpushare_alloc.so" src/gpushare/client/swap/gpushare_alloc.c -ldl -lpthread
# The newest glibc symbol it needs: the device's glibc (facts.json) must be as new.
glibc=$(objdump -T "$carry/libgpushare_alloc.so" 2>/dev/null | grep -o 'GLIBC_[0-9.]*' | sort -t. -k1,1 -k2,2n | tail -n 1 || true)
{
    echo "made $(date -u +%Y-%m-%dT%H:%M:%SZ) from $(git rev-parse --short HEAD 2>/dev/null || echo '?')"
    echo "libgpushare_alloc.so: $("$cc" --version | head -n 1); needs ${glibc:-glibc ?} or newer"
    for w in "$carry"/*.whl; do echo "wheel: $(basename "$w")"; done
} > "$carry/MANIFEST.txt"
limit=$((64 * 1024 * 1024))
size=$(du -sb "$carry" | cut -f1)
tree=$(git ls-files -z --cached --others --exclude-standard | xargs -0 du -cb 2>/dev/null | tail -n 1 | cut -f1)
cat "$carry/MANIFEST.txt"
echo "gpu_prepare: $carry is $size bytes; with the working tree ($tree bytes) $((size + tree)) of $limit"
if [ $((size + tree)) -ge $limit ]; then
    echo "gpu_prepare: over the device tool's 64 MiB: carry less" >&2
    exit 1
fi
