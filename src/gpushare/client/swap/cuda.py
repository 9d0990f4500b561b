"""The CUDA driver calls the ``torch`` swap backend needs, through ctypes.

Virtual memory management (``cuMemAddressReserve``, ``cuMemCreate``, ``cuMemMap``...)
lets a session keep its addresses while the physical memory behind them leaves the GPU:
swap-out copies a piece to pinned host memory and releases its physical handle; swap-in
creates a new one and maps it at the same address. ctypes on ``libcuda.so.1`` (already
loaded by PyTorch) keeps this free of any extra dependency; the calls are few, each
on a piece of 256 MiB or so, so their Python overhead does not count.

:class:`Driver` is the interface the backend uses; :class:`CudaDriver` implements it on
the real driver. Tests use a fake with the same methods over host memory.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
from collections.abc import Callable, Iterator
from typing import Protocol

from gpushare.errors import SwapError

_CU_MEM_ALLOCATION_TYPE_PINNED = 1
_CU_MEM_LOCATION_TYPE_DEVICE = 1
_CU_MEM_ACCESS_FLAGS_PROT_READWRITE = 3
_CU_MEM_ALLOC_GRANULARITY_RECOMMENDED = 1
_CU_STREAM_NON_BLOCKING = 1
_CU_EVENT_DISABLE_TIMING = 2
_CUDA_ERROR_OUT_OF_MEMORY = 2


class Driver(Protocol):
    """What the VMM swap backend asks of a GPU. Addresses and handles are ints."""

    def context(self) -> contextlib.AbstractContextManager[None]: ...
    def granularity(self) -> int: ...
    def reserve(self, size: int) -> int: ...
    def unreserve(self, va: int, size: int) -> None: ...
    def create(self, size: int) -> int: ...
    def release(self, handle: int) -> None: ...
    def map(self, va: int, size: int, handle: int) -> None: ...
    def unmap(self, va: int, size: int) -> None: ...
    def host_alloc(self, size: int) -> int: ...
    def host_free(self, ptr: int) -> None: ...
    def new_stream(self) -> int: ...
    def new_event(self) -> int: ...
    def destroy_stream(self, stream: int) -> None: ...
    def destroy_event(self, event: int) -> None: ...
    def copy_dtoh(self, dst: int, src: int, size: int, stream: int) -> None: ...
    def copy_htod(self, dst: int, src: int, size: int, stream: int) -> None: ...
    def zero(self, dst: int, size: int, stream: int) -> None: ...
    def record(self, event: int, stream: int) -> None: ...
    def wait(self, event: int) -> None: ...
    def sync_stream(self, stream: int) -> None: ...
    def synchronize(self) -> None: ...
    def close(self) -> None: ...


class CudaError(SwapError):
    def __init__(self, call: str, code: int, text: str) -> None:
        super().__init__(f"{call} failed: {text} (CUDA error {code})")
        self.code = code

    @property
    def out_of_memory(self) -> bool:
        return self.code == _CUDA_ERROR_OUT_OF_MEMORY


class _Location(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class _AllocFlags(ctypes.Structure):
    _fields_ = [
        ("compressionType", ctypes.c_ubyte),
        ("gpuDirectRDMACapable", ctypes.c_ubyte),
        ("usage", ctypes.c_ushort),
        ("reserved", ctypes.c_ubyte * 4),
    ]


class _AllocationProp(ctypes.Structure):
    _fields_ = [
        ("type", ctypes.c_int),
        ("requestedHandleTypes", ctypes.c_int),
        ("location", _Location),
        ("win32HandleMetaData", ctypes.c_void_p),
        ("allocFlags", _AllocFlags),
    ]


class _AccessDesc(ctypes.Structure):
    _fields_ = [("location", _Location), ("flags", ctypes.c_int)]


_u64 = ctypes.c_uint64
_size = ctypes.c_size_t
_ptr = ctypes.c_void_p


class CudaDriver:
    """The real driver, for one device (its primary context, which PyTorch uses)."""

    def __init__(self, device: int, lib: str = "libcuda.so.1") -> None:
        try:
            self._cu = ctypes.CDLL(lib)
        except OSError as e:
            raise SwapError(
                f"cannot load the CUDA driver ({lib}: {e}): the torch backend needs an NVIDIA"
                " driver; on a machine without a GPU the node runs simulated GPUs"
            ) from None
        self._sig()
        self._check("cuInit", self._cu.cuInit(0))
        dev = ctypes.c_int()
        self._check("cuDeviceGet", self._cu.cuDeviceGet(ctypes.byref(dev), device))
        ctx = ctypes.c_void_p()
        self._check(
            "cuDevicePrimaryCtxRetain", self._cu.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev)
        )
        self._ctx = ctx
        self._dev = dev
        try:
            self._set_up(device, dev)
        except BaseException:  # the hold just taken given back: nothing will close it
            self._cu.cuDevicePrimaryCtxRelease_v2(dev)
            raise

    def _set_up(self, device: int, dev: ctypes.c_int) -> None:
        """What the driver needs besides the context: the allocation's properties, the
        devices granted access, the granularity."""
        self._prop = _AllocationProp()
        self._prop.type = _CU_MEM_ALLOCATION_TYPE_PINNED
        self._prop.location = _Location(_CU_MEM_LOCATION_TYPE_DEVICE, device)
        # Mapped memory is readable and writable by this device and by every other that
        # can reach it as a peer, as PyTorch's own expandable segments grant: without it
        # a kernel of another GPU of the process (a peer copy, NCCL's P2P) faults on it.
        self.access_devices = [device, *self._peers(device, dev)]
        descs = [
            _AccessDesc(
                _Location(_CU_MEM_LOCATION_TYPE_DEVICE, d), _CU_MEM_ACCESS_FLAGS_PROT_READWRITE
            )
            for d in self.access_devices
        ]
        self._access = (_AccessDesc * len(descs))(*descs)
        self._closed = False
        with self.context():
            self._granularity = self._query_granularity()

    def _sig(self) -> None:
        cu = self._cu
        for name, args in {
            "cuInit": [ctypes.c_uint],
            "cuDeviceGet": [ctypes.POINTER(ctypes.c_int), ctypes.c_int],
            "cuDevicePrimaryCtxRetain": [ctypes.POINTER(ctypes.c_void_p), ctypes.c_int],
            "cuDevicePrimaryCtxRelease_v2": [ctypes.c_int],
            "cuDeviceGetCount": [ctypes.POINTER(ctypes.c_int)],
            "cuDeviceCanAccessPeer": [ctypes.POINTER(ctypes.c_int), ctypes.c_int, ctypes.c_int],
            "cuStreamDestroy_v2": [_ptr],
            "cuCtxGetCurrent": [ctypes.POINTER(_ptr)],
            "cuCtxPushCurrent_v2": [_ptr],
            "cuCtxPopCurrent_v2": [ctypes.POINTER(_ptr)],
            "cuCtxSynchronize": [],
            "cuMemGetAllocationGranularity": [
                ctypes.POINTER(_size),
                ctypes.POINTER(_AllocationProp),
                ctypes.c_int,
            ],
            "cuMemAddressReserve": [ctypes.POINTER(_u64), _size, _size, _u64, _u64],
            "cuMemAddressFree": [_u64, _size],
            "cuMemCreate": [ctypes.POINTER(_u64), _size, ctypes.POINTER(_AllocationProp), _u64],
            "cuMemRelease": [_u64],
            "cuMemMap": [_u64, _size, _size, _u64, _u64],
            "cuMemUnmap": [_u64, _size],
            "cuMemSetAccess": [_u64, _size, ctypes.POINTER(_AccessDesc), _size],
            "cuMemRetainAllocationHandle": [ctypes.POINTER(_u64), _ptr],
            "cuMemHostAlloc": [ctypes.POINTER(_ptr), _size, ctypes.c_uint],
            "cuMemFreeHost": [_ptr],
            "cuStreamCreate": [ctypes.POINTER(_ptr), ctypes.c_uint],
            "cuMemcpyDtoHAsync_v2": [_ptr, _u64, _size, _ptr],
            "cuMemcpyHtoDAsync_v2": [_u64, _ptr, _size, _ptr],
            "cuMemsetD8Async": [_u64, ctypes.c_ubyte, _size, _ptr],
            "cuEventCreate": [ctypes.POINTER(_ptr), ctypes.c_uint],
            "cuEventRecord": [_ptr, _ptr],
            "cuEventSynchronize": [_ptr],
            "cuStreamSynchronize": [_ptr],
            "cuEventDestroy_v2": [_ptr],
            "cuGetErrorString": [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)],
        }.items():
            fn = getattr(cu, name)
            fn.argtypes = args
            fn.restype = ctypes.c_int

    def _peers(self, ordinal: int, dev: ctypes.c_int) -> list[int]:
        """The other devices that can access this one's memory as peers."""
        n = ctypes.c_int()
        self._check("cuDeviceGetCount", self._cu.cuDeviceGetCount(ctypes.byref(n)))
        out = []
        for i in range(n.value):
            if i == ordinal:
                continue
            other, can = ctypes.c_int(), ctypes.c_int()
            self._check("cuDeviceGet", self._cu.cuDeviceGet(ctypes.byref(other), i))
            rc = self._cu.cuDeviceCanAccessPeer(ctypes.byref(can), other, dev)
            self._check("cuDeviceCanAccessPeer", rc)
            if can.value:
                out.append(i)
        return out

    def _check(self, call: str, rc: int) -> None:
        if rc:
            s = ctypes.c_char_p()
            self._cu.cuGetErrorString(rc, ctypes.byref(s))
            raise CudaError(call, rc, (s.value or b"unknown error").decode())

    @contextlib.contextmanager
    def context(self) -> Iterator[None]:
        """This device's primary context current on this thread while inside: pushed when
        another is current, and popped after, so that a workload's own current context
        is never switched under it."""
        cur = _ptr()
        self._check("cuCtxGetCurrent", self._cu.cuCtxGetCurrent(ctypes.byref(cur)))
        if cur.value == self._ctx.value:
            yield
            return
        self._check("cuCtxPushCurrent", self._cu.cuCtxPushCurrent_v2(self._ctx))
        try:
            yield
        finally:
            self._cu.cuCtxPopCurrent_v2(ctypes.byref(cur))

    def _query_granularity(self) -> int:
        g = _size()
        self._check(
            "cuMemGetAllocationGranularity",
            self._cu.cuMemGetAllocationGranularity(
                ctypes.byref(g), ctypes.byref(self._prop), _CU_MEM_ALLOC_GRANULARITY_RECOMMENDED
            ),
        )
        return int(g.value)

    def granularity(self) -> int:
        return self._granularity  # asked once: every reservation needs it

    def reserve(self, size: int) -> int:
        va = _u64()
        self._check(
            "cuMemAddressReserve",
            self._cu.cuMemAddressReserve(ctypes.byref(va), size, self._granularity, 0, 0),
        )
        return int(va.value)

    def unreserve(self, va: int, size: int) -> None:
        self._check("cuMemAddressFree", self._cu.cuMemAddressFree(va, size))

    def create(self, size: int) -> int:
        h = _u64()
        self._check(
            "cuMemCreate", self._cu.cuMemCreate(ctypes.byref(h), size, ctypes.byref(self._prop), 0)
        )
        return int(h.value)

    def release(self, handle: int) -> None:
        self._check("cuMemRelease", self._cu.cuMemRelease(handle))

    def map(self, va: int, size: int, handle: int) -> None:
        """``handle`` mapped at ``va`` and accessible, or, on an error, nothing mapped
        there (the caller still owns ``handle``): a range left mapped behind a failed
        grant would make every later map there fail."""
        self._check("cuMemMap", self._cu.cuMemMap(va, size, 0, handle, 0))
        rc = self._cu.cuMemSetAccess(va, size, self._access, len(self._access))
        if rc:
            self._cu.cuMemUnmap(va, size)
            self._check("cuMemSetAccess", rc)

    def unmap(self, va: int, size: int) -> None:
        self._check("cuMemUnmap", self._cu.cuMemUnmap(va, size))

    def mapped(self, va: int) -> bool:
        """Whether memory is mapped at ``va`` now (another allocator's, say: vLLM's,
        after one of its calls failed part way)."""
        h = _u64()
        with self.context():
            if self._cu.cuMemRetainAllocationHandle(ctypes.byref(h), va):
                return False
            self._cu.cuMemRelease(h)  # the reference just taken
        return True

    def host_alloc(self, size: int) -> int:
        p = _ptr()
        self._check("cuMemHostAlloc", self._cu.cuMemHostAlloc(ctypes.byref(p), size, 0))
        return int(p.value or 0)

    def host_free(self, ptr: int) -> None:
        self._check("cuMemFreeHost", self._cu.cuMemFreeHost(ptr))

    def new_stream(self) -> int:
        s = _ptr()
        self._check(
            "cuStreamCreate", self._cu.cuStreamCreate(ctypes.byref(s), _CU_STREAM_NON_BLOCKING)
        )
        return int(s.value or 0)

    def copy_dtoh(self, dst: int, src: int, size: int, stream: int) -> None:
        self._check("cuMemcpyDtoHAsync", self._cu.cuMemcpyDtoHAsync_v2(dst, src, size, stream))

    def copy_htod(self, dst: int, src: int, size: int, stream: int) -> None:
        self._check("cuMemcpyHtoDAsync", self._cu.cuMemcpyHtoDAsync_v2(dst, src, size, stream))

    def zero(self, dst: int, size: int, stream: int) -> None:
        """Zeros over ``size`` bytes at ``dst``, queued on ``stream`` (new physical memory
        holds whatever was there before)."""
        self._check("cuMemsetD8Async", self._cu.cuMemsetD8Async(dst, 0, size, stream))

    def new_event(self) -> int:
        e = _ptr()
        self._check(
            "cuEventCreate", self._cu.cuEventCreate(ctypes.byref(e), _CU_EVENT_DISABLE_TIMING)
        )
        return int(e.value or 0)

    def destroy_stream(self, stream: int) -> None:
        self._check("cuStreamDestroy", self._cu.cuStreamDestroy_v2(stream))

    def destroy_event(self, event: int) -> None:
        self._check("cuEventDestroy", self._cu.cuEventDestroy_v2(event))

    def close(self) -> None:
        """Give back this driver's hold on the primary context (once): the context goes
        when its last holder, PyTorch's included, lets it go."""
        if not self._closed:
            self._closed = True
            rc = self._cu.cuDevicePrimaryCtxRelease_v2(self._dev)
            self._check("cuDevicePrimaryCtxRelease", rc)

    def record(self, event: int, stream: int) -> None:
        self._check("cuEventRecord", self._cu.cuEventRecord(event, stream))

    def wait(self, event: int) -> None:
        self._check("cuEventSynchronize", self._cu.cuEventSynchronize(event))

    def sync_stream(self, stream: int) -> None:
        self._check("cuStreamSynchronize", self._cu.cuStreamSynchronize(stream))

    def synchronize(self) -> None:
        self._check("cuCtxSynchronize", self._cu.cuCtxSynchronize())


