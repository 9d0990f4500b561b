#!/bin/sh
# The GPU check in one command (benchmarks/gpu_check.py): the device's facts first, the
# plan sized from this machine's host and GPU memory, then stage 1, the smoke (versions,
# gpushare's allocator, the driver layer on the GPU, pytest -m gpu), then stage 2, the
# benchmark (benchmarks/gpu_swap.py's parts); stages 1 and 2 keep to 8 minutes. Each
# part in its own process with its planned timeout; the results folder gets facts.json,
# plan.md, results.json, results.md and logs.txt, rewritten after every part.
#
#   sh benchmarks/gpu_check.sh                  # results in $OUT (the lent machine's
#                                               # return folder), else ./gpu-results
#   sh benchmarks/gpu_check.sh --stages 3       # the long TQ-30 pair, a second call
#   DRY=1 sh benchmarks/gpu_check.sh            # every part tiny, without a GPU
#
# CARRY (default .gpu-carry, made by benchmarks/gpu_prepare.sh where packages can be
# fetched): wheels, each unpacked into a private folder where this machine's Python
# lacks the package (no network, no pip needed), and a prebuilt libgpushare_alloc.so, used where
# there is no C compiler. Never set OUT on the lent machine: it names the folder whose
# files come back.
set -u
cd "$(dirname "$0")/.."
py=${PYTHON:-python3}
carry=${CARRY:-.gpu-carry}
site=""
for w in "$carry"/*.whl; do
    [ -f "$w" ] || continue
    name=$(basename "$w" | cut -d- -f1)  # msgspec, tomli_w, torch_memory_saver: import names
    if $py -c "import $name" 2>/dev/null; then
        continue  # this Python has it already
    fi
    if [ -z "$site" ]; then
        site=$(mktemp -d "${TMPDIR:-/tmp}/gpushare-site.XXXXXX")
    fi
    # A wheel is a zip: unpacked, it imports (no pip, no network).
    if ! $py -c 'import sys, zipfile; zipfile.ZipFile(sys.argv[2]).extractall(sys.argv[1])' "$site" "$w" \
        || ! PYTHONPATH="$site" $py -c "import $name"; then
        if [ "$name" = torch_memory_saver ]; then  # the anchor part's alone: it says so
            echo "gpu_check: $(basename "$w") does not import here: the tms part will say why" >&2
            continue
        fi
        echo "gpu_check: $(basename "$w") does not import in $($py -V 2>&1): make the carry folder for this Python's version (PYVER=... sh benchmarks/gpu_prepare.sh, docs/gpu-run.md)" >&2
        exit 1
    fi
done
if [ -z "${GPUSHARE_SHIM:-}" ] && [ -f "$carry/libgpushare_alloc.so" ] \
    && ! command -v cc >/dev/null 2>&1 && ! command -v gcc >/dev/null 2>&1; then
    GPUSHARE_SHIM="$(pwd)/$carry/libgpushare_alloc.so"
    export GPUSHARE_SHIM
fi
PYTHONPATH="${site:+$site:}$(pwd)/src${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONPATH PYTHONUNBUFFERED=1
if [ -n "${DRY:-}" ]; then
    exec $py benchmarks/gpu_check.py --dry "$@"
fi
exec $py benchmarks/gpu_check.py "$@"
