"""vLLM's sleep-mode allocator as vLLM has it, making the driver calls vLLM makes.

vLLM's ``vllm/device_allocator/cumem.py`` (the ``CuMemAllocator`` singleton and its
``AllocationData``) over its C extension ``csrc/cumem_allocator.cpp``, which calls the
driver itself, past gpushare's wrapper; here :class:`CumemExtension` makes those calls
through ctypes on the same libcuda (the fake one, or a GPU's under ``pytest -m gpu``):

* ``my_malloc``: the context made current if none is (``cuCtxGetCurrent``, else
  ``cuDevicePrimaryCtxRetain`` and ``cuCtxSetCurrent``), the size aligned to the
  *minimum* granularity, ``cuMemAddressReserve`` with alignment 0, the handle kept in
  host memory of its own (the 4-tuple's last item is its address), the Python malloc
  callback told, then ``create_and_map``: ``cuMemCreate``, ``cuMemMap``,
  ``cuMemSetAccess`` for the device alone. On an error the address range is freed and
  nothing returned (what was created or mapped is not undone: vLLM's).
* ``unmap_and_release``: ``cuMemUnmap``, then ``cuMemRelease``; an error stops it and
  raises.
* ``sleep``: for each allocation, the offloaded tags' bytes copied to pinned host memory
  with a synchronous ``cudaMemcpy`` (``cuMemcpyDtoH_v2``), then ``unmap_and_release``
  whatever its tag; an error stops it where it is.
* ``wake_up``: ``create_and_map`` and, where a host copy is kept, a synchronous copy back
  (``cuMemcpyHtoD_v2``) and the copy let go; on an error, what this call mapped is
  unmapped and released again (errors of that rollback only logged) and the error
  raised.
* ``my_free``: the free callback (``torch.cuda.synchronize``: ``cuCtxSynchronize``),
  ``unmap_and_release``, ``cuMemAddressFree``.

vLLM needs CUDA, so its own allocator cannot run here; this follows its names and
behaviour, bytes and all, and copies none of its code."""

from __future__ import annotations

import contextlib
import ctypes
import types
from dataclasses import dataclass
from typing import Any

_u64, _size, _vp = ctypes.c_uint64, ctypes.c_size_t, ctypes.c_void_p
_GRANULARITY_MINIMUM = 0


