#!/bin/sh
# The GPU check in one command (benchmarks/gpu_check.py): stage 1, the smoke (<= 2 min:
# versions, gpushare's allocator built, the driver layer on the GPU, pytest -m gpu), then
# stage 2, the benchmark (<= 6 min: benchmarks/gpu_swap.py's parts). Each part in its
# own process with its own timeout; results/results.json and results.md written after
# every part, each part's output in PART.log.
#
#   sh benchmarks/gpu_check.sh                   # results in ./gpu-results/
#   OUT=dir WHEELS=dir sh benchmarks/gpu_check.sh
#   DRY=1 sh benchmarks/gpu_check.sh             # every part tiny, without a GPU
#
# WHEELS: a folder of wheels for this machine's Python (cp312 on the lent H200: see
# docs/benchmarks.md for the pip command), installed to a private folder first; a
# prebuilt libgpushare_alloc.so there is used where no C compiler is.
set -u
cd "$(dirname "$0")/.."
out=${OUT:-gpu-results}
mkdir -p "$out"
py=${PYTHON:-python3}
site=""
if [ -n "${WHEELS:-}" ]; then
    site="$out/site"
    if ! $py -m pip install -q --no-index --no-deps --no-compile --upgrade --target "$site" "$WHEELS"/*.whl; then
        echo "gpu_check: installing the wheels of $WHEELS into $($py -V 2>&1) failed: wheels for this Python's version are needed (docs/benchmarks.md)" >&2
        exit 1
    fi
    if ! command -v cc >/dev/null 2>&1 && [ -f "$WHEELS/libgpushare_alloc.so" ]; then
        GPUSHARE_SHIM="$WHEELS/libgpushare_alloc.so"
        export GPUSHARE_SHIM
    fi
fi
PYTHONPATH="${site:+$site:}src${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONPATH PYTHONUNBUFFERED=1
if [ -n "${DRY:-}" ]; then
    exec $py benchmarks/gpu_check.py --out "$out" --dry "$@"
fi
exec $py benchmarks/gpu_check.py --out "$out" "$@"
