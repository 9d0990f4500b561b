"""A probe of the fake libcuda against cuda.h's signatures: each call CUDA's documentation
says CUDA refuses, refused with CUDA's code; what CUDA defers (released memory still
mapped, queued copies) deferred. Nothing of gpushare's is used here, so that a leniency
of the fake that would let one of gpushare's tests pass where a GPU fails it shows
here first."""

from __future__ import annotations

import ctypes
import subprocess
import sys
import textwrap

import pytest

from .conftest import GRANULE, FakeGpu

SUCCESS, INVALID_VALUE, OUT_OF_MEMORY = 0, 1, 2
INVALID_HANDLE, NOT_READY, ILLEGAL_ADDRESS = 400, 600, 700
GRANULARITY_MINIMUM, GRANULARITY_RECOMMENDED = 0, 1

u64, size_t, vp = ctypes.c_uint64, ctypes.c_size_t, ctypes.c_void_p


class Location(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class AllocFlags(ctypes.Structure):
    _fields_ = [
        ("compressionType", ctypes.c_ubyte),
        ("gpuDirectRDMACapable", ctypes.c_ubyte),
        ("usage", ctypes.c_ushort),
        ("reserved", ctypes.c_ubyte * 4),
    ]


class Prop(ctypes.Structure):
    _fields_ = [
        ("type", ctypes.c_int),
        ("requestedHandleTypes", ctypes.c_int),
        ("location", Location),
        ("win32HandleMetaData", vp),
        ("allocFlags", AllocFlags),
    ]


class AccessDesc(ctypes.Structure):
    _fields_ = [("location", Location), ("flags", ctypes.c_int)]


SIGNATURES = {
    "cuInit": [ctypes.c_uint],
    "cuDevicePrimaryCtxRetain": [ctypes.POINTER(vp), ctypes.c_int],
    "cuCtxPushCurrent_v2": [vp],
    "cuMemGetAllocationGranularity": [ctypes.POINTER(size_t), ctypes.POINTER(Prop), ctypes.c_int],
    "cuMemAddressReserve": [ctypes.POINTER(u64), size_t, size_t, u64, ctypes.c_ulonglong],
    "cuMemAddressFree": [u64, size_t],
    "cuMemCreate": [ctypes.POINTER(u64), size_t, ctypes.POINTER(Prop), ctypes.c_ulonglong],
    "cuMemRelease": [u64],
    "cuMemMap": [u64, size_t, size_t, u64, ctypes.c_ulonglong],
    "cuMemUnmap": [u64, size_t],
    "cuMemSetAccess": [u64, size_t, ctypes.POINTER(AccessDesc), size_t],
    "cuMemGetInfo_v2": [ctypes.POINTER(size_t), ctypes.POINTER(size_t)],
    "cuMemcpyDtoH_v2": [vp, u64, size_t],
    "cuMemcpyHtoD_v2": [u64, vp, size_t],
    "cuStreamCreate": [ctypes.POINTER(vp), ctypes.c_uint],
    "cuStreamSynchronize": [vp],
    "cuStreamDestroy_v2": [vp],
    "cuMemcpyHtoDAsync_v2": [u64, vp, size_t, vp],
    "cuMemcpyDtoHAsync_v2": [vp, u64, size_t, vp],
    "cuMemHostAlloc": [ctypes.POINTER(vp), size_t, ctypes.c_uint],
    "cuMemFreeHost": [vp],
    "cuMemsetD8Async": [u64, ctypes.c_ubyte, size_t, vp],
    "cuEventCreate": [ctypes.POINTER(vp), ctypes.c_uint],
    "cuEventRecord": [vp, vp],
    "cuEventQuery": [vp],
    "cuEventSynchronize": [vp],
    "cuCtxSynchronize": [],
}


class Cuda:
    """cuda.h's calls on a library, a context current on this thread."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self.lib = lib
        for name, args in SIGNATURES.items():
            try:
                fn = getattr(lib, name)
            except AttributeError:  # a test calling it fails, not every test
                continue
            fn.argtypes, fn.restype = args, ctypes.c_int
        assert lib.cuInit(0) == SUCCESS
        ctx = vp()
        assert lib.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), 0) == SUCCESS
        assert lib.cuCtxPushCurrent_v2(ctx) == SUCCESS
        self.prop = Prop(type=1, location=Location(1, 0))  # pinned, on device 0
        self.g = self.granularity(GRANULARITY_RECOMMENDED)
        self.rw = (AccessDesc * 1)(AccessDesc(Location(1, 0), 3))

    def granularity(self, option: int) -> int:
        g = size_t()
        rc = self.lib.cuMemGetAllocationGranularity(
            ctypes.byref(g), ctypes.byref(self.prop), option
        )
        assert rc == SUCCESS
        return g.value

    def reserve(self, size: int, align: int | None = None) -> int:
        align = self.g if align is None else align
        va = u64()
        assert self.lib.cuMemAddressReserve(ctypes.byref(va), size, align, 0, 0) == SUCCESS
        return va.value

    def create(self, size: int) -> tuple[int, int]:
        h = u64()
        return self.lib.cuMemCreate(ctypes.byref(h), size, ctypes.byref(self.prop), 0), h.value

    def map(self, va: int, size: int, h: int) -> int:
        return int(self.lib.cuMemMap(va, size, 0, h, 0))

    def access(self, va: int, size: int) -> int:
        return int(self.lib.cuMemSetAccess(va, size, self.rw, 1))

    def free_bytes(self) -> int:
        free, total = size_t(), size_t()
        assert self.lib.cuMemGetInfo_v2(ctypes.byref(free), ctypes.byref(total)) == SUCCESS
        return free.value

    def read(self, va: int, n: int) -> bytes:
        buf = ctypes.create_string_buffer(n)
        assert self.lib.cuMemcpyDtoH_v2(buf, va, n) == SUCCESS
        return buf.raw

    def backed(self, size: int) -> tuple[int, int]:
        """A reserved range, mapped and accessible: (va, handle)."""
        va = self.reserve(size)
        rc, h = self.create(size)
        assert rc == SUCCESS and self.map(va, size, h) == SUCCESS
        assert self.access(va, size) == SUCCESS
        return va, h


@pytest.fixture
def cuda(gpu: FakeGpu) -> Cuda:
    return Cuda(gpu.cu)


def test_access_is_granted_only_on_a_range_wholly_mapped(cuda: Cuda):
    g = cuda.g
    va = cuda.reserve(2 * g)
    assert cuda.access(va, 2 * g) == INVALID_VALUE  # nothing mapped
    rc, h = cuda.create(g)
    assert rc == SUCCESS and cuda.map(va, g, h) == SUCCESS
    assert cuda.access(va, 2 * g) == INVALID_VALUE  # half of it mapped
    assert cuda.access(va, g) == SUCCESS


def test_a_map_needs_a_reserved_aligned_free_address(cuda: Cuda, gpu: FakeGpu):
    g = cuda.g
    rc, h = cuda.create(g)
    assert rc == SUCCESS
    outside = ctypes.cast(ctypes.create_string_buffer(3 * g), vp).value or 0
    assert cuda.map(-(-outside // g) * g, g, h) == INVALID_VALUE  # not reserved
    va = cuda.reserve(3 * g)
    assert cuda.map(va + 4096, g, h) == INVALID_VALUE  # not aligned to the granularity
    assert cuda.map(va + 2 * g + g, g, h) == INVALID_VALUE  # past the reservation's end
    assert cuda.map(va, g, h) == SUCCESS
    rc, h2 = cuda.create(g)
    assert cuda.map(va, g, h2) == INVALID_VALUE  # over a mapping
    assert cuda.lib.cuMemAddressFree(va, 3 * g) == INVALID_VALUE  # something still mapped
    assert cuda.lib.cuMemUnmap(va, g) == SUCCESS
    assert cuda.lib.cuMemAddressFree(va, 3 * g) == SUCCESS
    assert cuda.lib.cuMemRelease(h) == SUCCESS and cuda.lib.cuMemRelease(h2) == SUCCESS
    assert gpu.cu.fake_cuda_alive(b"handles") == 0


def test_released_memory_still_mapped_stays_until_its_last_unmap(cuda: Cuda, gpu: FakeGpu):
    g = cuda.g
    free0 = cuda.free_bytes()
    va, h = cuda.backed(g)
    ctypes.memset(va, 7, g)  # a kernel's write
    assert cuda.lib.cuMemRelease(h) == SUCCESS
    assert cuda.free_bytes() == free0 - g  # still the GPU's: mapped
    assert cuda.read(va, g) == b"\x07" * g
    assert cuda.map(va, g, h) == INVALID_VALUE  # a released handle maps no more
    assert cuda.lib.cuMemUnmap(va, g) == SUCCESS
    assert cuda.free_bytes() == free0  # its last mapping went
    assert gpu.cu.fake_cuda_alive(b"handles") == 0


def test_memory_mapped_twice_stays_until_both_mappings_go(cuda: Cuda, gpu: FakeGpu):
    g = cuda.g
    free0 = cuda.free_bytes()
    va, vb = cuda.reserve(g), cuda.reserve(g)
    rc, h = cuda.create(g)
    assert rc == SUCCESS and cuda.map(va, g, h) == SUCCESS and cuda.map(vb, g, h) == SUCCESS
    assert cuda.access(va, g) == SUCCESS and cuda.access(vb, g) == SUCCESS
    ctypes.memset(va, 9, g)
    assert cuda.lib.cuMemRelease(h) == SUCCESS
    assert cuda.lib.cuMemUnmap(va, g) == SUCCESS
    assert cuda.free_bytes() == free0 - g  # one mapping left
    assert cuda.read(vb, g) == b"\x09" * g  # the same memory, through the other
    assert cuda.lib.cuMemUnmap(vb, g) == SUCCESS
    assert cuda.free_bytes() == free0 and gpu.cu.fake_cuda_alive(b"handles") == 0


def test_fresh_memory_is_not_zeros(cuda: Cuda):
    va, _ = cuda.backed(cuda.g)
    assert cuda.read(va, cuda.g) != bytes(cuda.g)


def test_queued_copies_land_only_once_synchronized(cuda: Cuda, gpu: FakeGpu):
    g = cuda.g
    va, _ = cuda.backed(g)
    ctypes.memset(va, 1, g)
    stream, event = vp(), vp()
    assert cuda.lib.cuStreamCreate(ctypes.byref(stream), 1) == SUCCESS
    assert cuda.lib.cuEventCreate(ctypes.byref(event), 2) == SUCCESS
    src = ctypes.create_string_buffer(b"\x02" * g, g)
    back = vp()
    assert cuda.lib.cuMemHostAlloc(ctypes.byref(back), g, 0) == SUCCESS  # pinned
    ctypes.memset(back, 0, g)
    gpu.cu.fake_cuda_hold(1)  # the stream's worker waits: as a busy GPU's copy engine
    try:
        assert cuda.lib.cuMemcpyHtoDAsync_v2(va, src, g, stream) == SUCCESS
        assert cuda.lib.cuMemsetD8Async(va, 3, 16, stream) == SUCCESS
        assert cuda.lib.cuMemcpyDtoHAsync_v2(back, va, g, stream) == SUCCESS
        assert cuda.lib.cuEventRecord(event, stream) == SUCCESS
        assert cuda.lib.cuEventQuery(event) == NOT_READY
        assert ctypes.string_at(va, 4) == b"\x01" * 4  # not there yet: nothing waited
        assert ctypes.string_at(back, 4) == bytes(4)  # nor the copy back
    finally:
        gpu.cu.fake_cuda_hold(0)
    assert cuda.lib.cuEventSynchronize(event) == SUCCESS
    assert cuda.lib.cuEventQuery(event) == SUCCESS
    got = ctypes.string_at(va, g)
    assert got == b"\x03" * 16 + b"\x02" * (g - 16)  # in stream order
    assert ctypes.string_at(back, g) == got  # the copy back after both
    assert cuda.lib.cuMemFreeHost(back) == SUCCESS
    assert cuda.lib.cuStreamDestroy_v2(stream) == SUCCESS
    assert cuda.lib.cuStreamSynchronize(stream) == INVALID_HANDLE


def test_a_queued_copy_into_memory_unmapped_meanwhile_is_an_illegal_address(
    cuda: Cuda, gpu: FakeGpu
):
    g = cuda.g
    va, _ = cuda.backed(g)
    stream = vp()
    assert cuda.lib.cuStreamCreate(ctypes.byref(stream), 1) == SUCCESS
    src = ctypes.create_string_buffer(g)
    gpu.cu.fake_cuda_hold(1)
    assert cuda.lib.cuMemcpyHtoDAsync_v2(va, src, g, stream) == SUCCESS
    assert cuda.lib.cuMemUnmap(va, g) == SUCCESS  # not waited for: a bug
    gpu.cu.fake_cuda_hold(0)
    assert cuda.lib.cuStreamSynchronize(stream) == ILLEGAL_ADDRESS
    assert cuda.lib.cuCtxSynchronize() == ILLEGAL_ADDRESS  # the context is lost for good
    assert gpu.cu.fake_cuda_alive(b"faults") == 1


TENANT = textwrap.dedent(
    """
    import ctypes, sys
    cu = ctypes.CDLL(sys.argv[1])
    cu.cuInit(0)
    ctx = ctypes.c_void_p()
    cu.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), 0)
    cu.cuCtxPushCurrent_v2(ctx)
    prop = (ctypes.c_int * 8)(1, 0, 1, 0, 0, 0, 0, 0)
    h = ctypes.c_uint64()
    rc = cu.cuMemCreate(ctypes.byref(h), ctypes.c_size_t(int(sys.argv[2])), prop,
                        ctypes.c_ulonglong(0))
    print(rc, flush=True)
    sys.stdin.read()
    """
)


def test_capacity_is_shared_with_every_process_on_the_gpu(
    cuda: Cuda, gpu: FakeGpu, monkeypatch: pytest.MonkeyPatch
):
    g = cuda.g
    monkeypatch.setenv("FAKE_CUDA_CAPACITY", str(4 * g))
    other = subprocess.Popen(
        [sys.executable, "-c", TENANT, str(gpu.libcuda), str(3 * g)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert other.stdout is not None and other.stdout.readline().strip() == "0"
        assert cuda.free_bytes() == g  # the other tenant holds three
        assert cuda.create(2 * g)[0] == OUT_OF_MEMORY
    finally:
        other.kill()
        other.wait()
    rc, _ = cuda.create(2 * g)  # its memory went with it
    assert rc == SUCCESS


def test_vllms_calls_are_accepted_as_cuda_accepts_them(cuda: Cuda):
    """vLLM's cumem allocator: the minimum granularity, a reservation aligned to 0 (the
    default), an access grant on the whole mapping."""
    g = cuda.granularity(GRANULARITY_MINIMUM)
    assert g == GRANULE
    va = cuda.reserve(2 * g, align=0)
    assert va % g == 0
    rc, h = cuda.create(2 * g)
    assert rc == SUCCESS and cuda.map(va, 2 * g, h) == SUCCESS
    assert cuda.access(va, 2 * g) == SUCCESS
    assert cuda.lib.cuMemAddressReserve(ctypes.byref(u64()), g, 3 * 4096, 0, 0) == INVALID_VALUE
