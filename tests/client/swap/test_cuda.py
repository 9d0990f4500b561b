"""The ctypes driver layer (``swap/cuda.py``) against a libcuda built here from
``fake_libcuda.c``: cuda.h's signatures and structures over host memory, so the calls,
their arguments and the structures' layout are checked for real, without a GPU."""

from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from gpushare.client.swap.cuda import CudaDriver, CudaError
from gpushare.client.swap.vmm import VmmBackend
from gpushare.errors import SwapError

MiB = 2**20
SRC = Path(__file__).with_name("fake_libcuda.c")


@pytest.fixture(scope="module")
def libcuda(tmp_path_factory: pytest.TempPathFactory) -> str:
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler here to build the fake libcuda")
    out = tmp_path_factory.mktemp("cuda") / "libfakecuda.so"
    subprocess.run([cc, "-shared", "-fPIC", "-O1", "-o", str(out), str(SRC)], check=True)
    return str(out)


def perms(va: int) -> str:
    """The permissions of the mapping holding ``va`` in this process ('---p': none)."""
    for line in Path("/proc/self/maps").read_text().splitlines():
        span, mode = line.split()[:2]
        lo, hi = (int(x, 16) for x in span.split("-"))
        if lo <= va < hi:
            return mode
    return ""


def test_swaps_through_the_driver_keep_addresses_and_bytes(libcuda):
    d = CudaDriver(0, lib=libcuda)
    b = VmmBackend(d, 64 * MiB, piece_bytes=4 * MiB, host_bytes=16 * MiB)
    assert b.wait_for_host_buffers(10) and b.host.pinned_bytes == 16 * MiB
    n = 10 * MiB + 5
    va = b.allocate(n)
    assert b.resident_bytes == 12 * MiB  # whole granules of 2 MiB, in pieces of 4 MiB
    data = os.urandom(n)
    ctypes.memmove(va, data, n)
    assert perms(va).startswith("rw")
    r = b.swap_out(b.resident_bytes)
    assert r.bytes == 12 * MiB and b.swapped_bytes == 12 * MiB
    assert perms(va) == "---p" and perms(va + n - 1) == "---p"  # really gone from there
    b.swap_in()
    assert perms(va).startswith("rw")
    assert ctypes.string_at(va, n) == data  # same address, same bytes
    b.free(va)
    assert b.resident_bytes == b.swapped_bytes == 0
    b.close()


def test_driver_errors_name_the_call_and_keep_the_session(libcuda, monkeypatch):
    with pytest.raises(CudaError, match=r"cuDeviceGet failed: invalid argument \(CUDA error 1\)"):
        CudaDriver(3, lib=libcuda)
    d = CudaDriver(0, lib=libcuda)
    b = VmmBackend(d, 64 * MiB, piece_bytes=4 * MiB, host_bytes=16 * MiB)
    b.wait_for_host_buffers(10)
    va = b.allocate(16 * MiB)
    data = os.urandom(16 * MiB)
    ctypes.memmove(va, data, len(data))
    b.swap_out(16 * MiB)
    created = ctypes.CDLL(libcuda).fake_cuda_created
    created.restype = ctypes.c_size_t
    monkeypatch.setenv("FAKE_CUDA_CAPACITY", str(created() + 8 * MiB))  # the GPU filled up
    with pytest.raises(SwapError, match="cuMemCreate failed: out of memory"):
        b.swap_in()
    assert (b.resident_bytes, b.swapped_bytes) == (8 * MiB, 8 * MiB)
    monkeypatch.delenv("FAKE_CUDA_CAPACITY")
    b.swap_in()
    assert ctypes.string_at(va, len(data)) == data
    b.close()


def test_a_missing_driver_is_a_clear_error():
    with pytest.raises(SwapError, match="cannot load the CUDA driver"):
        CudaDriver(0, lib="libcuda-that-is-not-here.so.1")