def self_test(driver: Driver) -> None:
    """A small swap on the driver before any of a workload's memory depends on it:
    reserve a range, map two pieces, write it and read it back, unmap and release them,
    map new ones at the same address, write the host copy back, read and compare.
    Raises :class:`SwapError` naming what failed; leaves nothing behind."""
    test = _SelfTest(driver)
    try:
        with driver.context():
            try:
                test.run()
            finally:
                test.give_back()
    except SwapError as e:
        raise SwapError(
            f"gpushare's self-test of CUDA virtual memory failed ({e}); no memory of this"
            " workload was touched: check the NVIDIA driver (virtual memory management,"
            " CUDA >= 11.2), or run the workload without gpushare"
        ) from None


class _SelfTest:
    """The self-test's steps, and what it has made so far (for :func:`_give_back`)."""

    def __init__(self, driver: Driver) -> None:
        self.driver = driver
        self.g = driver.granularity()
        self.size = 2 * self.g
        self.pattern = os.urandom(self.size)
        self.mapped: list[tuple[int, int]] = []  # (va, handle)
        self.unreleased: list[int] = []  # handles unmapped, not yet released
        self.host: list[int] = []
        self.made = {"va": 0, "stream": 0, "event": 0}

    def run(self) -> None:
        """Make what the test needs, then swap the pattern out and in, comparing."""
        driver, size, host = self.driver, self.size, self.host
        self.made["va"] = driver.reserve(size)
        self.made["stream"] = driver.new_stream()
        self.made["event"] = driver.new_event()
        host.append(driver.host_alloc(size))
        host.append(driver.host_alloc(size))
        self.back()
        ctypes.memmove(host[0], self.pattern, size)
        self.copy(False, host[0])
        if self.copy(True, host[1]) != self.pattern:
            raise SwapError("the bytes read back differ from those written")
        self.out()
        self.back()  # a swap-in, at the same address
        ctypes.memset(host[0], 0, size)
        self.copy(False, host[1])
        if self.copy(True, host[0]) != self.pattern:
            raise SwapError("the bytes differ after unmapping and mapping again")

    def back(self) -> None:
        """New physical memory under the whole range."""
        g, va = self.g, self.made["va"]
        for off in (0, g):
            h = self.driver.create(g)
            try:
                self.driver.map(va + off, g, h)  # on an error: nothing mapped
            except BaseException:
                self.unreleased.append(h)
                raise
            self.mapped.append((va + off, h))

    def copy(self, to_host: bool, buf: int) -> bytes:
        """The range copied to or from host buffer ``buf``, waited for; the buffer's bytes."""
        driver, made = self.driver, self.made
        if to_host:
            driver.copy_dtoh(buf, made["va"], self.size, made["stream"])
        else:
            driver.copy_htod(made["va"], buf, self.size, made["stream"])
        driver.record(made["event"], made["stream"])
        driver.wait(made["event"])
        return ctypes.string_at(buf, self.size)

    def out(self) -> None:
        """A swap-out: each piece unmapped, then released."""
        while self.mapped:
            v, h = self.mapped[-1]
            self.driver.unmap(v, self.g)
            self.mapped.pop()
            self.unreleased.append(h)
            self.driver.release(h)
            self.unreleased.remove(h)

    def give_back(self) -> None:
        _give_back(
            self.driver, self.made, self.mapped, self.unreleased, self.host, self.size, self.g
        )


