#!/bin/sh
# The GPU checks in one command, on a machine with an NVIDIA GPU and PyTorch built with
# CUDA: the CUDA tests (pytest -m gpu), then the GPU benchmark (benchmarks/gpu_swap.py).
#
#   sh benchmarks/gpu_check.sh            # results in ./gpu-results/
#   OUT=dir WHEELS=dir sh benchmarks/gpu_check.sh
#
# WHEELS: a folder of wheels to use where nothing can be fetched (msgspec, tomli-w,
# torch-memory-saver, and any of pytest, hypothesis, nvidia-ml-py the machine lacks).
set -u
cd "$(dirname "$0")/.."
out=${OUT:-gpu-results}
mkdir -p "$out"
py=${PYTHON:-python3}
if [ -n "${WHEELS:-}" ]; then
    $py -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/gpushare-site "$WHEELS"/*.whl || exit 1
    PYTHONPATH=/tmp/gpushare-site:src
else
    PYTHONPATH=src
fi
export PYTHONPATH PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$out/gpu.txt"
$py -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda)' | tee -a "$out/gpu.txt"
$py -m pytest -m gpu -q -p no:cacheprovider -rs tests/swap/test_torch.py 2>&1 | tee "$out/gpu_tests.txt"
$py benchmarks/gpu_swap.py --json "$out/gpu_swap.json" 2>&1 | tee "$out/gpu_swap.txt"
