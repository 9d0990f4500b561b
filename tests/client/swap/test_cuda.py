"""The ctypes driver layer (``swap/cuda.py``) and the self-test at attach, against a
libcuda built here from ``fake_libcuda.c``: cuda.h's signatures and structures over host
memory, so the calls, their arguments and the structures' layout are checked for real,
without a GPU."""

from __future__ import annotations

import ctypes

import pytest

from gpushare.client.swap.cuda import CudaDriver, CudaError, self_test
from gpushare.errors import SwapError

from .conftest import FakeGpu


def test_driver_errors_name_the_call(gpu: FakeGpu):
    with pytest.raises(CudaError, match=r"cuDeviceGet failed: invalid argument \(CUDA error 1\)"):
        CudaDriver(3, lib=str(gpu.libcuda))


def test_a_missing_driver_is_a_clear_error():
    with pytest.raises(SwapError, match="cannot load the CUDA driver"):
        CudaDriver(0, lib="libcuda-that-is-not-here.so.1")


def test_the_granularity_is_asked_once(gpu: FakeGpu):
    d = gpu.driver
    with d.context():
        for _ in range(3):
            d.unreserve(d.reserve(4 * d.granularity()), 4 * d.granularity())
    assert gpu.calls("cuMemAddressReserve") == 3 and d.granularity() == 64 * 1024


def test_the_self_test_passes_and_leaves_nothing_behind(gpu: FakeGpu):
    self_test(gpu.driver)
    log = gpu.log()
    for call in ("cuMemAddressReserve", "cuMemMap", "cuMemUnmap", "cuMemAddressFree"):
        assert call in log
    assert log.count("cuMemCreate") == 4 and log.count("cuMemRelease") == 4  # remapped
    assert gpu.physical_bytes == 0 and gpu.cu.fake_cuda_pinned() == 0
    gpu.cu.fake_cuda_alive.argtypes = [ctypes.c_char_p]
    assert gpu.cu.fake_cuda_alive(b"streams") == gpu.cu.fake_cuda_alive(b"events") == 0


@pytest.mark.parametrize(
    ("call", "message"),
    [
        ("cuMemMap", "cuMemMap failed: unknown error"),
        ("cuMemcpyHtoDAsync_v2", "cuMemcpyHtoDAsync failed"),
        ("cuMemCreate", "cuMemCreate failed"),
    ],
)
def test_a_failing_driver_fails_the_self_test_clearly(gpu: FakeGpu, call, message):
    gpu.fail(call, 999, skip=2 if call == "cuMemCreate" else 0)  # cuMemCreate: at the remap
    with pytest.raises(SwapError, match=f"self-test of CUDA virtual memory failed.*{message}"):
        self_test(gpu.driver)
    assert gpu.physical_bytes == 0 and gpu.cu.fake_cuda_pinned() == 0


def test_a_driver_that_corrupts_copies_fails_the_self_test(gpu: FakeGpu, monkeypatch):
    monkeypatch.setenv("FAKE_CUDA_CORRUPT", "1")
    with pytest.raises(SwapError, match="bytes read back differ"):
        self_test(gpu.driver)


# Every call CudaDriver makes before it exists (two devices: a peer asked about).
SETUP_CALLS = [
    "cuInit",
    "cuDeviceGet",
    "cuDevicePrimaryCtxRetain",
    "cuDeviceGetCount",
    "cuDeviceCanAccessPeer",
    "cuCtxGetCurrent",
    "cuCtxPushCurrent_v2",
    "cuMemGetAllocationGranularity",
]


@pytest.mark.parametrize("call", SETUP_CALLS)
def test_a_driver_failing_at_setup_names_the_call_and_holds_no_context(
    gpu: FakeGpu, monkeypatch: pytest.MonkeyPatch, call: str
):
    monkeypatch.setenv("FAKE_CUDA_DEVICES", "2")
    before = gpu.calls(call)
    CudaDriver(0, lib=str(gpu.libcuda)).close()  # nothing failing: the calls it makes
    made = gpu.calls(call) - before
    assert made and gpu.alive("contexts") == 0
    for skip in range(made):  # each of its calls there
        gpu.fail(call, 999, skip)
        with pytest.raises(CudaError, match=f"{call.removesuffix('_v2')} failed"):
            CudaDriver(0, lib=str(gpu.libcuda))
        assert gpu.alive("contexts") == 0  # the primary context's hold given back