def _give_back(
    driver: Driver,
    made: dict[str, int],
    mapped: list[tuple[int, int]],
    unreleased: list[int],
    host: list[int],
    size: int,
    g: int,
) -> None:
    """What the self-test made, back to the driver: once its copies are done (else
    nothing they touch goes), each call on its own, a failed one tried once more (a
    driver busy for a moment leaks nothing)."""
    stream = made["stream"]
    if stream and not (_quietly(driver.sync_stream, stream) or _quietly(driver.synchronize)):
        return  # a copy may still run: its memory stays, as safer than a fault
    for _ in range(2):
        for v, h in list(mapped):
            if _quietly(driver.unmap, v, g):
                mapped.remove((v, h))
                unreleased.append(h)
        for h in list(unreleased):
            if _quietly(driver.release, h):
                unreleased.remove(h)
        if made["va"] and not mapped and _quietly(driver.unreserve, made["va"], size):
            made["va"] = 0
        _free_host_and_stream(driver, made, host)


def _free_host_and_stream(driver: Driver, made: dict[str, int], host: list[int]) -> None:
    for buf in list(host):
        if _quietly(driver.host_free, buf):
            host.remove(buf)
    for what, fn in (("event", driver.destroy_event), ("stream", driver.destroy_stream)):
        if made[what] and _quietly(fn, made[what]):
            made[what] = 0


def _quietly(fn: Callable[..., None], *args: int) -> bool:
    """``fn(*args)``; whether it did not fail."""
    try:
        fn(*args)
    except SwapError:
        return False
    return True


def give_back(fn: Callable[..., None], *args: int) -> bool:
    """A call giving something back to the driver (a destroy, a free), tried once more
    if it fails (a driver busy for a moment leaks nothing); whether it was done."""
    return _quietly(fn, *args) or _quietly(fn, *args)