class _Location(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class _Prop(ctypes.Structure):
    _fields_ = [
        ("type", ctypes.c_int),
        ("requestedHandleTypes", ctypes.c_int),
        ("location", _Location),
        ("win32HandleMetaData", _vp),
        ("compressionType", ctypes.c_ubyte),
        ("gpuDirectRDMACapable", ctypes.c_ubyte),
        ("usage", ctypes.c_ushort),
        ("reserved", ctypes.c_ubyte * 4),
    ]


class _AccessDesc(ctypes.Structure):
    _fields_ = [("location", _Location), ("flags", ctypes.c_int)]


class CudaError(RuntimeError):
    """What vLLM's extension raises: ``RuntimeError('CUDA Error: ...')``."""


@dataclass
class HostCopy:
    """What vLLM's ``cpu_backup_tensor`` holds: a pinned host copy of an allocation."""

    ptr: int
    size: int


@dataclass
class AllocationData:
    handle: tuple[int, int, int, int]  # (device, size, address, address of the handle)
    tag: str
    cpu_backup_tensor: Any = None


class CumemExtension:
    """vLLM's C extension, its driver calls through ctypes."""

    def __init__(self, lib: str, device: int = 0) -> None:
        cu = self.cu = ctypes.CDLL(lib)
        for name, args in {
            "cuInit": [ctypes.c_uint],
            "cuCtxGetCurrent": [ctypes.POINTER(_vp)],
            "cuCtxSetCurrent": [_vp],
            "cuCtxSynchronize": [],
            "cuDevicePrimaryCtxRetain": [ctypes.POINTER(_vp), ctypes.c_int],
            "cuMemGetAllocationGranularity": [
                ctypes.POINTER(_size),
                ctypes.POINTER(_Prop),
                ctypes.c_int,
            ],
            "cuMemAddressReserve": [ctypes.POINTER(_u64), _size, _size, _u64, _u64],
            "cuMemAddressFree": [_u64, _size],
            "cuMemCreate": [ctypes.POINTER(_u64), _size, ctypes.POINTER(_Prop), _u64],
            "cuMemMap": [_u64, _size, _size, _u64, _u64],
            "cuMemSetAccess": [_u64, _size, ctypes.POINTER(_AccessDesc), _size],
            "cuMemUnmap": [_u64, _size],
            "cuMemRelease": [_u64],
            "cuMemHostAlloc": [ctypes.POINTER(_vp), _size, ctypes.c_uint],
            "cuMemFreeHost": [_vp],
            "cuMemcpyDtoH_v2": [_vp, _u64, _size],
            "cuMemcpyHtoD_v2": [_u64, _vp, _size],
            "cuGetErrorString": [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)],
        }.items():
            fn = getattr(cu, name)
            fn.argtypes, fn.restype = args, ctypes.c_int
        self.device = device
        self._check("cuInit", cu.cuInit(0))
        self.prop = _Prop(type=1, location=_Location(1, device))  # pinned, on the device
        self.access = (_AccessDesc * 1)(_AccessDesc(_Location(1, device), 3))  # read-write
        self._handles: dict[int, Any] = {}  # where each handle is kept, by that address
        self._pinned_cache: dict[int, list[int]] = {}

    def _check(self, call: str, rc: int) -> None:
        if rc:
            s = ctypes.c_char_p()
            self.cu.cuGetErrorString(rc, ctypes.byref(s))
            text = (s.value or b"unknown error").decode()
            raise CudaError(f"CUDA Error: {text} at {call}")

    def ensure_context(self) -> None:
        cur = _vp()
        self._check("cuCtxGetCurrent", self.cu.cuCtxGetCurrent(ctypes.byref(cur)))
        if not cur.value:
            self._check(
                "cuDevicePrimaryCtxRetain",
                self.cu.cuDevicePrimaryCtxRetain(ctypes.byref(cur), self.device),
            )
            self._check("cuCtxSetCurrent", self.cu.cuCtxSetCurrent(cur))

    def my_malloc(self, size: int, malloc_callback: Any) -> int:
        """The address of new memory, or 0 (PyTorch then raises out of memory)."""
        try:
            self.ensure_context()
            g = _size()
            self._check(
                "cuMemGetAllocationGranularity",
                self.cu.cuMemGetAllocationGranularity(
                    ctypes.byref(g), ctypes.byref(self.prop), _GRANULARITY_MINIMUM
                ),
            )
            aligned = -(-size // g.value) * g.value
            va = _u64()
            self._check(
                "cuMemAddressReserve",
                self.cu.cuMemAddressReserve(ctypes.byref(va), aligned, 0, 0, 0),
            )
        except CudaError:
            return 0
        cell = _u64()  # vLLM's malloc'd CUmemGenericAllocationHandle
        self._handles[ctypes.addressof(cell)] = cell
        handle = (self.device, aligned, int(va.value), ctypes.addressof(cell))
        malloc_callback(handle)
        try:
            self.create_and_map(handle)
        except CudaError:
            self.cu.cuMemAddressFree(va.value, aligned)  # as vLLM: nothing else undone
            del self._handles[handle[3]]
            return 0
        return int(va.value)

    def my_free(self, handle: tuple[int, int, int, int]) -> None:
        """After the free callback gave the allocation's 4-tuple back."""
        _, size, va, cell = handle
        self.unmap_and_release(handle)
        self.cu.cuMemAddressFree(va, size)
        self._handles.pop(cell, None)

    def create_and_map(self, handle: tuple[int, int, int, int]) -> None:
        _, size, va, cell = handle
        self.ensure_context()
        h = self._handles[cell]
        self._check(
            "cuMemCreate", self.cu.cuMemCreate(ctypes.byref(h), size, ctypes.byref(self.prop), 0)
        )
        self._check("cuMemMap", self.cu.cuMemMap(va, size, 0, h.value, 0))
        self._check("cuMemSetAccess", self.cu.cuMemSetAccess(va, size, self.access, 1))

    def unmap_and_release(self, handle: tuple[int, int, int, int]) -> None:
        _, size, va, cell = handle
        self.ensure_context()
        self._check("cuMemUnmap", self.cu.cuMemUnmap(va, size))
        self._check("cuMemRelease", self.cu.cuMemRelease(self._handles[cell].value))

    # PyTorch's calls in vLLM's Python code, on the same driver
    def pinned(self, size: int) -> int:
        """``torch.empty(size, pin_memory=True)``: from PyTorch's cache of pinned
        blocks, else pinned now."""
        cached = self._pinned_cache.get(size)
        if cached:
            return cached.pop()
        p = _vp()
        rc = self.cu.cuMemHostAlloc(ctypes.byref(p), size, 0)
        if rc:
            raise RuntimeError("CUDA error: out of memory")  # what PyTorch says
        return int(p.value or 0)

    def unpin(self, ptr: int, size: int) -> None:
        """The tensor let go: its block back to PyTorch's cache (not to the driver)."""
        self._pinned_cache.setdefault(size, []).append(ptr)

    def empty_pinned_cache(self) -> None:
        for blocks in self._pinned_cache.values():
            for ptr in blocks:
                self.cu.cuMemFreeHost(ptr)
        self._pinned_cache.clear()

    def memcpy(self, dst: int, src: int, size: int, to_host: bool) -> None:
        """vLLM's ``libcudart.cudaMemcpy`` (synchronous)."""
        if to_host:
            rc = self.cu.cuMemcpyDtoH_v2(dst, src, size)
        else:
            rc = self.cu.cuMemcpyHtoD_v2(dst, src, size)
        if rc:  # as vLLM's CudaRTLibrary says it
            s = ctypes.c_char_p()
            self.cu.cuGetErrorString(rc, ctypes.byref(s))
            raise RuntimeError(f"CUDART error: {(s.value or b'unknown error').decode()}")

    def synchronize(self) -> None:
        """``torch.cuda.synchronize``."""
        self._check("cuCtxSynchronize", self.cu.cuCtxSynchronize())


class CuMemAllocator:
    instance: CuMemAllocator | None = None
    default_tag = "default"

    def __init__(self, lib: str) -> None:
        self.ext = CumemExtension(lib)
        self.pointer_to_data: dict[int, AllocationData] = {}
        self.current_tag = self.default_tag

    def _python_malloc_callback(self, handle: tuple[int, int, int, int]) -> None:
        self.pointer_to_data[handle[2]] = AllocationData(handle, self.current_tag)

    def _python_free_callback(self, ptr: int) -> tuple[int, int, int, int]:
        data = self.pointer_to_data.pop(ptr)
        if data.cpu_backup_tensor is not None:
            self.ext.unpin(data.cpu_backup_tensor.ptr, data.cpu_backup_tensor.size)
            data.cpu_backup_tensor = None
        self.ext.synchronize()  # vLLM drains the GPU's work before the unmap
        return data.handle

    def allocate(self, size: int, tag: str) -> int:
        """What a tensor made inside ``use_memory_pool(tag)`` gets (``my_malloc``)."""
        self.current_tag = tag
        try:
            va = self.ext.my_malloc(size, self._python_malloc_callback)
        finally:
            self.current_tag = self.default_tag
        if not va:
            raise RuntimeError("CUDA out of memory (vLLM's pool allocator)")
        return va

    def free(self, va: int) -> None:
        """A tensor of the pool freed (``my_free``)."""
        self.ext.my_free(self._python_free_callback(va))

    def sleep(self, offload_tags: tuple[str, ...] | str | None = None) -> None:
        if offload_tags is None:
            offload_tags = (self.default_tag,)
        elif isinstance(offload_tags, str):
            offload_tags = (offload_tags,)
        for va, data in self.pointer_to_data.items():
            size = data.handle[1]
            if data.tag in offload_tags:
                backup = HostCopy(self.ext.pinned(size), size)
                try:
                    self.ext.memcpy(backup.ptr, va, size, to_host=True)
                except BaseException:  # the tensor goes: its block back to PyTorch's cache
                    self.ext.unpin(backup.ptr, size)
                    raise
                data.cpu_backup_tensor = backup
            self.ext.unmap_and_release(data.handle)

    def wake_up(self, tags: list[str] | None = None) -> None:
        mapped = []  # rolled back on a failure, as vLLM does
        try:
            for va, data in self.pointer_to_data.items():
                if tags is None or data.tag in tags:
                    self.ext.create_and_map(data.handle)
                    mapped.append(va)
                    backup = data.cpu_backup_tensor
                    if backup is not None:
                        self.ext.memcpy(va, backup.ptr, backup.size, to_host=False)
                        self.ext.unpin(backup.ptr, backup.size)
                        data.cpu_backup_tensor = None
        except Exception:
            for va in mapped:
                with contextlib.suppress(Exception):  # vLLM logs these, raises the first
                    self.ext.unmap_and_release(self.pointer_to_data[va].handle)
            raise

    def free_all(self) -> None:
        """Every tensor of the pool freed (those mapped; as vLLM's engine ends)."""
        for va in list(self.pointer_to_data):
            self.free(va)
        self.ext.empty_pinned_cache()

    def write(self, va: int, data: bytes) -> None:
        """A model's bytes into an allocation (a synchronous copy)."""
        buf = ctypes.create_string_buffer(data, len(data))
        self.ext.memcpy(va, ctypes.addressof(buf), len(data), to_host=False)

    def read(self, va: int, n: int) -> bytes:
        buf = ctypes.create_string_buffer(n)
        self.ext.memcpy(ctypes.addressof(buf), va, n, to_host=True)
        return buf.raw

    def get_current_usage(self) -> int:
        return sum(d.handle[1] for d in self.pointer_to_data.values())


def modules(lib: str) -> tuple[dict[str, Any], CuMemAllocator]:
    """A ``sys.modules`` in which vLLM made its allocator (as its worker does at
    ``load_model`` with sleep mode on), its extension on the libcuda at ``lib``."""
    mod = types.ModuleType("vllm.device_allocator.cumem")
    cls = type("CuMemAllocator", (CuMemAllocator,), {})  # the singleton is this test's
    inst = cls(lib)
    cls.instance = inst
    mod.CuMemAllocator = cls  # type: ignore[attr-defined]
    return {"vllm.device_allocator.cumem": mod}, inst
